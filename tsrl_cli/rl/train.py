"""`tsrl train` as a library function: the orchestrator of one run.

The orchestrator is light: it plans the rounds (prompts drawn by (seed, round)), starts the
processes, and writes each round's record (rl/record.py) into the run directory (docs/run-directory.md)
once the processes' reports of it (rl/reports.py) are in:

    rollout process  --trajectories (GRPO) / closed turns (OPD)-->  [teacher process]  -->  learner process
          ^                                                                                   |
          +--------------------------- new weights at round end ------------------------------+

Round clock: round 1 starts when the rollout process starts generating it; round k starts when
round k-1 ended. A round ends when its weight sync ends: the rollout process has loaded the new
weights (sync, stream), or the learner has published them (async, whose rollout side runs ahead
and loads them at its next round boundary). So step times add up to the run's wall time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tsrl_cli.config import TrainConfig, config_diff, dump_config
from tsrl_cli.devices import device_of, engine_device
from tsrl_cli.engines.load import open_engine
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.evals.embedded import evaluate_embedded
from tsrl_cli.files import write_json_atomic
from tsrl_cli.policy import load_tokenizer
from tsrl_cli.processes import guarded, sigterm_raises, thread_env
from tsrl_cli.rl.group import torchrun_env
from tsrl_cli.rl.journal import replay_of
from tsrl_cli.rl.learner_worker import LearnerArgs, learner_main
from tsrl_cli.rl.objective import Objective
from tsrl_cli.rl.placement import Placement
from tsrl_cli.rl.preflight import check_placement, check_torchrun, resolve_model
from tsrl_cli.rl.record import round_record, summarize
from tsrl_cli.rl.replicas import ReplicaArgs, replica_daemonic, replica_main
from tsrl_cli.rl.reports import Report, RoundReports, WeightSync
from tsrl_cli.rl.rollout_worker import RolloutArgs, rollout_main
from tsrl_cli.rl.runlog import RunLog
from tsrl_cli.rl.tasks import load_task_table, plan_round, prepare_environments
from tsrl_cli.rl.teacher_worker import TeacherArgs, teacher_main
from tsrl_cli.rl.trackers import Trackers, open_trackers, require_trackers
from tsrl_cli.rl.weightbus import serve_store
from tsrl_cli.rundir import DONE, EVAL_ROUND0, EVENTS, LOGS, METRICS, PIDS, ROLLOUTS

PRELOAD = ["torch", "transformers", "tsrl_cli.rl.rollout_worker", "tsrl_cli.rl.learner_worker", "tsrl_cli.rl.replicas",
           "tsrl_cli.rl.teacher_worker", "transformers.models.qwen3.modeling_qwen3"]


class TrainError(OperationFailed):
    """A worker process failed; the message names it and its last traceback line."""


def save_at(cfg: TrainConfig, round_: int) -> bool:
    return (round_ == cfg.rounds or (cfg.run.save_every > 0 and round_ % cfg.run.save_every == 0)
            or (cfg.eval.every > 0 and round_ % cfg.eval.every == 0))


def _prepare_run(run: RunLog, cfg: TrainConfig, resume: bool, policy_dir: str) -> tuple[int, str, dict]:
    """(rounds already done, weights to start from, wall/core offsets); writes config.yaml."""
    if not resume:
        if run.started() and (run.rows(METRICS) or run.checkpoints()):
            raise UsageError(f"{run.root} already holds a run: pass --resume to continue it, or --out for a new one")
        for name in (*LOGS, DONE):  # a start that never finished a round
            (run.root / name).unlink(missing_ok=True)
        run.forget_journal()
        run.write_config(dump_config(cfg))
        return 0, policy_dir, {"wall_s": 0.0, "core_s": 0.0}
    stored = run.config()
    # placement and micro-batching change where and when the gradient is computed, not what it is:
    # a run resumes on another number of learner ranks or devices
    diff = config_diff(stored, cfg, ignore=("rounds", "run", "devices", "learner"))
    if diff:
        raise UsageError(f"--resume: the config differs from {run.config_path} in {', '.join(diff)}")
    ckpts = run.checkpoints()
    if not ckpts:
        raise UsageError(f"--resume: {run.root} has no checkpoint; checkpoints are written every --save-every K rounds")
    k, path = max(ckpts.items())
    if k >= cfg.rounds and run.done_path.is_file():
        raise UsageError(f"--resume: {run.root} is complete ({k} rounds); raise --rounds to continue it")
    run.keep_rounds_up_to(k)
    run.remove_done()
    run.write_config(dump_config(cfg))
    last = run.rows(METRICS)
    offsets = {"wall_s": last[-1]["wall_s"] if last else 0.0, "core_s": last[-1]["core_s"] if last else 0.0}
    return k, str(path), offsets


def train(cfg: TrainConfig, *, resume: bool = False, progress: Callable[[dict], None] | None = None) -> dict | None:
    """Run (or resume) one training run; returns the summary also written to DONE.

    Under torchrun, global rank 0 runs the whole run (and learner rank 0); every other rank is a
    learner rank only, gets the run's plan from rank 0, and returns None."""
    progress = progress or (lambda ev: None)
    thread_env()  # inherited by the worker processes (and the forkserver) before torch starts
    launched = torchrun_env()
    if launched is not None:
        check_torchrun(cfg)
        if launched[0] != 0:
            Objective(cfg.objective, cfg.loss)
            learner_main(LearnerArgs.for_torchrun_rank(cfg, launched[0], launched[1]))
            return None

    run = RunLog(cfg.run_dir())
    if resume and not run.started():  # before the data and model checks, whose hints would mislead here
        raise UsageError(f"--resume: {run.root} holds no run (no config.yaml)")
    Objective(cfg.objective, cfg.loss)  # a bad or out-of-scope loss setting fails here, before any process starts
    check_placement(cfg)
    require_trackers(cfg.run.trackers)  # a tracker asked for but not installed: exit 2 before anything is written
    table = load_task_table(cfg.data.train, cfg.data.limit)
    keys = list(table)
    policy_dir = resolve_model(cfg.model.policy, "model.policy", cfg)
    teacher_dir = resolve_model(cfg.model.teacher, "model.teacher") if cfg.objective == "opd" else None
    start, init_dir, offsets = _prepare_run(run, cfg, resume, policy_dir)
    prepare_environments(cfg, table, load_tokenizer(policy_dir), run.root / "builds",
                         lambda line: progress({"event": "log", "who": "docker", "line": line}))
    # a round right after a checkpoint journals its trajectories (rl/journal.py): a resume from that checkpoint
    # replays them (the checkpoint a resume started from, or one this run writes; save_at(cfg, 0): round-0's)
    plans = [plan_round(keys, cfg.seed, r, cfg.rollout.prompts_per_round, cfg.rollout.group_size, save_at(cfg, r),
                        journal=(r - 1 == start and start > 0) or save_at(cfg, r - 1))
             for r in range(start + 1, cfg.rounds + 1)]
    resumed = []
    if resume and plans:  # a round stopped midway: its ended trajectories go to the learner again
        bound = cfg.offpolicy.max_staleness if cfg.schedule == "async" else 0
        resumed = replay_of(run, plans[0], start, bound)
        if resumed:
            progress({"event": "log", "who": "resume", "line": f"round {plans[0].round}: {len(resumed)} of "
                      f"{plans[0].num_trajectories} trajectories from its journal go to the learner again; "
                      "the rest are generated"})
    elif resume:
        run.forget_journal()
    progress({"event": "start", "run_dir": str(run.root), "first_round": start + 1, "rounds": cfg.rounds,
              "trajectories_per_round": plans[0].num_trajectories if plans else 0})
    trackers = open_trackers(run.root, cfg, cfg.run.trackers, first_round=start + 1)
    for note in trackers.notes:
        progress({"event": "log", "who": "trackers", "line": note})
    failed = True
    try:
        if plans:
            save_initial = (cfg.run.save_every > 0 or cfg.eval.every > 0) and start == 0
            with sigterm_raises(), Workers(cfg, init_dir, policy_dir, teacher_dir, start, str(run.root), plans,
                                           save_initial, resumed) as workers:
                Orchestrator(cfg, run, workers, plans, offsets, progress, trackers).run()
            run.forget_journal()  # the last round's checkpoint holds every round (and no worker writes now)
        if cfg.eval.every > 0:
            evaluate_checkpoints(cfg, run, progress, trackers)
        failed = False
    finally:
        trackers.close(failed)  # before DONE, which is written last
    summary = summarize(cfg, run)
    run.write_done(summary)
    progress({"event": "done", "summary": summary})
    return summary


