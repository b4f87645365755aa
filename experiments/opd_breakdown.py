"""Where an OPD round's time goes, per schedule, from the run directories' events.jsonl.

    python experiments/opd_breakdown.py RUN_DIR [RUN_DIR ...] [--skip 1] [--per-round]

Each run is one column (its mean over the counted rounds; --skip drops the first rounds, which pay
one-off costs); with one sync and one stream run, a last column gives stream / sync. Seconds are
wall-clock seconds from the round's start, on the run's own clock. The rows:

  step                 round_end: the round's wall time (stream/sync of this row is the speedup's inverse)
  rollout              the rollout process's generation, first request to last trajectory
  last arrival         the last teacher-scored turn (or trajectory) reaching the learner
  teacher tail         last arrival - rollout end: how far the teacher stretches the round past the rollout
  teacher busy         sum over turns of the teacher's scoring spans (wall), and its CPU seconds
  teacher lag          mean per turn of scores-at-learner - turn close (teacher queue + scoring)
  learner busy         union of the learner's backward spans (wall), and its CPU seconds inside them
  learner positions    token positions the backwards covered (rows x width), over sum T_i (re-encoding)
  queue wait           stream: mean and max per turn of backward start - arrival (a scored turn waiting)
  blocked on teacher   stream: learner idle, nothing queued, while some closed turn was still at the teacher
  between backwards    stream: learner not in a backward while scored turns waited (its per-arrival bookkeeping)
  after last arrival   optimizer-step start - last arrival: learner work the round waits for at its end
  optimizer step, weight sync   the step and sync events
  learner idle         step - learner busy - optimizer step - weight sync
  ceiling              sync only: step / (max(last arrival, learner busy) + step + sync), the speedup if
                       stream overlapped all learning with the rollout and changed nothing else

Older runs (before the teacher and learner_work events) print what their events allow; the rest is "-".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

Interval = tuple[float, float]


# ---- interval arithmetic ------------------------------------------------------------------------


def union(spans: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty and reversed spans dropped)."""
    out: list[Interval] = []
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: list[Interval]) -> float:
    return sum(b - a for a, b in union(spans))


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    xs, ys = union(xs), union(ys)
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


# ---- one round ----------------------------------------------------------------------------------


def _span(ev: dict | None) -> float | None:
    return None if ev is None else ev["end_s"] - ev["start_s"]


def round_breakdown(events: list[dict]) -> dict:
    """The breakdown of one round from its events.jsonl rows (every row of that round, any order)."""
    items = [e for e in events if e["event"] == "item"]
    one = {e["event"]: e for e in events if e["event"] != "item"}  # at most one of each per round
    batch, work, teacher = one.get("batch_backward"), one.get("learner_work"), one.get("teacher")
    rollout, step, sync = one.get("rollout"), one.get("step"), one.get("weight_sync")
    stream = batch is None
    if stream:
        busy_spans = [(e["backward_start_s"], e["backward_end_s"]) for e in items
                      if e.get("backward_start_s") is not None]
    else:
        busy_spans = [(batch["start_s"], batch["end_s"])]
    last_arrival = max(e["finished_at_s"] for e in items)
    turns = [e for e in items if e.get("closed_at_s") is not None]
    scored = [e for e in turns if e.get("teacher_start_s") is not None]
    out = {
        "step_s": one["round_end"]["at_s"],
        "rollout_s": _span(rollout),
        "last_arrival_s": last_arrival,
        "teacher_tail_s": None if rollout is None or not turns else last_arrival - rollout["end_s"],
        "teacher_busy_s": sum(e["finished_at_s"] - e["teacher_start_s"] for e in scored) if scored else None,
        "teacher_cpu_s": None if teacher is None else teacher.get("busy_cpu_s"),
        "teacher_lag_s": statistics.fmean(e["finished_at_s"] - e["closed_at_s"] for e in turns) if turns else None,
        "learner_busy_s": length(busy_spans),
        "learner_cpu_s": None if work is None else work.get("busy_cpu_s"),
        "positions": None if work is None else work["positions"],
        "trajectory_tokens": None if work is None else work["trajectory_tokens"],
        "padded_tokens": None if work is None else work["padded_tokens"],
        "queue_mean_s": None, "queue_max_s": None, "blocked_on_teacher_s": None, "between_backwards_s": None,
        "after_last_arrival_s": (step["start_s"] - last_arrival) if step else None,
        "optimizer_step_s": _span(step), "weight_sync_s": _span(sync), "ceiling": None,
    }
    out["reencoding"] = (out["positions"] / out["trajectory_tokens"]) if work and work["trajectory_tokens"] else None
    out["learner_idle_s"] = out["step_s"] - out["learner_busy_s"] - (out["optimizer_step_s"] or 0.0) \
        - (out["weight_sync_s"] or 0.0)
    if not stream:  # the two-machine bound: rollout and learning fully overlapped, nothing else changed
        out["ceiling"] = out["step_s"] / (max(last_arrival, out["learner_busy_s"]) + (out["optimizer_step_s"] or 0.0)
                                          + (out["weight_sync_s"] or 0.0))
    if stream:
        waits = [e["backward_start_s"] - e["finished_at_s"] for e in items if e.get("backward_start_s") is not None]
        out["queue_mean_s"] = statistics.fmean(waits) if waits else None
        out["queue_max_s"] = max(waits) if waits else None
        if turns:
            # the learner had nothing to do (not busy, nothing queued) while a closed turn sat at the teacher
            queued = [(e["finished_at_s"], e["backward_start_s"]) for e in items
                      if e.get("backward_start_s") is not None]
            pending = intersect([(e["closed_at_s"], e["finished_at_s"]) for e in turns],
                                [(0.0, max(b for _, b in busy_spans) if busy_spans else last_arrival)])
            out["blocked_on_teacher_s"] = length(pending) - length(intersect(pending, busy_spans + queued))
        # per-arrival bookkeeping (queue reads, planning): not in a backward although turns were waiting
        queued = [(e["finished_at_s"], e["backward_start_s"]) for e in items if e.get("backward_start_s") is not None]
        out["between_backwards_s"] = length(queued) - length(intersect(queued, busy_spans))
    return out


