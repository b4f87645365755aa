"""`tsrl bench speedup`: the same workload under sync, stream and async, one run each, alternating.

Only the schedule changes between runs: same config, seed, prompts and engine. Knobs for the
rollout/learning balance (injected tool latency, model size) and the duration spread (lognormal
sigma of the injected latency) are ordinary config overrides. Per schedule: median step time over
the rounds after the warm-up, speedup over sync, learner idle fraction, peak memory; for stream,
the speedup predicted from its own trace by tsrl_cli.predict (arrival times and learner costs
replayed), when that module is installed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tsrl_cli.config import TrainConfig
from tsrl_cli.errors import UsageError
from tsrl_cli.predict import predict_trace
from tsrl_cli.rl.train import train
from tsrl_cli.rundir import METRICS, RunDir
from tsrl_cli.traces import load_trace


def _predicted(run_dir: Path, warmup: int) -> dict | None:
    """tsrl_cli.predict on a run's own trace; {"error": ...} when the prediction fails."""
    try:
        doc = predict_trace(load_trace(run_dir), warmup=warmup)
    except Exception as e:  # noqa: BLE001 - a prediction problem must not lose the measurements
        return {"error": f"{type(e).__name__}: {e}"}
    return {k: doc.get(k) for k in ("speedup", "speedup_async", "ceiling", "sync_s", "stream_s", "async_s",
                                   "mean_abs_error_pct", "stream_group_s", "speedup_group", "arrival_icc")}


# `--schedules` names: the schedules, and stream per group (learner.granularity group: a group's backwards wait
# for its last member), measured beside stream per trajectory
STREAM_GROUP = "stream-group"


def run_config(base: TrainConfig, name: str, run_dir: Path) -> TrainConfig:
    """The base config as schedule `name` runs it (stream-group: stream with learner.granularity group)."""
    run = replace(base.run, out=str(run_dir), save_every=0, save_rollouts=False)
    if name == STREAM_GROUP:
        return replace(base, schedule="stream", run=run, learner=replace(base.learner, granularity="group"))
    return replace(base, schedule=name, run=run)


BALANCE_ROUNDS = 3  # per calibration run; its first round (warm-up: first forwards, allocations) is left out


def _calibrate(base: TrainConfig, latency: float, run_dir: Path, progress) -> dict:
    """One short stream run at this median tool latency: medians of its rollout makespan and learner busy time."""
    cfg = run_config(replace(base, rounds=BALANCE_ROUNDS,
                             rollout=replace(base.rollout, tool_latency_median_s=latency)), "stream", run_dir)
    progress({"event": "run", "schedule": "balance", "repeat": 0, "run_dir": str(run_dir)})
    train(cfg, progress=progress)
    rs = RunDir(run_dir).rows(METRICS)[1:]
    return {"tool_latency_median_s": latency,
            "rollout_makespan_s": statistics.median(r["rollout_makespan_s"] for r in rs),
            "learner_busy_s": statistics.median(r["learner_busy_s"] for r in rs)}


def balance(base: TrainConfig, out_root: str | Path, progress: Callable[[dict], None] | None = None) -> dict:
    """The median tool latency at which the rollout's makespan equals the learner's work on this machine.

    With the same seeds the injected latencies are the median times fixed lognormal factors, so a round's makespan
    is about a + b * median (a: generation, b: the slowest trajectory's summed factors). Two short stream runs, at
    no latency and at the config's (or 0.5 s), give a and b; the learner's work W is the busy time they measured (the
    same arrivals and backwards at either latency). The balance is L = (W - a) / b: rollout and learner work equal,
    stream's ideal speedup over sync 2x. A learner faster than generation alone cannot be balanced by latency."""
    progress = progress or (lambda ev: None)
    root = Path(out_root) / "balance"
    hi = base.rollout.tool_latency_median_s or 0.5
    pts = [_calibrate(base, lat, root / f"latency-{lat:g}", progress) for lat in (0.0, hi)]
    a, b = pts[0]["rollout_makespan_s"], (pts[1]["rollout_makespan_s"] - pts[0]["rollout_makespan_s"]) / hi
    work = statistics.fmean(p["learner_busy_s"] for p in pts)
    if b <= 0:
        m0, m1 = pts[0]["rollout_makespan_s"], pts[1]["rollout_makespan_s"]
        raise UsageError(f"--balance auto: the makespan did not grow with the tool latency ({m0:.2f} s at 0, "
                         f"{m1:.2f} s at {hi:g} s): the workload has no tool calls to delay; set the latency by hand "
                         "(--tool-latency)")
    if work <= a:
        raise UsageError(f"--balance auto: the learner's work ({work:.2f} s a round) is below the rollout's generation "
                         f"alone ({a:.2f} s) on this machine; make the learner's side larger (--hidden, --layers)")
    return {"tool_latency_median_s": (work - a) / b, "learner_work_s": work, "generation_s": a,
            "makespan_per_latency_s": b, "calibration": pts}


