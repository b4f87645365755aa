"""Evaluation: the training agent loop on held-out or benchmark instances, with honest labels.

  runner.py    jobs (instance x sample x seed) -> run_agent with any engine -> records.jsonl (resumable),
               summary with Wilson 95 % intervals; the Docker check
  stats.py     Wilson score interval
  embedded.py  held-out embedded tasks in the local sandbox; evaluate_embedded() for the trainer
  swebench.py  SWE-bench: rollouts in each instance's image, predictions.jsonl, official swebench harness
  tbench.py    Harbor-format terminal tasks (docker or local executor), or delegation to `harbor run`
Importing this package imports neither torch nor swebench.
"""
