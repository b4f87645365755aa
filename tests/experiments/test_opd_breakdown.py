"""experiments/opd_breakdown.py on hand-made events: every number below is worked out by hand.

Stream round (three turns A, B, C of one round):

    turn  closed  teacher start  scores (arrival)  backward
    A     0.10    0.12           0.20              0.20-0.50
    B     0.30    0.50           0.60              0.60-0.80
    C     0.35    0.60           0.70              0.82-1.00   (queued 0.70-0.82: the learner was on B,
                                                                  then 0.02 s between backwards)

    rollout 0.00-0.65, step 1.00-1.02, weight sync 1.02-1.05, round end 1.05
    teacher busy = 0.08 + 0.10 + 0.10 = 0.28; lag = (0.10 + 0.30 + 0.35) / 3 = 0.25
    learner busy = 0.30 + 0.20 + 0.18 = 0.68; idle = 1.05 - 0.68 - 0.02 - 0.03 = 0.32
    queue wait: 0, 0, 0.12 (mean 0.04); between backwards with C queued: 0.80-0.82 = 0.02
    blocked on teacher: idle while a turn was at the teacher = [0.10, 0.20] + [0.50, 0.60] = 0.20
    (0.00-0.10: nothing closed yet, the learner waits on the rollout, not the teacher)

Sync round: the same turns, one batch 0.70-1.10, step 1.10-1.12, sync 1.12-1.15, round end 1.15.
"""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "opd_breakdown.py"


def _load():
    spec = importlib.util.spec_from_file_location("opd_breakdown", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TURNS = [("A", 0.10, 0.12, 0.20, 0.20, 0.50), ("B", 0.30, 0.50, 0.60, 0.60, 0.80), ("C", 0.35, 0.60, 0.70, 0.82, 1.00)]


def _items(k, stream):
    out = []
    for name, closed, start, arrival, b0, b1 in TURNS:
        out.append({"round": k, "event": "item", "id": name, "group_id": "g", "sample_index": 0, "turn": 0,
                    "finished_at_s": arrival, "backward_start_s": b0 if stream else 0.70,
                    "backward_end_s": b1 if stream else 1.10, "learner_cost_s": (b1 - b0) if stream else None,
                    "tokens": 5, "loss_tokens": 5, "staleness": 0, "reward": None,
                    "closed_at_s": closed, "teacher_start_s": start, "prefix_tokens": 100})
    return out


def stream_round(k=2):
    return _items(k, True) + [
        {"round": k, "event": "rollout", "start_s": 0.0, "end_s": 0.65},
        {"round": k, "event": "step", "start_s": 1.00, "end_s": 1.02},
        {"round": k, "event": "weight_sync", "start_s": 1.02, "end_s": 1.05},
        {"round": k, "event": "learner_work", "backwards": 3, "microbatches": 3, "positions": 300,
         "trajectory_tokens": 200, "padded_tokens": 240, "busy_cpu_s": 0.5},
        {"round": k, "event": "teacher", "busy_s": 0.28, "busy_cpu_s": 0.2, "turns": 3, "positions": 200},
        {"round": k, "event": "round_end", "at_s": 1.05, "learners": 1},
    ]


def sync_round(k=2):
    return _items(k, False) + [
        {"round": k, "event": "batch_backward", "start_s": 0.70, "end_s": 1.10, "items": 3, "loss_tokens": 15,
         "padded": True},
        {"round": k, "event": "rollout", "start_s": 0.0, "end_s": 0.65},
        {"round": k, "event": "step", "start_s": 1.10, "end_s": 1.12},
        {"round": k, "event": "weight_sync", "start_s": 1.12, "end_s": 1.15},
        {"round": k, "event": "learner_work", "backwards": 1, "microbatches": 1, "positions": 240,
         "trajectory_tokens": 200, "padded_tokens": 240, "busy_cpu_s": 0.4},
        {"round": k, "event": "round_end", "at_s": 1.15, "learners": 1},
    ]


def test_stream_round_by_hand():
    b = _load().round_breakdown(stream_round())
    want = {"step_s": 1.05, "rollout_s": 0.65, "last_arrival_s": 0.70, "teacher_tail_s": 0.05,
            "teacher_busy_s": 0.28, "teacher_cpu_s": 0.2, "teacher_lag_s": 0.25, "learner_busy_s": 0.68,
            "learner_cpu_s": 0.5, "positions": 300, "trajectory_tokens": 200, "padded_tokens": 240,
            "reencoding": 1.5, "queue_mean_s": 0.04, "queue_max_s": 0.12, "blocked_on_teacher_s": 0.20,
            "between_backwards_s": 0.02, "after_last_arrival_s": 0.30, "optimizer_step_s": 0.02,
            "weight_sync_s": 0.03, "learner_idle_s": 0.32,
            "ceiling": None}
    assert b.keys() == want.keys()
    for k, v in want.items():
        assert b[k] == pytest.approx(v, abs=1e-12), k


def test_sync_round_by_hand():
    b = _load().round_breakdown(sync_round())
    assert b["learner_busy_s"] == pytest.approx(0.40)
    assert b["learner_idle_s"] == pytest.approx(1.15 - 0.40 - 0.02 - 0.03)
    assert b["after_last_arrival_s"] == pytest.approx(0.40)
    assert b["reencoding"] == pytest.approx(1.2)
    assert b["queue_mean_s"] is None and b["blocked_on_teacher_s"] is None and b["between_backwards_s"] is None
    assert b["teacher_cpu_s"] is None  # no teacher event in this round
    assert b["ceiling"] == pytest.approx(1.15 / (0.70 + 0.02 + 0.03))  # learning hidden behind the 0.70 s rollout


def test_older_events_give_what_they_hold():
    """A run from before the teacher timing fields and the learner_work event: those rows are '-'."""
    old = [{k: v for k, v in e.items() if k not in ("closed_at_s", "teacher_start_s", "prefix_tokens")}
           for e in stream_round() if e["event"] not in ("learner_work", "teacher")]
    b = _load().round_breakdown(old)
    assert b["learner_busy_s"] == pytest.approx(0.68) and b["queue_max_s"] == pytest.approx(0.12)
    assert b["teacher_busy_s"] is None and b["positions"] is None and b["blocked_on_teacher_s"] is None


def test_interval_arithmetic():
    m = _load()
    assert m.union([(0.5, 0.6), (0.0, 0.2), (0.1, 0.3), (0.4, 0.4)]) == [(0.0, 0.3), (0.5, 0.6)]
    assert m.length([(0.0, 1.0), (0.5, 2.0)]) == 2.0
    assert m.intersect([(0.0, 1.0), (2.0, 3.0)], [(0.5, 2.5)]) == [(0.5, 1.0), (2.0, 2.5)]


def test_table_of_a_pair(tmp_path, capsys):
    m = _load()
    for schedule, make in (("sync", sync_round), ("stream", stream_round)):
        d = tmp_path / schedule
        d.mkdir()
        events = make(1) + make(2) + make(3)
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (d / "metrics.jsonl").write_text(json.dumps({"round": 1, "schedule": schedule}) + "\n")
    assert m.main([str(tmp_path / "sync"), str(tmp_path / "stream")]) == 0  # round 1 skipped by default
    out = capsys.readouterr().out
    step = next(line for line in out.splitlines() if line.startswith("| step s "))
    assert step.split("|")[2:5] == [" 1.150 ", " 1.050 ", f" {1.05 / 1.15:.2f} "]
    assert "rounds 2-3" in out