def eval_device(cfg: TrainConfig) -> str:
    """Where the held-out evaluation runs once the rounds are over (their processes have exited): the rollout
    side's first device when this node ran the engines, else (remote servers) the first GPU, else cpu."""
    if cfg.rollout.engine == "openai":
        return engine_device(None)
    return device_of(cfg, "rollout")


def evaluate_checkpoints(cfg: TrainConfig, run: RunLog, progress: Callable[[dict], None],
                         trackers: Trackers | None = None) -> None:
    """`eval.every` K: the held-out evaluation of the weights after every K-th round, from its checkpoint.

    It runs after the rounds, in this process, so that it never shares the cores with rollout or
    learning and the rounds' timings stay clean. Its metrics (`eval/<dataset>/success`, `/n`,
    `/ci95_low`, `/ci95_high`) join that round's metrics row (rewritten atomically); the initial
    weights' evaluation (round-0) goes to `eval_round0.json`. Rounds already evaluated are skipped.
    The trackers get each evaluation at its round (round-0 at step 0). The checkpoint is served by the hf
    engine on eval_device(cfg), in the engine's dtype there (engines/load.py open_engine).
    """
    device = eval_device(cfg)
    rows = run.rows(METRICS)
    by_round = {r["round"]: r for r in rows}
    for k, ckpt in run.checkpoints().items():
        if k % cfg.eval.every or (k in by_round and any(key.startswith("eval/") for key in by_round[k])):
            continue
        if k == 0 and (run.root / EVAL_ROUND0).is_file():
            continue
        if k != 0 and k not in by_round:
            continue
        engine, _ = open_engine(str(ckpt), "hf", (device,))
        res = evaluate_embedded(None, load_tokenizer(ckpt), list(cfg.eval.datasets), samples=cfg.eval.samples,
                                temperature=cfg.eval.temperature, limit=cfg.eval.limit, model_name=str(ckpt),
                                engine=engine, chat_template=cfg.model.chat_template, thinking=cfg.rollout.thinking)
        del engine  # one checkpoint's weights on the device at a time
        metrics = res["metrics"]
        progress({"event": "eval", "round": k, "metrics": metrics})
        if trackers is not None:
            trackers.log(metrics, step=k)
        if k == 0:
            write_json_atomic(run.root / EVAL_ROUND0, metrics)
        else:
            by_round[k].update(metrics)
            run.rewrite(METRICS, rows)


