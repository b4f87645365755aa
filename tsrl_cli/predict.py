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

Traces: a run directory (events.jsonl + metrics.jsonl, docs/run-directory.md), an events.jsonl,
or the minimal trace (CSV or JSONL rows with finished_at_s, learner_cost_s, optional round).
Pure python: no torch, no numpy.

    tsrl predict --trace results/spread/stream/seed42 --json
    tsrl predict --trace trace.csv --step-s 0.5 --learners 2 --spread 2
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.rundir import DROP_LAST, EVENTS, METRICS, STRICT, RunDir, read_jsonl


@dataclass(frozen=True)
class Item:
    finished_at_s: float  # arrival at the learner, seconds since the round started
    learner_cost_s: float  # seconds of learner work (forward + backward) for this item
    tokens: int | None = None  # the item's sequence length (padding-aware batch pricing), when known
    positions: int | None = None  # token positions of this item's own backward (GRPO: T_i; OPD turn: prefix + turn)
    trajectory: str | None = None  # OPD: the trajectory of this turn (its queued turns share one backward)


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


@dataclass(frozen=True)
class RoundTrace:
    round: int
    items: tuple[Item, ...]
    step_s: float | None = None  # optimizer step seconds (None: not in the trace)
    sync_s: float | None = None  # weight sync seconds
    learners: int | None = None
    measured_step_s: float | None = None  # the run's own step time, when the trace comes from a run
    batch_work_s: float | None = None  # sync traces: the measured padded batch backward (seconds)
    rollout_s: float | None = None  # the rollout side's generation time of this round (`rollout` event)
    batch_positions: int | None = None  # sync traces: token positions the batch backward computed (`learner_work`)


@dataclass(frozen=True)
class Trace:
    source: str
    kind: str  # run | events | minimal
    schedule: str | None  # the schedule the trace was recorded under (None: minimal trace)
    rounds: tuple[RoundTrace, ...]
    measured_from: str | None = None
    padded_sync: bool = True  # the sync baseline backwards one padded batch (run config sync_batching)


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
           per_backward_s: float, coalesce: bool) -> float:
    """drain_time on (arrival s, cost s, trajectory) tuples: the fit calls it for every round at every step."""
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


def padding_factor(items) -> float | None:
    """B * T_max / sum(T_i): padded token positions of one batch over real tokens (None: lengths unknown)."""
    toks = [i.tokens for i in items]
    if not toks or any(t is None or t <= 0 for t in toks):
        return None
    return len(toks) * max(toks) / sum(toks)


def predict_round(items, step_s: float = 0.0, sync_s: float = 0.0, learners: int = 1,
                  batch_work_s: float | None = None, rollout_s: float | None = None,
                  calibration: Calibration | None = None, batch_positions: int | None = None) -> dict:
    """Predicted step time of one round under each schedule (seconds), the speedup and its ceiling.

    `batch_work_s`: the lazy batch backward's measured seconds (sync traces); otherwise it is the
    items' work scaled by the padding factor when the items carry token counts, else their work.
    `calibration` (sync traces with item positions): stream's backwards are priced per position from
    the batch (batch_work_s / batch_positions), with the calibration's scale, per-backward cost and
    rollout slowdown; the other schedules are as without it.
    """
    makespan = max(0.0, max((i.finished_at_s for i in items), default=0.0))  # async items may predate the round
    work = sum(i.learner_cost_s for i in items)
    if batch_work_s is None:
        pf = padding_factor(items)
        batch_work_s = work * pf if pf is not None else work
    batch_per_learner = batch_work_s / learners
    t_sync = makespan + batch_per_learner + step_s + sync_s
    if calibration is None:
        t_stream = drain_time(items, learners) + step_s + sync_s
    else:
        t_stream = calibrated_drain(items, learners, batch_work_s, batch_positions, calibration) + step_s + sync_s
    t_async = max(makespan if rollout_s is None else rollout_s, batch_per_learner + step_s) + sync_s
    return {
        "items": len(items), "learners": learners, "makespan_s": makespan, "work_s": work,
        "batch_work_s": batch_work_s, "optimizer_step_s": step_s, "weight_sync_s": sync_s,
        "sync_s": t_sync, "stream_s": t_stream, "async_s": t_async,
        "speedup": _ratio(t_sync, t_stream), "speedup_async": _ratio(t_sync, t_async),
        "ceiling": ceiling(makespan, work, batch_work_s, learners, step_s + sync_s),
    }


