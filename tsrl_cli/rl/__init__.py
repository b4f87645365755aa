"""The round engine: one round's gradient, the processes of a run, and the run's record.

The gradient of a round (what `tsrl verify` and every schedule share):
  objective.py        Objective (grpo | opd and the checked loss settings), the lazy reference loss
  arrivals.py         Arrival, and each objective's arrival rules: where an arrival's gradient goes
  microbatch.py       the micro-batch planner: arrivals, caps and ranks in, micro-batches out (no torch)
  batchloss.py        the losses of one micro-batch: one forward, one loss per backward pass
  learner.py          StreamLearner: arrivals in, micro-batches backwarded, scalars joined at close
  schedules.py        sync | stream | async: the same learner, only the timing differs (ScheduleHost)
  hostfold.py         streaming buffers in host memory, folded off the learner's critical path
  group.py            a sharded learner group: FSDP2 with the folding all-to-all (ShardedGrads)
  ranks.py            the learner's ranks behind one interface: OneProcess | ShardedRanks
  masters.py          float32 master weights of a bf16 model (optim.master_dtype), one process or a group
  certificate.py      the exactness certificate: a round's gradient recomputed the other way (run.verify_every)

The processes of a run:
  types.py            what flows between processes (round plans, trajectories, turns)
  placement.py        where every process is, resolved once; the worker entry points' args objects
  tasks.py            task tables (prepared datasets or builtin:echo) and the per-round draw
  toy.py              builtin:echo tasks and the builtin:toy policy (tests, benchmarks)
  rollout_worker.py   concurrent agent sessions over an engine pool; emits trajectories / turns
  replicas.py         engine pools: the engine in the rollout process, replica processes, remote servers
  weightbus.py        new weights from the learner to every engine over torch.distributed (buckets)
  teacher_worker.py   OPD: scores each model turn the moment it closes
  learner_worker.py   model + optimizer; one step per round; offers weights to the bus; checkpoints
  preflight.py        what `tsrl train` checks before any process starts (models, devices, packages)
  train.py            the orchestrator: `tsrl train` as a library function
  faults.py           the fault hooks tests use to hold or break a run (read nowhere else)
  bench.py            `tsrl bench speedup`

The run's record:
  reports.py          what the processes report to the orchestrator each round (typed), and the message kinds
  record.py           a round's metrics and events rows from its reports; the run's summary (DONE)
  runlog.py           the run directory (docs/run-directory.md)
  journal.py          a round's ended trajectories, durable, for a resume mid-round
  trackers.py         each round's metrics to TensorBoard / W&B too (run.trackers)

The three jobs stay one flat package: as subpackages every import path would grow by a level
(tsrl_cli.rl.round.learner) without removing a cycle or an import, so the grouping lives here.
Imports no typer, rich or CLI code (progress flows out through callbacks).
"""
