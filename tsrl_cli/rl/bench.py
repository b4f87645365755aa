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


def bench_speedup(base: TrainConfig, out_root: str | Path, *, schedules: tuple[str, ...] = ("sync", "stream", "async"),
                  repeats: int = 1, warmup: int = 1, progress: Callable[[dict], None] | None = None) -> dict:
    """Run base under each schedule (`repeats` cycles, alternating) and compare their step times."""
    progress = progress or (lambda ev: None)
    if warmup >= base.rounds:
        raise UsageError(f"--warmup {warmup} leaves no measured round of {base.rounds}; raise --rounds")
    out_root = Path(out_root)
    runs = []
    for rep in range(repeats):
        for s in schedules:
            run_dir = out_root / s / f"rep{rep}"
            cfg = run_config(base, s, run_dir)
            progress({"event": "run", "schedule": s, "repeat": rep, "run_dir": str(run_dir)})
            runs.append({"schedule": s, "repeat": rep, "run_dir": str(run_dir),
                         "summary": train(cfg, progress=progress)})
    return {**compare_runs(out_root, schedules, repeats, warmup), "rounds": base.rounds, "runs": runs}


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
