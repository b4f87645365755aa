"""The round engine: rollout, teacher and learner processes, and the orchestrator that drives rounds.

  learner.py          Objective, the lazy loss and the StreamLearner: one round's gradient, two timings
  schedules.py        sync | stream | async: the same learner, only the timing differs
  types.py            what flows between processes (round plans, trajectories, turns)
  tasks.py            task tables (prepared datasets or builtin:echo) and the per-round draw
  toy.py              builtin:echo tasks and the builtin:toy policy (tests, benchmarks)
  rollout_worker.py   concurrent agent sessions over an engine pool; emits trajectories / turns
  replicas.py         engine pools: the engine in the rollout process, replica processes, remote servers
  weightbus.py        new weights from the learner to every engine over torch.distributed (buckets)
  teacher_worker.py   OPD: scores each model turn the moment it closes
  learner_worker.py   model + optimizer; one step per round; offers weights to the bus; checkpoints
  masters.py          float32 master weights of a bf16 model (optim.master_dtype), one process or a group
  runlog.py           the run directory (docs/run-directory.md)
  train.py            the orchestrator: `tsrl train` as a library function
  bench.py            `tsrl bench speedup`

Imports no typer, rich or CLI code (progress flows out through callbacks).
"""