def calibrated_drain(items, learners: int, batch_work_s: float, batch_positions: int | None,
                     cal: Calibration) -> float:
    """Stream's drain from a sync round's items, priced per position (Calibration's docstring)."""
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
    per_pos = batch_work_s / batch_positions
    priced = [(i.finished_at_s, cal.cost_scale * per_pos * i.positions, i.trajectory) for i in items]
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
    for name, v in (("--learner-speed", learner_speed), ("--tool-speed", tool_speed)):
        if not v > 0:
            raise UsageError(f"{name} must be > 0 (got {v})")
    if not spread >= 0:
        raise UsageError(f"--spread must be >= 0 (got {spread})")
    if not items:
        return []
    med = statistics.median(i.finished_at_s for i in items)
    return [Item(max(0.0, med + spread * (i.finished_at_s - med)) / tool_speed, i.learner_cost_s / learner_speed,
                 i.tokens) for i in items]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


# ---------------------------------------------------------------------------- the command


def predict_trace(trace: Trace, *, step_s: float | None = None, sync_s: float | None = None,
                  learners: int | None = None, learner_speed: float = 1.0, tool_speed: float = 1.0,
                  spread: float = 1.0, warmup: int = 4, calibration: Calibration | None = None) -> dict:
    """Predict every round of a trace; the summary averages rounds after the warm-up.

    Flags override the trace's own step/sync/learner values; what the trace lacks defaults to
    step 0, sync 0, one learner. The measured comparison (run traces) is always made with the
    trace as recorded; the what-if knobs change only the predictions.
    """
    if learners is not None and learners < 1:
        raise UsageError(f"--learners must be >= 1 (got {learners})")
    for name, v in (("--step-s", step_s), ("--sync-s", sync_s)):
        if v is not None and v < 0:
            raise UsageError(f"{name} must be >= 0 (got {v})")
    knobs = {k: v for k, v in (("learners", learners), ("learner_speed", learner_speed),
                               ("tool_speed", tool_speed), ("spread", spread)) if v not in (None, 1.0)}
    rounds = predict_rounds(trace, step_s=step_s, sync_s=sync_s, calibration=calibration)
    if knobs and calibration is not None:
        raise UsageError("--calibration and the what-if knobs do not combine: the calibration was fitted on "
                         "this machine as traced")
    if knobs:
        for row, r in zip(rounds, trace.rounds):
            row["as_traced"] = {k: row[k] for k in ("sync_s", "stream_s", "async_s", "speedup")}
            items = what_if(r.items, learner_speed, tool_speed, spread)
            bw = None if r.batch_work_s is None else r.batch_work_s / learner_speed
            ro = None if r.rollout_s is None else r.rollout_s / tool_speed
            row.update(predict_round(items, row["optimizer_step_s"], row["weight_sync_s"],
                                     learners or r.learners or 1, batch_work_s=bw, rollout_s=ro))
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
    errs = [abs(r["error_pct"]) for r in counted if r.get("error_pct") is not None]
    if errs:
        doc["measured_from"] = trace.measured_from
        doc["mean_abs_error_pct"] = statistics.fmean(errs)
        doc["error_rows"] = len(errs)
    if len(rounds) > 1:
        doc["rounds"] = rounds
    return doc


def predict_rounds(trace: Trace, step_s: float | None = None, sync_s: float | None = None,
                   calibration: Calibration | None = None) -> list[dict]:
    """predict_round for every round as recorded; with the measured step time and the error
    (predicted under the trace's own schedule minus measured, in % of measured) where known."""
    if calibration is not None and trace.schedule != "sync":
        raise UsageError(f"--calibration predicts stream from a sync run's trace; {trace.source} was recorded "
                         f"under {trace.schedule or 'no schedule (a minimal trace)'}")
    rows = []
    for r in trace.rounds:
        st = step_s if step_s is not None else (r.step_s or 0.0)
        sy = sync_s if sync_s is not None else (r.sync_s or 0.0)
        bw = r.batch_work_s
        if bw is None and not trace.padded_sync:  # sync_batching per_item: sync does the items' own work
            bw = sum(i.learner_cost_s for i in r.items)
        row = {"round": r.round, **predict_round(r.items, st, sy, r.learners or 1, batch_work_s=bw,
                                                 rollout_s=r.rollout_s, calibration=calibration,
                                                 batch_positions=r.batch_positions)}
        if r.measured_step_s is not None and trace.schedule in ("sync", "stream", "async"):
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


# ---------------------------------------------------------------------------- reading traces


