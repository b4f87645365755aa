"""`tsrl sweep` as a library: experiments x seeds x schedules -> a plan of runs, then each run in turn
through the same `train` as `tsrl train`. A sweep resumes where it stopped.

    plan = plan_sweep(["experiments/spread/grpo_sigma1.0.yaml"], schedules=("sync", "stream"), seeds=(42, 43))
    outcomes = run_sweep(plan, progress=print)

Every run of an experiment is that experiment's config with only `schedule`, `seed` and `run.out`
changed: same workload, same device split, same seed list in every row (the ThunderSyncRL report's
measurement discipline). Run directories are `<out>/<experiment name>/<schedule>/seed<k>/`, which is where
`tsrl train` writes and what `tsrl report` reads.

Order: experiment, then seed, then schedule. The schedules of one seed run back to back, as in
`tsrl bench speedup`, so slow drift in the machine's load falls on every schedule alike.

What the plan does with a run directory that already exists:

    status   on disk                                     action
    todo     nothing measured yet                        run
    done     DONE, at least the planned rounds           skip
    partial  rounds but no DONE, and a checkpoint        resume (tsrl train --resume)
    partial  DONE with fewer rounds than planned         resume (continue to the planned rounds)
    partial  rounds but no DONE, and no checkpoint       restart (its rows are dropped)

A directory whose config.yaml differs from the planned config (outside `rounds` and `run.*`) is an
error at plan time: the sweep never mixes two workloads under one experiment name.

`sweep.json` at the root of `out` records the warm-up (and rounds, seeds, schedules per
experiment) that the sweep was planned with; training itself does not use the warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tsrl_cli.config import SCHEDULES, ConfigError, TrainConfig, config_diff, load_config, validate_config
from tsrl_cli.errors import UsageError
from tsrl_cli.files import write_json_atomic
from tsrl_cli.report.aggregate import seed_value
from tsrl_cli.rl.train import TrainError, train
from tsrl_cli.rundir import DONE, LOGS, METRICS, RunDir, read_sweep, sweep_path

DEFAULT_SCHEDULES = ("sync", "stream", "async")
DEFAULT_SEEDS = (42, 43, 44)  # the paper's seed list
DEFAULT_WARMUP = 4  # rounds 1-4 excluded from every average (the ThunderSyncRL report)


@dataclass(frozen=True)
class PlannedRun:
    experiment: str  # the config's `name`: the first level under `out`
    schedule: str
    seed: int
    run_dir: Path
    status: str  # todo | done | partial
    action: str  # run | skip | resume | restart
    rounds_done: int  # rounds already in metrics.jsonl
    checkpoint: int | None  # the round of the last checkpoint (where a resume starts)
    cfg: TrainConfig = field(repr=False, compare=False)

    def as_row(self) -> dict:
        return {"experiment": self.experiment, "schedule": self.schedule, "seed": self.seed,
                "run_dir": str(self.run_dir), "status": self.status, "action": self.action,
                "rounds": self.cfg.rounds, "rounds_done": self.rounds_done, "checkpoint": self.checkpoint}


@dataclass(frozen=True)
class SweepPlan:
    out: Path
    experiments: dict[str, dict]  # name -> {"file", "rounds", "objective"}
    schedules: tuple[str, ...]
    seeds: tuple[int, ...]
    warmup: int
    sets: tuple[str, ...]
    runs: list[PlannedRun]

    def as_dict(self) -> dict:
        return {"out": str(self.out), "experiments": self.experiments, "schedules": list(self.schedules),
                "seeds": list(self.seeds), "warmup": self.warmup, "sets": list(self.sets),
                "runs": [r.as_row() for r in self.runs]}


# ---------------------------------------------------------------------------- the plan


def parse_schedules(text: str) -> tuple[str, ...]:
    """'sync,stream' -> ('sync', 'stream'); unknown or repeated names are a UsageError."""
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in chosen if s not in SCHEDULES]
    if bad or not chosen:
        raise UsageError(f"--schedules: {', '.join(bad) or 'none given'}: use {', '.join(SCHEDULES)} "
                         "(comma-separated)")
    if len(set(chosen)) != len(chosen):
        raise UsageError(f"--schedules {text}: a schedule is listed twice")
    return chosen


def parse_seeds(text: str) -> tuple[int, ...]:
    """'42,43,44' -> (42, 43, 44)."""
    parts = [s.strip() for s in text.split(",") if s.strip()]
    try:
        seeds = tuple(int(s) for s in parts)
    except ValueError:
        raise UsageError(f"--seeds {text}: expected comma-separated integers, e.g. 42,43,44") from None
    if not seeds:
        raise UsageError("--seeds: give at least one seed, e.g. 42,43,44")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text}: a seed is listed twice")
    return seeds


def plan_sweep(experiments: Sequence[str | Path], *, schedules: Sequence[str] = DEFAULT_SCHEDULES,
               seeds: Sequence[int] = DEFAULT_SEEDS, rounds: int | None = None, warmup: int = DEFAULT_WARMUP,
               sets: Sequence[str] = (), out: str | Path = "results") -> SweepPlan:
    """Resolve every experiment (defaults < YAML < sets < --rounds), check it, and list its runs with
    their status on disk. Reads only; raises UsageError (ConfigError) on bad input."""
    if not experiments:
        raise UsageError("name at least one experiment file, e.g. experiments/smoke/tiny_cpu.yaml")
    schedules = parse_schedules(",".join(schedules))
    seeds = parse_seeds(",".join(str(s) for s in seeds))
    if warmup < 0:
        raise UsageError(f"--warmup {warmup}: must be >= 0")
    if rounds is not None and rounds < 1:
        raise UsageError(f"--rounds {rounds}: must be >= 1")
    out = Path(out)
    bases: dict[str, tuple[str, TrainConfig]] = {}
    for path in experiments:
        base = load_config(path, list(sets), {"rounds": rounds})
        if base.name in bases:
            raise UsageError(f"{path} and {bases[base.name][0]} share the experiment name {base.name!r}: "
                             "give each file its own `name:`")
        if warmup >= base.rounds:
            raise UsageError(f"--warmup {warmup} leaves no measured round of {base.rounds} in {path}; "
                             "raise --rounds or lower --warmup")
        bases[base.name] = (str(path), base)
    runs = []
    for name, (_path, base) in bases.items():
        for seed in seeds:
            for schedule in schedules:
                run_dir = out / name / schedule / f"seed{seed}"
                cfg = validate_config(replace(base, schedule=schedule, seed=seed,
                                              run=replace(base.run, out=str(run_dir))))
                runs.append(_planned(cfg, run_dir))
    info = {name: {"file": path, "rounds": base.rounds, "objective": base.objective}
            for name, (path, base) in bases.items()}
    return SweepPlan(out, info, schedules, seeds, warmup, tuple(sets), runs)


def _planned(cfg: TrainConfig, run_dir: Path) -> PlannedRun:
    """The status of one run directory against the config planned for it."""
    log = RunDir(run_dir)
    rows = log.rows(METRICS)
    ckpts = log.checkpoints()
    done = log.done()
    last_ckpt = max(ckpts) if ckpts else None

    def make(status, action):
        return PlannedRun(cfg.name, cfg.schedule, cfg.seed, run_dir, status, action, len(rows), last_ckpt, cfg)

    if not log.started() or not (rows or ckpts or done):
        return make("todo", "run")
    try:
        stored = log.config()
    except ConfigError as e:
        raise UsageError(f"{run_dir}: its config.yaml does not load ({e}); "
                         "move the directory away or use --out") from None
    diff = config_diff(stored, cfg, ignore=("rounds", "run"))
    if diff:
        raise UsageError(f"{run_dir} holds a run with another config ({', '.join(diff[:6])} differ); "
                         "move it away or sweep into another --out")
    if done and len(rows) >= cfg.rounds:
        return make("done", "skip")
    if ckpts:  # DONE with fewer rounds than planned always has its final checkpoint
        return make("partial", "resume")
    return make("partial", "restart")


# ---------------------------------------------------------------------------- running it


def run_sweep(plan: SweepPlan, progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every planned run that is not done, one after another; one outcome dict per planned run.

    A run that fails (TrainError) is recorded and the sweep goes on; a UsageError (bad data, missing
    model) stops it, since every later run would fail the same way. Progress events: `sweep_run`
    before each run (index, total, the plan row), then train's own events, then `sweep_run_end`.
    """
    progress = progress or (lambda ev: None)
    write_sweep_file(plan)
    todo = [r for r in plan.runs if r.action != "skip"]
    outcomes = []
    for r in plan.runs:
        row = r.as_row()
        if r.action == "skip":
            outcomes.append({**row, "outcome": "skipped", **_measured(r, plan.warmup)})
            continue
        index = len([o for o in outcomes if o["outcome"] != "skipped"]) + 1
        progress({"event": "sweep_run", "index": index, "total": len(todo), **row})
        if r.action == "restart":
            _drop_rows(r.run_dir)
        t0 = time.monotonic()
        try:
            train(r.cfg, resume=r.action == "resume", progress=progress)
            outcome = {**row, "outcome": "done", "error": None}
        except TrainError as e:
            outcome = {**row, "outcome": "failed", "error": str(e).strip().splitlines()[0]}
        outcome.update(sweep_wall_s=time.monotonic() - t0, **_measured(r, plan.warmup))
        outcomes.append(outcome)
        progress({"event": "sweep_run_end", "index": index, "total": len(todo), **outcome})
    return outcomes