class Workers:
    """The rollout, learner and (OPD) teacher processes and their queues.

    A learner of N devices is N processes, `learner-0` .. `learner-{N-1}` (rl/group.py): they meet
    through a FileStore in a temporary folder; rank 0 holds the queues.
    """

    def __init__(self, cfg, init_dir, policy_dir, teacher_dir, start, run_dir, plans, save_initial, resumed=()):
        ctx = mp.get_context(cfg.run.start_method)
        if cfg.run.start_method == "forkserver":  # workers fork from a server that imported torch once
            ctx.set_forkserver_preload(PRELOAD)
        self.report_q, self.want_q, self.go = ctx.Queue(), ctx.Queue(), ctx.Event()
        traj_q = ctx.Queue()  # rollout -> learner (GRPO) or rollout -> teacher (OPD)
        learn_q = ctx.Queue() if teacher_dir else traj_q  # what the learner consumes
        self.queues = [self.report_q, self.want_q, traj_q] + ([learn_q] if teacher_dir else [])
        # the weight bus's meeting point (rl/weightbus.py): served here, joined by the learner and every engine
        self.store = serve_store(cfg.rollout.weight_bus_host, cfg.rollout.weight_bus_port)
        placement = Placement.of(cfg, cfg.rollout.weight_bus_host, self.store.port)  # resolved once, for every worker
        replica_qs = None
        specs = {}
        if len(placement.replicas) > 1:  # engine-0 .. engine-{N-1}, fed by the rollout process
            replica_qs = ([ctx.Queue() for _ in placement.replicas], ctx.Queue())
            self.queues += [*replica_qs[0], replica_qs[1]]
            for k in range(len(placement.replicas)):
                specs[f"engine-{k}"] = (replica_main, ReplicaArgs(cfg, placement, init_dir, policy_dir, start, k,
                                                                  replica_qs[0][k], replica_qs[1], self.report_q))
        specs["rollout"] = (rollout_main, RolloutArgs(cfg, placement, init_dir, policy_dir, start, plans, traj_q,
                                                      self.want_q, self.report_q, self.go, replica_qs, run_dir,
                                                      tuple(resumed)))
        launched = torchrun_env()  # under torchrun this node runs learner rank 0; the other ranks are torchrun's
        world = launched[1] if launched else len(placement.learner)
        self.store_dir = tempfile.mkdtemp(prefix="tsrl-learners-") if world > 1 and not launched else None
        for rank in range(1 if launched else world):
            name = "learner" if world == 1 else f"learner-{rank}"
            store = os.path.join(self.store_dir, "store") if self.store_dir else None
            lead = rank == 0
            specs[name] = (learner_main, LearnerArgs(cfg, placement, rank, world, store, init_dir, policy_dir, start,
                                                     run_dir, plans, save_initial, learn_q if lead else None,
                                                     self.want_q if lead else None, self.report_q))
        if teacher_dir:
            specs["teacher"] = (teacher_main, TeacherArgs(cfg, placement, teacher_dir, plans, traj_q, learn_q,
                                                          self.report_q))
        self.procs = {name: ctx.Process(target=guarded, args=(name, self.report_q, os.getpid(), fn, args),
                                        name=f"tsrl-{name}", daemon=replica_daemonic(cfg, name))
                      for name, (fn, args) in specs.items()}
        self.pids_file = Path(run_dir) / PIDS

    def __enter__(self):
        for p in self.procs.values():
            p.start()
        write_json_atomic(self.pids_file, {"main": os.getpid(), **{n: p.pid for n, p in self.procs.items()}})
        return self

    def __exit__(self, *exc):
        for p in self.procs.values():
            p.join(timeout=0 if exc[0] else 30)
        for p in self.procs.values():  # only our own children, by handle
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        for q in self.queues:
            q.cancel_join_thread()
            q.close()
        self.pids_file.unlink(missing_ok=True)
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        self.store = None  # the weight bus's TCPStore stops with its last reference
        return False

    def killed(self) -> str | None:
        """The first worker that died by a signal ("the learner-1 process was killed by signal 9"), if any."""
        for name, p in self.procs.items():
            if p.exitcode is not None and p.exitcode < 0:
                return f"the {name} process was killed by signal {-p.exitcode}"
        return None