def bench_speedup(base: TrainConfig, out_root: str | Path, *, schedules: tuple[str, ...] = ("sync", "stream", "async"),
                  repeats: int = 1, warmup: int = 1, progress: Callable[[dict], None] | None = None,
                  balance_auto: bool = False) -> dict:
    """Run base under each schedule (`repeats` cycles, alternating) and compare their step times. balance_auto: set
    the median tool latency first so that rollout and learner work are equal on this machine (`balance`)."""
    progress = progress or (lambda ev: None)
    if warmup >= base.rounds:
        raise UsageError(f"--warmup {warmup} leaves no measured round of {base.rounds}; raise --rounds")
    out_root = Path(out_root)
    balanced = None
    if balance_auto:
        balanced = balance(base, out_root, progress)
        base = replace(base, rollout=replace(base.rollout, tool_latency_median_s=balanced["tool_latency_median_s"]))
    runs = []
    for rep in range(repeats):
        for s in schedules:
            run_dir = out_root / s / f"rep{rep}"
            cfg = run_config(base, s, run_dir)
            progress({"event": "run", "schedule": s, "repeat": rep, "run_dir": str(run_dir)})
            runs.append({"schedule": s, "repeat": rep, "run_dir": str(run_dir),
                         "summary": train(cfg, progress=progress)})
    return {**compare_runs(out_root, schedules, repeats, warmup), "rounds": base.rounds, "runs": runs,
            "tool_latency_median_s": base.rollout.tool_latency_median_s, "balance": balanced}


def compare_runs(out_root: str | Path, schedules: tuple[str, ...], repeats: int, warmup: int) -> dict:
    """Per schedule statistics over the rounds after the warm-up of <out_root>/<schedule>/rep<k>."""
    out_root = Path(out_root)
    out: dict = {"warmup": warmup, "repeats": repeats, "out": str(out_root), "schedules": {}}
    for s in schedules:
        rs = [r for rep in range(repeats) for r in RunDir(out_root / s / f"rep{rep}").rows(METRICS)[warmup:]]
        out["schedules"][s] = {
            "rounds_measured": len(rs),
            "step_time_median_s": statistics.median(r["step_time_s"] for r in rs),
            "rollout_makespan_median_s": statistics.median(r["rollout_makespan_s"] for r in rs),
            "learner_busy_median_s": statistics.median(r["learner_busy_s"] for r in rs),
            "learner_idle_frac": statistics.fmean(r["learner_idle_frac"] for r in rs),
            "staleness_max": max(r["staleness_max"] for r in rs),
            "peak_mem_learner_bytes": max(r["peak_mem_learner_bytes"] or 0 for r in rs),
            "accumulator_peak_bytes": max(r["accumulator_peak_bytes"] for r in rs),
            "reward_mean": statistics.fmean(r["reward_mean"] for r in rs),
        }
    base_t = out["schedules"].get("sync", {}).get("step_time_median_s")
    for _s, d in out["schedules"].items():
        d["speedup_vs_sync"] = base_t / d["step_time_median_s"] if base_t else None
    if "stream" in out["schedules"]:
        st = out["schedules"]["stream"]
        st["predicted"] = _predicted(out_root / "stream" / "rep0", warmup)
        if "sync" in out["schedules"]:
            sy = out["schedules"]["sync"]
            # the speedup predicted from both runs' traces: the model's sync time on the sync trace
            # (its padded batch's real cost) over its stream time on the stream trace (per-item costs)
            sy["predicted"] = _predicted(out_root / "sync" / "rep0", warmup)
            p_sync, p_stream = sy["predicted"] or {}, st["predicted"] or {}
            if p_sync.get("sync_s") and p_stream.get("stream_s"):
                st["predicted_speedup_both_traces"] = p_sync["sync_s"] / p_stream["stream_s"]
                st["measured_over_predicted"] = st["speedup_vs_sync"] / st["predicted_speedup_both_traces"]
            st["memory_overhead_bytes"] = st["peak_mem_learner_bytes"] - sy["peak_mem_learner_bytes"]
            # learner compute: per-arrival backwards against the one batched backward of sync
            st["learner_compute_ratio"] = st["learner_busy_median_s"] / sy["learner_busy_median_s"]
    return out
