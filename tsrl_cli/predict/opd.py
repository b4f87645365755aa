"""OPD rounds: the unit of a backward (learner.opd_unit), stream's backwards under each unit, and both units
priced per token position on one round and averaged over rounds; the teacher's load in each round.
"""

from __future__ import annotations

import statistics

from tsrl_cli.config import OPD_UNITS
from tsrl_cli.predict.drain import drain_jobs
from tsrl_cli.predict.speedup import ratio
from tsrl_cli.traces import RoundTrace, Trace


def opd_trajectories(items, ends=()) -> dict[str, dict]:
    """An OPD round's trajectories, from its turn items and `trajectory` events: {trajectory: {"end": s when
    the learner knew its turns complete (the scores of a turn marked last as it closed; else its end, or its
    last turn's scores where the trace has no end), "row": positions of one row over its last turn's prefix,
    "tokens": T_i (None: unknown), "cost": its turns' learner s}}."""
    out: dict[str, dict] = {}
    marked: dict[str, float] = {}  # trajectory -> the scores of its turn marked last
    for i in items:
        if i.trajectory is None:
            continue
        t = out.setdefault(i.trajectory, {"end": i.finished_at_s, "row": 0, "tokens": None, "cost": 0.0})
        t["end"] = max(t["end"], i.finished_at_s)
        t["row"] = max(t["row"], i.positions or 0)
        t["cost"] += i.learner_cost_s
        if i.last:
            marked[i.trajectory] = i.finished_at_s
    for key, at, tokens in ends:
        t = out.setdefault(key, {"end": at, "row": 0, "tokens": None, "cost": 0.0})  # also those without a turn
        t["end"], t["tokens"] = max(t["end"], at), tokens
    for key, at in marked.items():
        out[key]["end"] = at
    return out


def opd_jobs(items, ends, unit: str, per_position_s: float | None = None) -> list[tuple[float, float, str | None]]:
    """Stream's backwards of an OPD round under learner.opd_unit `unit`, as drain jobs (arrival s, cost s,
    trajectory). turn: the turns at their scores; trajectory: one per trajectory at its end. Costs: the
    items' own (per_position_s None: as traced; a trajectory's are its turns' summed), else each
    backward's positions x per_position_s (a turn: its prefix; a trajectory: its row)."""
    if unit == "turn":
        return [(i.finished_at_s, i.learner_cost_s if per_position_s is None else per_position_s * (i.positions or 0),
                 i.trajectory) for i in items]
    return [(t["end"], t["cost"] if per_position_s is None else per_position_s * t["row"], key)
            for key, t in opd_trajectories(items, ends).items() if t["row"] or t["cost"]]


def per_position_s(r: RoundTrace) -> float | None:
    """Learner seconds per token position in this round: the sync batch's (seconds / its positions), else
    the items' costs over the positions the backwards covered (`learner_work`); None without positions."""
    if r.batch_work_s is not None:
        return r.batch_work_s / r.batch_positions if r.batch_positions else None
    work = sum(i.learner_cost_s for i in r.items)
    return work / r.work_positions if r.work_positions and work > 0 else None


def price_opd_units(items, ends, learners: int, per_pos: float, overhead_s: float = 0.0) -> dict:
    """Both OPD units on one round, every backward priced at its positions x per_pos: stream's step time
    (drain + overhead_s) and positions under each, beside sum T_i and the lazy batch's B x T_max.
    One row per backward, a trajectory's queued turns in one row (learner.microbatch auto on one process)."""
    trajs = opd_trajectories(items, ends)
    lengths = [t["tokens"] or t["row"] for t in trajs.values()]
    out: dict = {"per_position_s": per_pos, "trajectory_tokens": sum(lengths),
                 "lazy_positions": len(lengths) * max(lengths, default=0)}
    for unit in OPD_UNITS:
        costs: list[float] = []
        drain = drain_jobs(opd_jobs(items, ends, unit, per_pos), learners, 0.0, 0.0, unit == "turn", costs)
        pos = round(sum(costs) / per_pos)
        out[unit] = {"stream_s": drain + overhead_s, "positions": pos,
                     "positions_over_lazy": ratio(pos, out["lazy_positions"]),
                     "positions_over_trajectory_tokens": ratio(pos, out["trajectory_tokens"])}
    out["best"] = min(OPD_UNITS, key=lambda u: (out[u]["stream_s"], out[u]["positions"]))
    return out


def recorded_unit(trace: Trace) -> str:
    """The OPD unit stream runs (or ran) with for this trace: the run's learner.opd_unit, else turn."""
    return trace.opd_unit or "turn"


def mean_opd_units(blocks: list[dict | None]) -> dict | None:
    """The rounds' opd_units, averaged (None when a round could not be priced: no positions in the trace)."""
    if not blocks or any(b is None for b in blocks):
        return None
    out = {k: statistics.fmean(b[k] for b in blocks) for k in ("per_position_s", "trajectory_tokens", "lazy_positions")}
    for unit in OPD_UNITS:
        out[unit] = {k: statistics.fmean(b[unit][k] for b in blocks) for k in ("stream_s", "positions")}
        out[unit]["positions_over_lazy"] = ratio(out[unit]["positions"], out["lazy_positions"])
        out[unit]["positions_over_trajectory_tokens"] = ratio(out[unit]["positions"], out["trajectory_tokens"])
    out["best"] = min(OPD_UNITS, key=lambda u: (out[u]["stream_s"], out[u]["positions"]))
    return out


def teacher_load(r: RoundTrace) -> dict | None:
    """An OPD round's teacher (its `teacher` event; None without one): busy seconds against the rollout side's
    generation (the `rollout` event), `bound` when the teacher was busy longer (its scores, not the rollout, set the
    last arrivals, and stream's items with them), and the positions its forwards covered per trajectory token
    (1: each trajectory's tokens once; about (K + 1)/2 when K-turn trajectories re-score their prefixes)."""
    if r.teacher_busy_s is None:
        return None
    tokens = [t for _, _, t in r.ends]
    known = sum(tokens) if tokens and all(tokens) else None
    return {"busy_s": r.teacher_busy_s, "rollout_s": r.rollout_s, "positions": r.teacher_positions,
            "busy_over_rollout": ratio(r.teacher_busy_s, r.rollout_s),
            "bound": None if not r.rollout_s else r.teacher_busy_s > r.rollout_s,
            "positions_per_token": ratio(r.teacher_positions, known)}


def mean_teacher_load(rows: list[dict]) -> dict | None:
    """The counted rounds' teacher loads: mean busy and rollout seconds, their ratio, positions per token over all
    of them, and the rounds that were teacher-bound (None when a round has no `teacher` event)."""
    loads = [r.get("teacher") for r in rows]
    if not loads or any(t is None for t in loads):
        return None
    busy = statistics.fmean(t["busy_s"] for t in loads)
    rollout = None if any(t["rollout_s"] is None for t in loads) else statistics.fmean(t["rollout_s"] for t in loads)
    per_token = [t["positions_per_token"] for t in loads]
    return {"busy_s": busy, "rollout_s": rollout, "busy_over_rollout": ratio(busy, rollout),
            "bound_rounds": [r["round"] for r, t in zip(rows, loads, strict=True) if t["bound"]],
            "positions_per_token": None if None in per_token else statistics.fmean(per_token)}
