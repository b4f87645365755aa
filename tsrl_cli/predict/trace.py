"""A whole trace predicted: every round (as traced, or through the what-if knobs and the other OPD unit),
against the run's measured step time where known, and the summary over the rounds after the warm-up.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

from tsrl_cli.config import OPD_UNITS
from tsrl_cli.errors import UsageError
from tsrl_cli.predict.opd import (
    mean_opd_units,
    mean_teacher_load,
    opd_jobs,
    per_position_s,
    price_opd_units,
    recorded_unit,
    teacher_load,
)
from tsrl_cli.predict.round import Calibration, predict_round
from tsrl_cli.predict.speedup import ceiling, ratio
from tsrl_cli.predict.whatif import check_speeds, what_if_round
from tsrl_cli.traces import Trace


def predict_trace(trace: Trace, *, step_s: float | None = None, sync_s: float | None = None,
                  learners: int | None = None, learner_speed: float = 1.0, tool_speed: float = 1.0,
                  spread: float = 1.0, warmup: int = 4, calibration: Calibration | None = None,
                  opd_unit: str | None = None) -> dict:
    """Predict every round of a trace; the summary averages rounds after the warm-up.

    Flags override the trace's own step/sync/learner values; what the trace lacks defaults to
    step 0, sync 0, one learner. The measured comparison (run traces) is always made with the
    trace as recorded; the what-if knobs change only the predictions. opd_unit: stream's OPD unit
    (default: the run's learner.opd_unit); another than the run's is a what-if knob.
    """
    if learners is not None and learners < 1:
        raise UsageError(f"--learners must be >= 1 (got {learners})")
    for name, v in (("--step-s", step_s), ("--sync-s", sync_s)):
        if v is not None and v < 0:
            raise UsageError(f"{name} must be >= 0 (got {v})")
    check_speeds(learner_speed, tool_speed, spread)
    opd = any(i.trajectory is not None for r in trace.rounds for i in r.items)
    if opd_unit is not None:
        if opd_unit not in OPD_UNITS:
            raise UsageError(f"--opd-unit {opd_unit!r} is unknown; use one of {', '.join(OPD_UNITS)}")
        if not opd:
            raise UsageError(f"--opd-unit: {trace.source} has no OPD turns (items with turn and prefix_tokens)")
    knobs = {k: v for k, v in (("learners", learners), ("learner_speed", learner_speed),
                               ("tool_speed", tool_speed), ("spread", spread)) if v not in (None, 1.0)}
    if opd_unit is not None and opd_unit != recorded_unit(trace):
        knobs["opd_unit"] = opd_unit
    if knobs and calibration is not None:
        raise UsageError("--calibration and the what-if knobs do not combine: the calibration was fitted on "
                         "this machine as traced")
    rounds = predict_rounds(trace, step_s=step_s, sync_s=sync_s, calibration=calibration)
    if knobs:
        changed = predict_rounds(trace, step_s=step_s, sync_s=sync_s, learners=learners, learner_speed=learner_speed,
                                 tool_speed=tool_speed, spread=spread, opd_unit=opd_unit)
        for row, new in zip(rounds, changed, strict=True):
            row["as_traced"] = {k: row[k] for k in ("sync_s", "stream_s", "async_s", "speedup")}
            row.update({k: v for k, v in new.items() if k not in ("measured_s", "predicted_s", "error_pct")})
    if not rounds:
        raise UsageError(f"{trace.source}: no rounds with items")
    counted = [r for r in rounds if r["round"] > warmup]
    note = None
    if not counted:
        counted = rounds
        if len(rounds) > 1:
            note = f"no round after the warm-up (rounds 1-{warmup}): every round is counted"
    doc = {"source": trace.source, "kind": trace.kind, "schedule": trace.schedule, "what_if": knobs,
           "calibration": None if calibration is None else asdict(calibration),
           "rounds_counted": [r["round"] for r in counted], "note": note}
    keys = ("makespan_s", "work_s", "batch_work_s", "optimizer_step_s", "weight_sync_s", "sync_s", "stream_s",
            "async_s")
    doc.update({k: statistics.fmean(r[k] for r in counted) for k in keys})
    doc["learners"] = counted[-1]["learners"]
    # speedup of the mean step times (ratio of means), as the report computes it per seed
    doc["speedup"] = ratio(doc["sync_s"], doc["stream_s"])
    doc["speedup_async"] = ratio(doc["sync_s"], doc["async_s"])
    # granularity group beside trajectory (as traced), and how much a group's arrivals move together
    grouped = [r["stream_group_s"] for r in counted if r.get("stream_group_s") is not None]
    doc["stream_group_s"] = statistics.fmean(grouped) if len(grouped) == len(counted) else None
    doc["speedup_group"] = ratio(doc["sync_s"], doc["stream_group_s"]) if doc["stream_group_s"] else None
    iccs = [r["arrival_icc"] for r in counted if r.get("arrival_icc") is not None]
    doc["arrival_icc"] = statistics.fmean(iccs) if iccs else None
    doc["ceiling"] = ceiling(doc["makespan_s"], doc["work_s"], doc["batch_work_s"], doc["learners"],
                             doc["optimizer_step_s"] + doc["weight_sync_s"])
    if opd:
        doc["opd_unit"] = opd_unit or recorded_unit(trace)
        doc["opd_unit_recorded"] = trace.opd_unit
        doc["opd_units"] = mean_opd_units([r.get("opd_units") for r in counted])
        doc["teacher"] = mean_teacher_load(counted)  # the teacher's busy time against the rollout's, per round
    errs = [abs(r["error_pct"]) for r in counted if r.get("error_pct") is not None]
    if errs:
        doc["measured_from"] = trace.measured_from
        doc["mean_abs_error_pct"] = statistics.fmean(errs)
        doc["error_rows"] = len(errs)
    if len(rounds) > 1:
        doc["rounds"] = rounds
    return doc


def predict_rounds(trace: Trace, step_s: float | None = None, sync_s: float | None = None,
                   calibration: Calibration | None = None, *, learners: int | None = None,
                   learner_speed: float = 1.0, tool_speed: float = 1.0, spread: float = 1.0,
                   opd_unit: str | None = None) -> list[dict]:
    """predict_round for every round, as recorded or through the what-if knobs (what_if, `learners`, and
    stream's OPD unit `opd_unit`: by default the run's); as recorded, with the measured step time and the
    error (predicted under the trace's own schedule minus measured, in % of measured) where known.

    OPD rounds: stream's backwards follow the unit (opd_jobs): the run's own unit from the items' own
    costs, another unit priced per position (per_position_s). Where the round can be priced per position,
    `opd_units` prices both units (price_opd_units)."""
    if calibration is not None and trace.schedule != "sync":
        raise UsageError(f"--calibration predicts stream from a sync run's trace; {trace.source} was recorded "
                         f"under {trace.schedule or 'no schedule (a minimal trace)'}")
    traced = recorded_unit(trace)
    unit = opd_unit or traced
    knobs = learners is not None or (learner_speed, tool_speed, spread) != (1.0, 1.0, 1.0) or unit != traced
    rows = []
    for r in trace.rounds:
        r = what_if_round(r, learner_speed, tool_speed, spread)
        st = step_s if step_s is not None else (r.step_s or 0.0)
        sy = sync_s if sync_s is not None else (r.sync_s or 0.0)
        n_learners = learners or r.learners or 1
        bw = r.batch_work_s
        if bw is None and not trace.padded_sync:  # sync_batching per_item: sync does the items' own work
            bw = sum(i.learner_cost_s for i in r.items)
        opd = any(i.trajectory is not None for i in r.items)
        jobs, coalesce, pp = None, False, per_position_s(r) if opd else None
        if opd:
            if unit != traced:  # the other unit: priced per position
                if pp is None:
                    raise UsageError(f"--opd-unit {unit}: round {r.round} of {trace.source} has no `learner_work` "
                                     "positions to price the other unit's backwards by")
                jobs, coalesce = opd_jobs(r.items, r.ends, unit, pp), unit == "turn"
            elif unit == "trajectory":  # as traced: a trajectory's turns are one backward at its end
                jobs = opd_jobs(r.items, r.ends, "trajectory")
        block = price_opd_units(r.items, r.ends, n_learners, pp, st + sy) if pp else None
        if bw is None and block is not None and traced == "trajectory":
            # a stream trace of whole-trajectory rows: the lazy batch is their work scaled by B x T_max over the
            # positions they covered (the padding factor, as for GRPO). Under `turn` the turns' own work stands in
            # for it (re-encoding against padding: docs/reports.md, "Padding")
            bw = pp * block["lazy_positions"]
        row = {"round": r.round, **predict_round(r.items, st, sy, n_learners, batch_work_s=bw, rollout_s=r.rollout_s,
                                                 calibration=calibration, batch_positions=r.batch_positions,
                                                 stream_jobs=jobs, coalesce=coalesce, opd_unit=unit, ends=r.ends)}
        if opd:
            row["opd_unit"], row["opd_units"], row["teacher"] = unit, block, teacher_load(r)
        if not knobs and r.measured_step_s is not None and trace.schedule in ("sync", "stream", "async"):
            pred = row[f"{trace.schedule}_s"]
            row.update(measured_s=r.measured_step_s, predicted_s=pred,
                       error_pct=100.0 * (pred - r.measured_step_s) / r.measured_step_s
                       if r.measured_step_s > 0 else None)
        rows.append(row)
    return rows