class Orchestrator:
    """Reads the report queue (rl/reports.py) and writes each round's record as soon as its reports are in."""

    def __init__(self, cfg: TrainConfig, run: RunLog, workers: Workers, plans, offsets: dict, progress,
                 trackers: Trackers | None = None):
        self.cfg, self.run_log, self.w, self.plans, self.progress = cfg, run, workers, plans, progress
        self.trackers = trackers if trackers is not None else Trackers([])
        self.offsets = offsets
        self.parts: dict[int, RoundReports] = {p.round: RoundReports() for p in plans}
        self.applied: dict[int, WeightSync] = {}  # weights version -> the rollout side's load of it
        self.on_policy = cfg.schedule != "async"
        self.next_round = plans[0].round
        self.round_start: float | None = None
        self.t_first: float | None = None

    def run(self) -> None:
        names = set(self.w.procs)
        ready: set[str] = set()
        finished: set[str] = set()
        while finished != names:
            try:
                kind, who, payload = self.w.report_q.get(timeout=1.0)
            except queue.Empty:
                for name, p in self.w.procs.items():
                    if name not in finished and p.exitcode is not None:
                        how = (f"was killed by signal {-p.exitcode}" if p.exitcode < 0
                               else f"exited with code {p.exitcode}")
                        raise TrainError(f"the {name} process {how} without a report; `tsrl train --resume` "
                                         "continues from the last checkpoint") from None
                continue
            if kind == Report.error:
                # a rank that lost a peer fails in its collective; name the peer that died, if one did
                deadline = time.monotonic() + 2.0
                while (cause := self.w.killed()) is None and time.monotonic() < deadline and who.startswith("learner-"):
                    time.sleep(0.1)
                if cause is not None:
                    raise TrainError(f"{cause}; `tsrl train --resume` continues from the last checkpoint")
                last = payload.strip().splitlines()[-1] if payload.strip() else "?"
                last = re.sub(r"^tsrl_cli\.[\w.]+Failed: ", "", last)  # our own failures say what happened
                raise TrainError(f"the {who} process failed: {last}\n{payload}")
            if kind == Report.ready:
                ready.add(who)
                if ready == names:
                    self.w.go.set()
            elif kind == Report.done:
                finished.add(who)
            elif kind == Report.progress:
                self.progress({"event": who, **payload})
            elif kind == Report.log:  # a line worth the user's eyes (a remote server marked dead, ...)
                self.progress({"event": "log", "who": who, "line": payload})
            elif kind == Report.weights_applied:
                self.applied[who] = payload
            elif kind == Report.rollout_round:
                self.parts[who].rollout = payload
            elif kind == Report.learner_round:
                self.parts[who].learner = payload
            elif kind == Report.teacher_round:
                self.parts[who].teacher = payload
            self._close_rounds()
        if self.next_round <= self.plans[-1].round:
            raise TrainError(f"the workers stopped before round {self.next_round} was complete")

    def _complete(self, k: int) -> bool:
        return self.parts[k].complete(self.cfg.objective == "opd") and (not self.on_policy or k in self.applied)

    def _close_rounds(self) -> None:
        while self.next_round in self.parts and self._complete(self.next_round):
            k = self.next_round
            p = self.parts.pop(k)
            if self.round_start is None:
                self.round_start = self.t_first = p.rollout.gen_start
            published = p.learner.publish
            # the round ends when the rollout side has loaded its weights (sync, stream) or they are published (async)
            sync = (replace(self.applied[k], start=published.start) if self.on_policy
                    else WeightSync(published.start, published.end))
            row, events = round_record(self.cfg, k, p, self.round_start, sync)
            wall = sync.end - self.t_first
            row["wall_s"] = self.offsets["wall_s"] + wall
            row["core_s"] = self.offsets["core_s"] + wall * len(self.w.procs)
            self.run_log.append(METRICS, [row])
            self.trackers.log(row, step=k)  # the same row, numeric keys only (run.trackers)
            self.run_log.append(EVENTS, events)
            if self.cfg.run.save_rollouts:
                self.run_log.append(ROLLOUTS, p.rollout.rollouts or [])
            if p.learner.checkpoint:  # round k is in a checkpoint: no resume replays its journal
                self.run_log.forget_journal(upto=k)
            self.progress({"event": "round", "row": row})
            self.round_start = sync.end
            self.next_round += 1
