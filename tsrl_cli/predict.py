"""The event model of one round: step time under sync, stream and async, from a trace.

A round is items (trajectories for GRPO, teacher-scored turns for OPD) reaching the learner at
`finished_at_s` (seconds since the round started), each needing `learner_cost_s` seconds of
learner work, then one optimizer step (`step_s`) and one weight sync (`sync_s`). With L learners:

  sync   = M + Wb/L + step + sync  lazy baseline: no backward starts before the last arrival M;
                                   the batch backward (Wb) splits evenly over L learners
  stream = D + step + sync         D: when the queue drains, each item starting at
                                   max(arrival, its learner free) on the first free learner, FIFO
  async  = max(R, Wb/L + step) + sync  one-step off-policy steady state: round k+1's rollout overlaps
                                   round k's learning; the weight sync blocks both sides. R is the
                                   rollout's own duration (a `rollout` event), which under async
                                   starts before the round does; M when the trace lacks it

Padding. The lazy baseline backwards one padded batch: B rows of the longest length T_max, so its
work Wb covers B * T_max token positions, while the per-item backwards of stream cover only each
item's own T_i (W = the sum of item costs). When items carry `tokens`, the model prices them so:
from a sync trace, item i costs Wb * T_i / (B * T_max) (the measured batch, shared out by real
tokens); from a stream trace, Wb = W * B * T_max / sum(T_i). Without token counts, Wb = W.
  speedup = sync / stream <= ceiling = (M + Wb/L + s) / (max(M, W/L) + s), s = step + sync,
  since D >= M and D >= W/L. With s = 0 the ceiling is 2 at balance (W/L == M), (M+W)/M when
  rollout dominates and (M+W)/W when learning does.

OPD: the unit of a backward (learner.opd_unit). Under `turn` the items are the teacher-scored turns, a
trajectory's queued turns sharing one backward over the latest turn's prefix; under `trajectory` each
trajectory is one item, arriving at its end with the cost of one row over its last turn's prefix. Both
units are also priced per token position (the trace's learner seconds / the positions its backwards
covered, `learner_work`): `opd_units` in each OPD round, `--opd-unit` to predict with the other one.

Traces: a run directory (events.jsonl + metrics.jsonl, docs/run-directory.md), an events.jsonl,
or the minimal trace (CSV or JSONL rows with finished_at_s, learner_cost_s, optional round).
Pure python: no torch, no numpy.

    tsrl predict --trace results/spread/stream/seed42 --json
    tsrl predict --trace trace.csv --step-s 0.5 --learners 2 --spread 2
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tsrl_cli.config import OPD_UNITS
from tsrl_cli.errors import UsageError
from tsrl_cli.rundir import DROP_LAST, EVENTS, METRICS, RunDir
from tsrl_cli.traces import Item, RoundTrace, Trace, load_trace


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


# ---------------------------------------------------------------------------- the model


def drain_time(items: tuple[Item, ...] | list[Item], learners: int = 1, *, rollout_slowdown: float = 0.0,
               per_backward_s: float = 0.0, coalesce: bool = False) -> float:
    """When the last item's work ends, each item on the first free learner, in arrival order.

    rollout_slowdown c: arrival times are the rollout's own (uncontended) clock, which advances at
    1 / (1 + c) of real time while any learner computes. per_backward_s: added to every backward.
    coalesce: a learner that takes an item also takes the queued items of its trajectory, in one
    backward that costs the most expensive of them (an OPD row over the latest turn's prefix).
    With the defaults this is FIFO list scheduling: start = max(arrival, first free learner).
    """
    jobs = [(i.finished_at_s, i.learner_cost_s, i.trajectory) for i in items]
    return _drain(jobs, learners, rollout_slowdown, per_backward_s, coalesce)


def _drain(jobs: list[tuple[float, float, str | None]], learners: int, rollout_slowdown: float,
           per_backward_s: float, coalesce: bool, costs: list[float] | None = None) -> float:
    """drain_time on (arrival s, cost s, trajectory) tuples: the fit calls it for every round at every step.
    costs: when given, each backward's cost (its per_backward_s left out) is appended, in start order."""
    if learners == 1:
        return _drain_one(jobs, rollout_slowdown, per_backward_s, coalesce, costs)
    return _drain_many(jobs, learners, rollout_slowdown, per_backward_s, coalesce, costs)


def _drain_many(jobs: list[tuple[float, float, str | None]], learners: int, rollout_slowdown: float,
                per_backward_s: float, coalesce: bool, costs: list[float] | None = None) -> float:
    """_drain on any number of learners: a list of free times, the queue a list rebuilt when a backward coalesces."""
    arrivals = sorted(jobs, key=lambda j: j[0])
    free = [0.0] * learners  # when each learner is next free (real seconds)
    queue: list[tuple[float, float, str | None]] = []
    t = v = end = 0.0  # real time, the rollout's clock, the last backward's end
    n, k = len(arrivals), 0
    while k < n or queue:
        if queue:
            idle = [j for j in range(learners) if free[j] <= t]
            while queue and idle:  # start work on every idle learner
                head = queue.pop(0)
                cost = head[1]
                if coalesce and head[2] is not None:
                    cost = max([cost] + [i[1] for i in queue if i[2] == head[2]])
                    queue = [i for i in queue if i[2] != head[2]]
                j = idle.pop(0)
                free[j] = t + cost + per_backward_s
                if costs is not None:
                    costs.append(cost)
                end = max(end, free[j])
        if k == n:  # nothing left to arrive: the queue waits for learners only
            if queue:
                t = min(f for f in free if f > t)
            continue
        busy = [f for f in free if f > t]
        rate = 1.0 / (1.0 + rollout_slowdown) if busy else 1.0
        t_arrive = t + max(0.0, arrivals[k][0] - v) / rate
        t_free = min(busy) if busy else math.inf
        if t_arrive <= t_free:
            t, v = t_arrive, max(v, arrivals[k][0])
            while k < n and arrivals[k][0] <= v:
                queue.append(arrivals[k])
                k += 1
        else:
            v += (t_free - t) * rate
            t = t_free
    return end


def _drain_one(jobs: list[tuple[float, float, str | None]], rollout_slowdown: float, per_backward_s: float,
               coalesce: bool, costs: list[float] | None = None) -> float:
    """_drain on one learner: the same floats from the same operations in the same order as _drain_many
    (tests/test_predict.py checks it on random rounds), about 3x faster: `tsrl calibrate`'s fit calls it some
    500,000 times. The queue holds
    indices into the arrivals; a coalesced backward marks its trajectory's other queued turns gone (skipped
    when they reach the head) where _drain rebuilds the queue."""
    arrivals = sorted(jobs, key=lambda j: j[0])
    slow = 1.0 / (1.0 + rollout_slowdown)
    queue: deque[int] = deque()
    gone: set[int] = set()
    queued: dict[str, deque[int]] = {}  # coalescing: each trajectory's queued indices, oldest first
    live = 0  # queued and not gone
    free = t = v = end = 0.0  # when the learner is next free, real time, the rollout's clock, the last end
    n, k = len(arrivals), 0
    while k < n or live:
        if live and free <= t:  # idle: the head starts (coalescing, with its trajectory's queued turns)
            h = queue.popleft()
            while h in gone:
                h = queue.popleft()
            live -= 1
            cost, traj = arrivals[h][1], arrivals[h][2]
            if coalesce and traj is not None:
                mine = queued[traj]
                mine.popleft()  # h, the oldest of them
                if mine:
                    cost = max([cost] + [arrivals[i][1] for i in mine])
                    gone.update(mine)
                    live -= len(mine)
                    mine.clear()
            free = t + cost + per_backward_s
            if costs is not None:
                costs.append(cost)
            if free > end:  # noqa: PLR1730  max(end, free): the builtin's call cost a quarter of this loop
                end = free
        if k == n:  # nothing left to arrive: the queue waits for the learner only
            if live:
                if not free > t:  # _drain's min() of no busy learner: a backward of zero cost
                    raise ValueError("a backward of zero cost with turns still queued")
                t = free
            continue
        busy = free > t
        rate = slow if busy else 1.0
        a = arrivals[k][0]
        t_arrive = t + (a - v if a - v > 0.0 else 0.0) / rate  # noqa: FURB136  max(0.0, a - v), as above
        t_free = free if busy else math.inf
        if t_arrive <= t_free:
            t = t_arrive
            if a > v:  # noqa: PLR1730  max(v, a), as above
                v = a
            while k < n and arrivals[k][0] <= v:
                if coalesce and arrivals[k][2] is not None:
                    queued.setdefault(arrivals[k][2], deque()).append(k)
                queue.append(k)
                live += 1
                k += 1
        else:
            v += (t_free - t) * rate
            t = t_free
    return end

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
        t_stream = _drain(stream_jobs, learners, 0.0, 0.0, coalesce)
    else:
        t_stream = drain_time(items, learners)
    t_stream += step_s + sync_s
    t_async = max(makespan if rollout_s is None else rollout_s, batch_per_learner + step_s) + sync_s
    return {
        "items": len(items), "learners": learners, "makespan_s": makespan, "work_s": work,
        "batch_work_s": batch_work_s, "optimizer_step_s": step_s, "weight_sync_s": sync_s,
        "sync_s": t_sync, "stream_s": t_stream, "async_s": t_async,
        "speedup": _ratio(t_sync, t_stream), "speedup_async": _ratio(t_sync, t_async),
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
    return _drain(priced, learners, cal.rollout_slowdown, cal.per_backward_s, True)


def ceiling(makespan_s: float, work_s: float, batch_work_s: float, learners: int = 1,
            overhead_s: float = 0.0) -> float | None:
    """The bound on sync / stream: (M + Wb/L + s) / (max(M, W/L) + s), s = step + sync (None: 0 / 0)."""
    return _ratio(makespan_s + batch_work_s / learners + overhead_s, max(makespan_s, work_s / learners) + overhead_s)


def what_if(items, learner_speed: float = 1.0, tool_speed: float = 1.0, spread: float = 1.0) -> list[Item]:
    """The same round on a different machine or workload.

    learner_speed X: every item's learner cost / X. tool_speed X: every arrival time / X (the minimal
    trace does not split generation from tool time, so all of it scales). spread X: each arrival's
    deviation from the median arrival times X, clipped at 0 (nothing arrives before the round starts).
    """
    _check_speeds(learner_speed, tool_speed, spread)
    if not items:
        return []
    at = _what_if_clock(items, tool_speed, spread)
    return [replace(i, finished_at_s=at(i.finished_at_s), learner_cost_s=i.learner_cost_s / learner_speed)
            for i in items]


def _check_speeds(learner_speed: float, tool_speed: float, spread: float) -> None:
    for name, v in (("--learner-speed", learner_speed), ("--tool-speed", tool_speed)):
        if not v > 0:
            raise UsageError(f"{name} must be > 0 (got {v})")
    if not spread >= 0:
        raise UsageError(f"--spread must be >= 0 (got {spread})")


def _what_if_clock(items, tool_speed: float, spread: float):
    """what_if's map of an arrival time (items' median as the centre), for items and OPD trajectory ends alike."""
    med = statistics.median(i.finished_at_s for i in items)
    return lambda t: max(0.0, med + spread * (t - med)) / tool_speed


def _what_if_round(r: RoundTrace, learner_speed: float, tool_speed: float, spread: float) -> RoundTrace:
    """A traced round through what_if: its items, OPD trajectory ends, batch and rollout seconds."""
    if not r.items:
        return r
    at = _what_if_clock(r.items, tool_speed, spread)
    return replace(r, items=tuple(what_if(r.items, learner_speed, tool_speed, spread)),
                   ends=tuple((k, at(t), n) for k, t, n in r.ends),
                   batch_work_s=None if r.batch_work_s is None else r.batch_work_s / learner_speed,
                   rollout_s=None if r.rollout_s is None else r.rollout_s / tool_speed)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------- OPD: the unit of a backward


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
        drain = _drain(opd_jobs(items, ends, unit, per_pos), learners, 0.0, 0.0, unit == "turn", costs)
        pos = round(sum(costs) / per_pos)
        out[unit] = {"stream_s": drain + overhead_s, "positions": pos,
                     "positions_over_lazy": _ratio(pos, out["lazy_positions"]),
                     "positions_over_trajectory_tokens": _ratio(pos, out["trajectory_tokens"])}
    out["best"] = min(OPD_UNITS, key=lambda u: (out[u]["stream_s"], out[u]["positions"]))
    return out


# ---------------------------------------------------------------------------- the command


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
    _check_speeds(learner_speed, tool_speed, spread)
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
        for row, new in zip(rounds, changed):
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
    doc["speedup"] = _ratio(doc["sync_s"], doc["stream_s"])
    doc["speedup_async"] = _ratio(doc["sync_s"], doc["async_s"])
    doc["ceiling"] = ceiling(doc["makespan_s"], doc["work_s"], doc["batch_work_s"], doc["learners"],
                             doc["optimizer_step_s"] + doc["weight_sync_s"])
    if opd:
        doc["opd_unit"] = opd_unit or recorded_unit(trace)
        doc["opd_unit_recorded"] = trace.opd_unit
        doc["opd_units"] = _mean_opd_units([r.get("opd_units") for r in counted])
    errs = [abs(r["error_pct"]) for r in counted if r.get("error_pct") is not None]
    if errs:
        doc["measured_from"] = trace.measured_from
        doc["mean_abs_error_pct"] = statistics.fmean(errs)
        doc["error_rows"] = len(errs)
    if len(rounds) > 1:
        doc["rounds"] = rounds
    return doc


def recorded_unit(trace: Trace) -> str:
    """The OPD unit stream runs (or ran) with for this trace: the run's learner.opd_unit, else turn."""
    return trace.opd_unit or "turn"


def _mean_opd_units(blocks: list[dict | None]) -> dict | None:
    """The rounds' opd_units, averaged (None when a round could not be priced: no positions in the trace)."""
    if not blocks or any(b is None for b in blocks):
        return None
    out = {k: statistics.fmean(b[k] for b in blocks) for k in ("per_position_s", "trajectory_tokens", "lazy_positions")}
    for unit in OPD_UNITS:
        out[unit] = {k: statistics.fmean(b[unit][k] for b in blocks) for k in ("stream_s", "positions")}
        out[unit]["positions_over_lazy"] = _ratio(out[unit]["positions"], out["lazy_positions"])
        out[unit]["positions_over_trajectory_tokens"] = _ratio(out[unit]["positions"], out["trajectory_tokens"])
    out["best"] = min(OPD_UNITS, key=lambda u: (out[u]["stream_s"], out[u]["positions"]))
    return out


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
        r = _what_if_round(r, learner_speed, tool_speed, spread)
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
            row["opd_unit"], row["opd_units"] = unit, block
        if not knobs and r.measured_step_s is not None and trace.schedule in ("sync", "stream", "async"):
            pred = row[f"{trace.schedule}_s"]
            row.update(measured_s=r.measured_step_s, predicted_s=pred,
                       error_pct=100.0 * (pred - r.measured_step_s) / r.measured_step_s
                       if r.measured_step_s > 0 else None)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- what a run's streaming bought

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
        warm = [int(r["round"]) for r in (rows[1:] if len(rows) > 1 else rows)]  # as summarize() in rl/train.py
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
        speedup=_ratio(p_sync, meas) if schedule == "stream" else _ratio(meas, p_stream),
        predicted_speedup=_ratio(p_sync, p_stream),
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