def load_trace(path: str | Path) -> Trace:
    """A run directory, an events.jsonl, or a minimal trace (.csv, or JSONL rows without `event`).

    A run directory's files are read as a run's (a torn last line, the run still being written,
    is left out); a file named on its own must be whole: any malformed row is an error."""
    p = Path(path)
    if p.is_dir():
        run = RunDir(p)
        events = run.read(EVENTS, DROP_LAST)
        if not events.path.is_file():
            raise UsageError(f"{p}: not a run directory (no events.jsonl)")
        trace = _from_events(events.path, events.numbered(), run.rows(METRICS, DROP_LAST), kind="run")
        # the sync baseline's batching as the run's config says (the default, padded, where it predates the key)
        return replace(trace, padded_sync=not run.started() or run.config().sync_batching != "per_item")
    if not p.is_file():
        raise UsageError(f"--trace {p}: not found (a run directory, an events.jsonl or a CSV/JSONL trace)")
    if p.suffix.lower() == ".csv":
        with p.open(newline="") as f:
            rows = [(n, row) for n, row in enumerate(csv.DictReader(f), start=2)]
        return _from_minimal(p, rows)
    rows = read_jsonl(p, STRICT).numbered()
    if any("event" in row for _, row in rows):
        return _from_events(p, rows, read_jsonl(p.with_name(METRICS), STRICT).rows, kind="events")
    return _from_minimal(p, rows)


def _num(p: Path, n: int, row: dict, key: str, required: bool = True, negative_ok: bool = False) -> float | None:
    """A finite number >= 0; `finished_at_s` may be negative: an async item generated before its
    round started (docs/run-directory.md) is waiting at the round's start, which the model handles."""
    v = row.get(key)
    if v in (None, ""):
        if required:
            raise UsageError(f"{p}:{n}: field '{key}': missing")
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise UsageError(f"{p}:{n}: field '{key}': not a number ({v!r})") from None
    if not math.isfinite(x) or (x < 0 and key != "finished_at_s" and not negative_ok):
        raise UsageError(f"{p}:{n}: field '{key}': must be a finite number >= 0 (got {v!r})")
    return x


def _from_minimal(p: Path, rows: list[tuple[int, dict]]) -> Trace:
    by_round: dict[int, list[Item]] = {}
    for n, row in rows:
        rnd = _num(p, n, row, "round", required=False)
        tok = _num(p, n, row, "tokens", required=False)
        item = Item(_num(p, n, row, "finished_at_s"), _num(p, n, row, "learner_cost_s"),
                    int(tok) if tok is not None else None)
        by_round.setdefault(int(rnd) if rnd is not None else 1, []).append(item)
    if not by_round:
        raise UsageError(f"{p}: no rows (expected finished_at_s, learner_cost_s[, round])")
    return Trace(str(p), "minimal", None, tuple(RoundTrace(k, tuple(v)) for k, v in sorted(by_round.items())))


def _span(p: Path, n: int, row: dict, allow_negative: bool = False) -> float:
    """end_s - start_s; a `rollout` span may start before its round (async runs ahead)."""
    start = _num(p, n, row, "start_s", negative_ok=allow_negative)
    end = _num(p, n, row, "end_s", negative_ok=allow_negative)
    if end < start:
        raise UsageError(f"{p}:{n}: end_s < start_s")
    return end - start


