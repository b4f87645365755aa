"""Traces of rounds for the event model (tsrl_cli.predict): what reached the learner when, and what it cost.

    load_trace(path) -> Trace   a run directory (events.jsonl + metrics.jsonl, docs/run-directory.md), an
                                events.jsonl, or a minimal trace (CSV or JSONL rows with finished_at_s,
                                learner_cost_s, optional round)
    Item, RoundTrace, Trace     the model's inputs (times in seconds since the round started)

A run directory is read as a run's (a torn last line of a run still being written is left out); a file named
on its own must be whole. A bad field is a UsageError naming the file, the line and the field. Pure python.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.rundir import DROP_LAST, EVENTS, METRICS, STRICT, RunDir, read_jsonl


@dataclass(frozen=True)
class Item:
    finished_at_s: float  # arrival at the learner, seconds since the round started
    learner_cost_s: float  # seconds of learner work (forward + backward) for this item
    tokens: int | None = None  # the item's sequence length (padding-aware batch pricing), when known
    positions: int | None = None  # token positions of this item's own backward (GRPO: T_i; OPD turn: its end)
    trajectory: str | None = None  # OPD: the trajectory of this turn (its queued turns share one backward)
    last: bool = False  # OPD: the turn was known to be its trajectory's last as it closed (its row may start here)
    group: str | None = None  # the item's group (GRPO group, OPD prompt): granularity group, arrival correlation


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
    work_positions: int | None = None  # token positions the round's backwards covered, any schedule (`learner_work`)
    ends: tuple[tuple[str, float, int | None], ...] = ()  # OPD: (trajectory, its end at the learner s, its tokens)
    teacher_busy_s: float | None = None  # OPD: the teacher's scoring seconds in the round (`teacher` event)
    teacher_positions: int | None = None  # OPD: the token positions the teacher's forwards covered


@dataclass(frozen=True)
class Trace:
    source: str
    kind: str  # run | events | minimal
    schedule: str | None  # the schedule the trace was recorded under (None: minimal trace)
    rounds: tuple[RoundTrace, ...]
    measured_from: str | None = None
    padded_sync: bool = True  # the sync baseline backwards one padded batch (run config sync_batching)
    opd_unit: str | None = None  # OPD: the run's learner.opd_unit (turn for runs before the key); None: unknown


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
        trace = replace(trace, padded_sync=not run.started() or run.config().sync_batching != "per_item")
        return _with_opd_unit(trace, run)
    if not p.is_file():
        raise UsageError(f"--trace {p}: not found (a run directory, an events.jsonl or a CSV/JSONL trace)")
    if p.suffix.lower() == ".csv":
        with p.open(newline="") as f:
            rows = [(n, row) for n, row in enumerate(csv.DictReader(f), start=2)]
        return _from_minimal(p, rows)
    rows = read_jsonl(p, STRICT).numbered()
    if any("event" in row for _, row in rows):
        return _with_opd_unit(_from_events(p, rows, read_jsonl(p.with_name(METRICS), STRICT).rows, kind="events"),
                              RunDir(p.parent))
    return _from_minimal(p, rows)


def _with_opd_unit(trace: Trace, run: RunDir) -> Trace:
    """An OPD trace with the unit stream ran (or would run) with: the run's config.yaml learner.opd_unit;
    a run written before that key backwarded turns. None where no config.yaml is there."""
    if not run.started() or not any(i.trajectory for r in trace.rounds for i in r.items):
        return trace
    return replace(trace, opd_unit=(run.config_dict().get("learner") or {}).get("opd_unit", "turn"))


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
        gid = row.get("group_id")
        item = Item(_num(p, n, row, "finished_at_s"), _num(p, n, row, "learner_cost_s"),
                    int(tok) if tok is not None else None, group=None if gid in (None, "") else str(gid))
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
            "end": None, "stale": False, "padded": True, "rollout": None, "positions": None, "ends": [],
            "teacher": (None, None)})
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
        elif ev == "trajectory" and row.get("group_id") is not None:  # OPD: a trajectory's end at the learner
            tok = _num(p, n, row, "tokens", required=False)
            r["ends"].append((f"{row['group_id']}/{row.get('sample_index')}", _num(p, n, row, "finished_at_s"),
                              int(tok) if tok is not None else None))
        elif ev == "teacher":  # OPD: the teacher's busy seconds and forward positions
            pos = _num(p, n, row, "positions", required=False)
            r["teacher"] = (_num(p, n, row, "busy_s"), None if pos is None else int(pos))
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
                              r["positions"] if r["has_batch"] else None, r["positions"], tuple(r["ends"]),
                              *r["teacher"]))
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
    return tuple(Item(_num(p, n, row, "finished_at_s"), c, t, *_backward_of(p, n, row), bool(row.get("last")),
                      None if row.get("group_id") is None else str(row["group_id"]))
                 for (n, row), c, t in zip(rows, costs, lengths, strict=True))


def _backward_of(p: Path, n: int, row: dict) -> tuple[int | None, str | None]:
    """(positions, trajectory) of the item's own stream backward: a trajectory's tokens (GRPO), or an
    OPD turn's `prefix_tokens` (the turn's end: its row covers the prefix and the turn), keyed by its
    trajectory; None where the event lacks them."""
    if row.get("turn") is None:
        tok = _num(p, n, row, "tokens", required=False)
        return (int(tok) if tok else None), None
    pre = _num(p, n, row, "prefix_tokens", required=False)
    return (int(pre) if pre else None), f"{row.get('group_id')}/{row.get('sample_index')}"