# ---- runs ---------------------------------------------------------------------------------------


def read_run(run_dir: Path) -> tuple[str, dict[int, list[dict]]]:
    """(schedule, events by round) of one run directory."""
    by_round: dict[int, list[dict]] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            by_round.setdefault(int(e["round"]), []).append(e)
    schedule = "stream"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        first = metrics.read_text().splitlines()[0]
        schedule = json.loads(first).get("schedule", schedule)
    elif any(e["event"] == "batch_backward" for evs in by_round.values() for e in evs):
        schedule = "sync"
    return schedule, by_round


def mean_breakdown(rounds: list[dict]) -> dict:
    """Mean of each quantity over the rounds that have it (None where none has)."""
    keys = rounds[0].keys() if rounds else []
    out = {}
    for k in keys:
        xs = [r[k] for r in rounds if r[k] is not None]
        out[k] = statistics.fmean(xs) if xs else None
    if out.get("positions") and out.get("trajectory_tokens"):
        out["reencoding"] = out["positions"] / out["trajectory_tokens"]  # ratio of the means
    return out


ROWS = [  # (label, key, format)
    ("step s", "step_s", "{:.3f}"),
    ("rollout s", "rollout_s", "{:.3f}"),
    ("last arrival s", "last_arrival_s", "{:.3f}"),
    ("teacher tail s (last arrival - rollout end)", "teacher_tail_s", "{:.3f}"),
    ("teacher busy s (wall)", "teacher_busy_s", "{:.3f}"),
    ("teacher CPU s", "teacher_cpu_s", "{:.3f}"),
    ("teacher lag per turn s (close -> scores)", "teacher_lag_s", "{:.4f}"),
    ("learner busy s (wall)", "learner_busy_s", "{:.3f}"),
    ("learner CPU s in backwards", "learner_cpu_s", "{:.3f}"),
    ("learner positions", "positions", "{:.0f}"),
    ("sum T_i (trajectory tokens)", "trajectory_tokens", "{:.0f}"),
    ("B x T_max (padded batch)", "padded_tokens", "{:.0f}"),
    ("positions / sum T_i", "reencoding", "{:.2f}"),
    ("queue wait per turn s, mean", "queue_mean_s", "{:.4f}"),
    ("queue wait per turn s, max", "queue_max_s", "{:.3f}"),
    ("learner blocked on teacher s", "blocked_on_teacher_s", "{:.3f}"),
    ("learner between backwards, turns queued s", "between_backwards_s", "{:.3f}"),
    ("after last arrival s", "after_last_arrival_s", "{:.3f}"),
    ("optimizer step s", "optimizer_step_s", "{:.4f}"),
    ("weight sync s", "weight_sync_s", "{:.4f}"),
    ("learner idle s", "learner_idle_s", "{:.3f}"),
    ("sync: ceiling step / (max(last arrival, learner busy) + step + sync)", "ceiling", "{:.2f}"),
]


def _cell(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def table(columns: list[tuple[str, dict]], ratio: tuple[int, int] | None = None) -> str:
    """A markdown table: one row per quantity, one column per (label, breakdown); ratio (i, j): column i / j."""
    head = ["quantity"] + [c[0] for c in columns] + (["stream / sync"] if ratio else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, fmt in ROWS:
        cells = [_cell(fmt, c[1].get(key)) for c in columns]
        if ratio:
            a, b = columns[ratio[0]][1].get(key), columns[ratio[1]][1].get(key)
            cells.append(f"{a / b:.2f}" if a is not None and b else "-")
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (holding events.jsonl)")
    ap.add_argument("--skip", type=int, default=1, help="leading rounds not counted (default 1)")
    ap.add_argument("--per-round", action="store_true", help="also one table per run with every counted round")
    a = ap.parse_args(argv)
    columns, schedules = [], []
    for d in a.runs:
        schedule, by_round = read_run(d)
        rounds = {k: round_breakdown(evs) for k, evs in sorted(by_round.items()) if k > a.skip}
        if not rounds:
            print(f"{d}: no round after the first {a.skip}", file=sys.stderr)
            return 1
        label = f"{schedule} ({d.name}, rounds {min(rounds)}-{max(rounds)})"
        columns.append((label, mean_breakdown(list(rounds.values()))))
        schedules.append(schedule)
        if a.per_round:
            print(f"\n{d}\n\n" + table([(f"round {k}", r) for k, r in rounds.items()]) + "\n")
    ratio = (schedules.index("stream"), schedules.index("sync")) \
        if sorted(schedules) == ["stream", "sync"] else None
    print(table(columns, ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