def _from_events(p: Path, rows: list[tuple[int, dict]], metrics: list[dict], kind: str) -> Trace:
    """Rounds from events.jsonl; sync rounds share the batch backward out by loss_tokens.

    Several `step` (or `weight_sync`) events in one round are summed: the model puts them all at
    the round's end. Each `batch_backward` span counts as learner-seconds (exact for one learner,
    and for one event per learner device).
    """
    rounds: dict[int, dict] = {}
    for n, row in rows:
        r = rounds.setdefault(int(_num(p, n, row, "round")), {
            "items": [], "batch": 0.0, "has_batch": False, "step": None, "sync": None, "learners": None,
            "end": None, "stale": False, "padded": True, "rollout": None, "positions": None})
        ev = row.get("event")
        if ev == "item":
            r["items"].append((n, row))
            r["stale"] |= bool(row.get("staleness"))
        elif ev == "batch_backward":
            r["batch"] += _span(p, n, row)
            r["has_batch"] = True
            r["padded"] = r["padded"] and row.get("padded", True) is not False
        elif ev in ("step", "weight_sync"):
            k = "step" if ev == "step" else "sync"
            r[k] = (r[k] or 0.0) + _span(p, n, row)
        elif ev == "rollout":
            r["rollout"] = _span(p, n, row, allow_negative=True)
        elif ev == "learner_work" and row.get("positions"):
            r["positions"] = (r["positions"] or 0) + int(row["positions"])
        elif ev == "round_end":
            r["end"] = _num(p, n, row, "at_s", required=False)
            r["learners"] = int(row["learners"]) if row.get("learners") else None
    measured, schedule = {}, None
    for row in metrics:  # the run's metrics.jsonl rows ([] when there is none)
        schedule = row.get("schedule") or schedule
        if row.get("step_time_s") is not None and "round" in row:
            measured.setdefault(int(row["round"]), float(row["step_time_s"]))
    measured_from = "metrics.jsonl step_time_s" if measured else None
    if not measured and any(r["end"] is not None for r in rounds.values()):
        measured = {k: r["end"] for k, r in rounds.items() if r["end"] is not None}
        measured_from = "events.jsonl round_end.at_s"
    if schedule is None:  # inferred from the events themselves
        schedule = "async" if any(r["stale"] for r in rounds.values()) else \
            "sync" if any(r["has_batch"] for r in rounds.values()) else "stream"
    out = []
    for k, r in sorted(rounds.items()):
        if not r["items"]:
            continue
        out.append(RoundTrace(k, _round_items(p, r), r["step"], r["sync"], r["learners"], measured.get(k),
                              r["batch"] if r["has_batch"] else None, r["rollout"],
                              r["positions"] if r["has_batch"] else None))
    return Trace(str(p), kind, schedule, tuple(out), measured_from)


def _round_items(p: Path, r: dict) -> tuple[Item, ...]:
    rows = r["items"]
    costs = [_num(p, n, row, "learner_cost_s", required=False) for n, row in rows]
    # Lengths only for whole trajectories (GRPO): an OPD turn's backward runs over its whole prefix,
    # and the lazy batch over trajectories, so turn lengths say nothing about padding.
    lengths = [_num(p, n, row, "tokens", required=False) if row.get("turn") is None else None for n, row in rows]
    lengths = [int(t) if t is not None else None for t in lengths]
    if any(c is None for c in costs):
        if not r["has_batch"]:
            n = rows[costs.index(None)][0]
            raise UsageError(f"{p}:{n}: field 'learner_cost_s': missing, and the round has no batch_backward "
                             "event to share out")
        if all(t for t in lengths) and r["padded"]:
            # sync: the padded batch computed B * T_max positions; item i's own share is T_i of them
            costs = [r["batch"] * t / (len(lengths) * max(lengths)) for t in lengths]
        elif all(t for t in lengths):  # sync_batching per_item: the items' own backwards, by real tokens
            costs = [r["batch"] * t / sum(lengths) for t in lengths]
        else:  # no lengths: the batch shared out by loss_tokens (equal shares if absent)
            tokens = [float(row.get("loss_tokens") or 0) for _, row in rows]
            total = sum(tokens)
            shares = [t / total for t in tokens] if total > 0 else [1 / len(rows)] * len(rows)
            costs = [r["batch"] * s for s in shares]
    return tuple(Item(_num(p, n, row, "finished_at_s"), c, t, *_backward_of(p, n, row))
                 for (n, row), c, t in zip(rows, costs, lengths))


def _backward_of(p: Path, n: int, row: dict) -> tuple[int | None, str | None]:
    """(positions, trajectory) of the item's own stream backward: a trajectory's tokens (GRPO), or an
    OPD turn's prefix plus the turn, keyed by its trajectory; None where the event lacks them."""
    tok = _num(p, n, row, "tokens", required=False)
    if row.get("turn") is None:
        return (int(tok) if tok else None), None
    pre = _num(p, n, row, "prefix_tokens", required=False)
    pos = int(pre + tok) if pre is not None and tok is not None else None
    return pos, f"{row.get('group_id')}/{row.get('sample_index')}"


def streaming_of(run_dir: str | Path) -> dict:
    """streaming_gain on a finished run, for its summary: a failure of the model never fails the run."""
    try:
        return streaming_gain(run_dir)
    except Exception as e:  # noqa: BLE001 - the run is done and recorded; only the comparison is lost
        return {**dict.fromkeys(GAIN_KEYS), "status": "unavailable", "rounds": [],
                "reason": f"the event model failed: {type(e).__name__}: {e}"}
