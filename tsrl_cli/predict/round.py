"""One round under sync, stream and async: the predicted step times, the speedup and its ceiling, with
stream's backwards priced from the trace or, for a sync trace, by a fitted Calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from tsrl_cli.errors import UsageError
from tsrl_cli.predict.drain import drain_jobs, drain_time
from tsrl_cli.predict.granularity import arrival_icc, group_jobs
from tsrl_cli.predict.opd import opd_jobs
from tsrl_cli.predict.speedup import ceiling, ratio


@dataclass(frozen=True)
class Calibration:
    """What a sync trace cannot show about stream on this machine, fitted on paired runs (tsrl calibrate).

    Stream's backward over p positions costs cost_scale * (sync batch seconds / batch positions) * p
    + per_backward_s; while any learner computes, the rollout side progresses at 1 / (1 + rollout_slowdown)
    of its speed (learner and rollout sharing cores or a host; 0 where each has its own devices).
    The identity (1, 0, 0) prices stream's backwards at the sync batch's per-position cost, for free.
    """

    cost_scale: float = 1.0
    per_backward_s: float = 0.0
    rollout_slowdown: float = 0.0


def padding_factor(items) -> float | None:
    """B * T_max / sum(T_i): padded token positions of one batch over real tokens (None: lengths unknown)."""
    toks = [i.tokens for i in items]
    if not toks or any(t is None or t <= 0 for t in toks):
        return None
    return len(toks) * max(toks) / sum(toks)


def predict_round(items, step_s: float = 0.0, sync_s: float = 0.0, learners: int = 1,
                  batch_work_s: float | None = None, rollout_s: float | None = None,
                  calibration: Calibration | None = None, batch_positions: int | None = None,
                  stream_jobs: list[tuple[float, float, str | None]] | None = None, coalesce: bool = False,
                  opd_unit: str = "turn", ends=()) -> dict:
    """Predicted step time of one round under each schedule (seconds), the speedup and its ceiling.

    `batch_work_s`: the lazy batch backward's measured seconds (sync traces); otherwise it is the
    items' work scaled by the padding factor when the items carry token counts, else their work.
    `calibration` (sync traces with item positions): stream's backwards are priced per position from
    the batch (batch_work_s / batch_positions), with the calibration's scale, per-backward cost and
    rollout slowdown; the other schedules are as without it. `stream_jobs`: stream's backwards as
    (arrival s, cost s, trajectory), when they are not the items (an OPD unit, opd_jobs), drained with
    `coalesce`; W is then their work. `opd_unit`, `ends`: the unit and trajectory ends of a calibrated OPD round.
    """
    makespan = max(0.0, max((i.finished_at_s for i in items), default=0.0))  # async items may predate the round
    work = sum(i.learner_cost_s for i in items) if stream_jobs is None else sum(j[1] for j in stream_jobs)
    if batch_work_s is None:
        pf = padding_factor(items)
        batch_work_s = work * pf if pf is not None else work
    batch_per_learner = batch_work_s / learners
    t_sync = makespan + batch_per_learner + step_s + sync_s
    if calibration is not None:
        t_stream = calibrated_drain(items, learners, batch_work_s, batch_positions, calibration, opd_unit, ends)
    elif stream_jobs is not None:
        t_stream = drain_jobs(stream_jobs, learners, 0.0, 0.0, coalesce)
    else:
        t_stream = drain_time(items, learners)
    t_stream += step_s + sync_s
    # granularity group (learner.granularity): a group's backwards wait for its last arrival; GRPO items as traced
    released = group_jobs(items) if calibration is None and stream_jobs is None else None
    t_group = None if released is None else drain_jobs(released, learners, 0.0, 0.0, False) + step_s + sync_s
    t_async = max(makespan if rollout_s is None else rollout_s, batch_per_learner + step_s) + sync_s
    return {
        "items": len(items), "learners": learners, "makespan_s": makespan, "work_s": work,
        "batch_work_s": batch_work_s, "optimizer_step_s": step_s, "weight_sync_s": sync_s,
        "sync_s": t_sync, "stream_s": t_stream, "async_s": t_async,
        "speedup": ratio(t_sync, t_stream), "speedup_async": ratio(t_sync, t_async),
        "stream_group_s": t_group, "speedup_group": None if t_group is None else ratio(t_sync, t_group),
        "arrival_icc": arrival_icc(items),
        "ceiling": ceiling(makespan, work, batch_work_s, learners, step_s + sync_s),
    }


def calibrated_drain(items, learners: int, batch_work_s: float, batch_positions: int | None,
                     cal: Calibration, opd_unit: str = "turn", ends=()) -> float:
    """Stream's drain from a sync round's items, priced per position (Calibration's docstring); an OPD
    round's backwards as `opd_unit` runs them (turns, or one row per trajectory at its end)."""
    pos = [i.positions for i in items]
    if any(p is None for p in pos):
        raise UsageError("a calibrated prediction needs each item's backward positions (a sync run's events.jsonl "
                         "with `tokens`, and `prefix_tokens` for OPD turns)")
    if not batch_positions:
        traj: dict = {}  # the lazy batch: one padded row per trajectory (GRPO: each item is one)
        for i in items:
            key = i.trajectory if i.trajectory is not None else id(i)
            traj[key] = max(traj.get(key, 0), i.positions)
        batch_positions = len(traj) * max(traj.values())
    per_pos = cal.cost_scale * batch_work_s / batch_positions
    if opd_unit == "trajectory" and any(i.trajectory is not None for i in items):
        priced = opd_jobs(items, ends, "trajectory", per_pos)
    else:
        priced = [(i.finished_at_s, per_pos * i.positions, i.trajectory) for i in items]
    return drain_jobs(priced, learners, cal.rollout_slowdown, cal.per_backward_s, True)
