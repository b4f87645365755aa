"""What a `tsrl train` run's streaming bought: the event model on the run's own trace, for the other schedule,
against the step time the run measured.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.predict.speedup import ceiling, ratio
from tsrl_cli.predict.trace import predict_rounds
from tsrl_cli.rundir import DROP_LAST, EVENTS, METRICS, RunDir
from tsrl_cli.traces import load_trace

GAIN_KEYS = ("schedule", "status", "reason", "rounds", "learners", "measured_step_s", "predicted_sync_step_s",
             "predicted_stream_step_s", "speedup", "predicted_speedup", "ceiling", "balance", "model_error_pct",
             "note")


def streaming_gain(run_dir: str | Path) -> dict:
    """What streaming bought in one `tsrl train` run: the event model's step time for the other
    schedule, predicted from the run's own trace, against the step time the run measured.

    Rounds: those of the run summary's step time (every metrics.jsonl round but the first, when
    there is more than one) that have item events. Means over those rounds (ratios of means):
      stream run: speedup = predicted sync / measured (what streaming bought)
      sync run:   speedup = measured / predicted stream (what streaming would give)
      async run:  not compared (status "not_applicable"): it overlaps round k+1's rollout with
                  round k's learning, so its trace holds no sync or stream round.
    predicted_speedup: predicted sync / predicted stream; model_error_pct: the model's prediction
    for the run's own schedule against the measured step, in % of measured. balance: per round,
    learner work per learner over the rollout makespan (W/L / M), averaged; ceiling: the model's
    bound on the speedup at the rounds' mean makespan, work and step + sync (2 at balance 1 when
    step + sync is 0). Never raises on a missing or unusable trace: status "unavailable" and
    `reason` say why. Every key of GAIN_KEYS is present (None where it does not apply).
    """
    run = RunDir(run_dir)
    root = run.root
    out: dict = {**dict.fromkeys(GAIN_KEYS), "status": "unavailable", "rounds": []}
    metrics = run.file(METRICS)
    if not metrics.is_file():
        return {**out, "reason": f"{root}: no metrics.jsonl (not a run directory, or no round finished)"}
    try:
        rows = [row for row in run.rows(METRICS, DROP_LAST) if row.get("round") is not None]
        measured = {int(r["round"]): float(r["step_time_s"]) for r in rows if r.get("step_time_s") is not None}
        warm = [int(r["round"]) for r in (rows[1:] if len(rows) > 1 else rows)]  # as summarize() in rl/record.py
    except UsageError as e:
        return {**out, "reason": str(e)}
    except (TypeError, ValueError) as e:
        return {**out, "reason": f"{metrics}: a round or step_time_s is not a number ({e})"}
    if not rows:
        return {**out, "reason": f"{root}: no rounds in metrics.jsonl"}
    trace, trace_error = None, None
    if run.file(EVENTS).is_file():
        try:
            trace = load_trace(root)
        except UsageError as e:
            trace_error = f"the event model cannot read this run's trace: {e}"
    out["schedule"] = schedule = rows[-1].get("schedule") or (trace.schedule if trace else None)
    if schedule == "async":
        return {**out, "status": "not_applicable", "reason": "async overlaps each round's rollout with the previous "
                "round's learning (off-policy): its trace holds no sync or stream round to compare with"}
    if trace is None:
        return {**out, "reason": trace_error or f"{root}: no events.jsonl (the event model needs item arrivals "
                "and costs)"}
    if schedule not in ("sync", "stream"):
        return {**out, "reason": f"{metrics}: unknown schedule {schedule!r}"}
    predicted = {r["round"]: r for r in predict_rounds(trace)}
    counted = [k for k in warm if k in predicted and k in measured]
    if not counted:
        return {**out, "reason": f"no item events or step times for rounds {warm[0]}-{warm[-1]}"}
    rr = [predicted[k] for k in counted]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rr)

    learners = rr[-1]["learners"]
    meas, p_sync, p_stream = statistics.fmean(measured[k] for k in counted), mean("sync_s"), mean("stream_s")
    own = p_stream if schedule == "stream" else p_sync
    balances = [r["work_s"] / r["learners"] / r["makespan_s"] for r in rr if r["makespan_s"] > 0]
    notes = []
    if len(counted) < len(warm):
        notes.append(f"rounds {sorted(set(warm) - set(counted))} lack item events or step times: left out")
    if len(rows) == 1:
        notes.append("one round only: it pays the run's one-off costs (first batches, allocator)")
    if schedule == "sync":
        notes.append("stream's per-item backwards priced as shares of the batch backward; alone they may cost more")
    out.update(
        status="ok", rounds=counted, learners=learners, measured_step_s=meas, predicted_sync_step_s=p_sync,
        predicted_stream_step_s=p_stream,
        speedup=ratio(p_sync, meas) if schedule == "stream" else ratio(meas, p_stream),
        predicted_speedup=ratio(p_sync, p_stream),
        ceiling=ceiling(mean("makespan_s"), mean("work_s"), mean("batch_work_s"), learners,
                        mean("optimizer_step_s") + mean("weight_sync_s")),
        balance=statistics.fmean(balances) if balances else None,
        model_error_pct=100.0 * (own - meas) / meas if meas > 0 else None,
        note="; ".join(notes) or None)
    return out


def streaming_of(run_dir: str | Path) -> dict:
    """streaming_gain on a finished run, for its summary: a failure of the model never fails the run."""
    try:
        return streaming_gain(run_dir)
    except Exception as e:  # noqa: BLE001 - the run is done and recorded; only the comparison is lost
        return {**dict.fromkeys(GAIN_KEYS), "status": "unavailable", "rounds": [],
                "reason": f"the event model failed: {type(e).__name__}: {e}"}