def _drop_rows(run_dir: Path) -> None:
    """A partial run with no checkpoint starts over: its rows (and a stale DONE) go; config.yaml is
    rewritten by train. Only files of the run-directory contract are touched."""
    for name in (*LOGS, DONE):
        (run_dir / name).unlink(missing_ok=True)


def _measured(r: PlannedRun, warmup: int) -> dict:
    """Rounds on disk and the mean step time after the warm-up (report.aggregate's first stage)."""
    run = RunDir(r.run_dir)
    rows = run.rows(METRICS)
    step, n = seed_value({m["round"]: m.get("step_time_s") for m in rows}, warmup, max(r.cfg.rounds, 1))
    return {"rounds_on_disk": len(rows), "step_time_mean_s": step, "rounds_measured": n,
            "done_file": run.done()}


def write_sweep_file(plan: SweepPlan) -> Path:
    """<out>/sweep.json: the warm-up and, per experiment, the file, rounds, seeds and schedules.

    Earlier sweeps' experiments in the same `out` are kept; the top-level `warmup` is this sweep's.
    """
    path = sweep_path(plan.out)
    doc = read_sweep(plan.out)
    experiments = doc.get("experiments") if isinstance(doc.get("experiments"), dict) else {}
    for name, info in plan.experiments.items():
        experiments[name] = {**info, "schedules": list(plan.schedules), "seeds": list(plan.seeds),
                             "warmup": plan.warmup, "sets": list(plan.sets)}
    doc = {"warmup": plan.warmup, "experiments": experiments, "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc)
    return path
