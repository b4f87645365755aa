"""streaming_gain: what streaming bought in one run, against hand-computed traces; `tsrl train` end to end.

The hand traces are run directories written here row by row; every expected number below is worked
out by hand in the comments (the event model: sync = M + Wb/L + s, stream = FIFO drain + s,
s = step + weight sync, docs/reports.md).
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tsrl_cli.predict import GAIN_KEYS, streaming_gain


def write_run(root: Path, schedule: str, rounds: dict, config: str | None = None) -> Path:
    """rounds: {k: {"items": [(finished_at_s, learner_cost_s or None, tokens)], "step": (a, b),
    "sync": (a, b), "batch": (a, b) or absent, "measured": step_time_s, "learners": L}}."""
    root.mkdir(parents=True, exist_ok=True)
    ev, met = [], []
    for k, r in rounds.items():
        for n, (at, cost, tok) in enumerate(r["items"]):
            ev.append({"round": k, "event": "item", "id": f"t{k}-{n}", "group_id": "g", "sample_index": n,
                       "turn": None, "finished_at_s": at, "learner_cost_s": cost, "tokens": tok, "loss_tokens": 10,
                       "staleness": 0, "reward": 0.5})
        if "batch" in r:
            ev.append({"round": k, "event": "batch_backward", "start_s": r["batch"][0], "end_s": r["batch"][1],
                       "items": len(r["items"]), "loss_tokens": 10 * len(r["items"]), "padded": True})
        ev.append({"round": k, "event": "step", "start_s": r["step"][0], "end_s": r["step"][1]})
        ev.append({"round": k, "event": "weight_sync", "start_s": r["sync"][0], "end_s": r["sync"][1]})
        ev.append({"round": k, "event": "round_end", "at_s": r["measured"], "learners": r.get("learners", 1)})
        met.append({"round": k, "schedule": schedule, "step_time_s": r["measured"]})
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in met))
    if config is not None:
        (root / "config.yaml").write_text(config)
    return root


# Round 1 is the warm-up the summary leaves out: absurd numbers that would show if it were counted.
WARMUP = {"items": [(100.0, 50.0, 10)], "step": (150.0, 151.0), "sync": (151.0, 152.0), "measured": 1000.0}

STREAM = {
    1: WARMUP,
    # arrivals 1 s (2 s of work) and 3 s (1 s), equal lengths (no padding: Wb = W = 3), s = 0.5 + 0.25
    # sync = 3 + 3 + 0.75 = 6.75; stream: [1, 3] then [3, 4] -> 4 + 0.75 = 4.75; measured 5.0
    # balance W / M = 3 / 3 = 1
    2: {"items": [(1.0, 2.0, 100), (3.0, 1.0, 100)], "step": (4.0, 4.5), "sync": (4.5, 4.75), "measured": 5.0},
    # both arrive at 2 s, costs 1 s and 0.5 s, lengths 100 and 50: padding B * T_max / sum T = 200 / 150,
    # Wb = 1.5 * 4/3 = 2; s = 0.4 + 0.1. sync = 2 + 2 + 0.5 = 4.5; stream: [2, 3], [3, 3.5] -> 3.5 + 0.5 = 4.0
    # measured 3.8; balance 1.5 / 2 = 0.75
    3: {"items": [(2.0, 1.0, 100), (2.0, 0.5, 50)], "step": (3.5, 3.9), "sync": (3.9, 4.0), "measured": 3.8},
}


def test_stream_run_against_hand_arithmetic(tmp_path):
    g = streaming_gain(write_run(tmp_path / "run", "stream", STREAM))
    assert set(g) == set(GAIN_KEYS)
    assert g["status"] == "ok" and g["schedule"] == "stream" and g["reason"] is None
    assert g["rounds"] == [2, 3] and g["learners"] == 1
    assert g["measured_step_s"] == pytest.approx((5.0 + 3.8) / 2)  # 4.4
    assert g["predicted_sync_step_s"] == pytest.approx((6.75 + 4.5) / 2)  # 5.625
    assert g["predicted_stream_step_s"] == pytest.approx((4.75 + 4.0) / 2)  # 4.375
    assert g["speedup"] == pytest.approx(5.625 / 4.4)  # 1.2784: predicted sync / measured
    assert g["predicted_speedup"] == pytest.approx(5.625 / 4.375)
    assert g["model_error_pct"] == pytest.approx(100 * (4.375 - 4.4) / 4.4)
    assert g["balance"] == pytest.approx((1.0 + 0.75) / 2)
    # ceiling at the rounds' means: M 2.5, W 2.25, Wb 2.5, s 0.625 -> (2.5 + 2.5 + 0.625) / (2.5 + 0.625) = 1.8
    assert g["ceiling"] == pytest.approx(1.8)
    assert g["note"] is None


def test_sync_run_against_hand_arithmetic(tmp_path):
    # round 2 under sync: items carry no cost; one padded batch backward of 3 s (3 to 6 s) over two items of
    # 100 tokens: each costs 3 * 100 / (2 * 100) = 1.5 s. step 6-6.5, weight sync 6.5-6.75: s = 0.75.
    # predicted sync = 3 + 3 + 0.75 = 6.75; stream: [1, 2.5], [3, 4.5] -> 4.5 + 0.75 = 5.25; measured 6.8
    rounds = {1: WARMUP, 2: {"items": [(1.0, None, 100), (3.0, None, 100)], "batch": (3.0, 6.0),
                             "step": (6.0, 6.5), "sync": (6.5, 6.75), "measured": 6.8}}
    g = streaming_gain(write_run(tmp_path / "run", "sync", rounds))
    assert g["status"] == "ok" and g["schedule"] == "sync" and g["rounds"] == [2]
    assert g["measured_step_s"] == pytest.approx(6.8)
    assert g["predicted_sync_step_s"] == pytest.approx(6.75)
    assert g["predicted_stream_step_s"] == pytest.approx(5.25)
    assert g["speedup"] == pytest.approx(6.8 / 5.25)  # measured sync / predicted stream
    assert g["model_error_pct"] == pytest.approx(100 * (6.75 - 6.8) / 6.8)
    assert g["balance"] == pytest.approx(3.0 / 3.0)
    assert "batch backward" in g["note"]


def test_two_learners(tmp_path):
    # two learners; arrivals 1, 2, 3 s with costs 4, 1, 1 (equal lengths): A runs [1, 5], B [2, 3] then [3, 4]
    # stream = 5 + 0; sync = 3 + 6 / 2 + 0 = 6; measured 5.2. balance (W / L) / M = 3 / 3 = 1
    rounds = {1: {**WARMUP, "learners": 2},
              2: {"items": [(1.0, 4.0, 10), (2.0, 1.0, 10), (3.0, 1.0, 10)], "step": (5.0, 5.0), "sync": (5.0, 5.0),
                  "measured": 5.2, "learners": 2}}
    g = streaming_gain(write_run(tmp_path / "run", "stream", rounds))
    assert g["learners"] == 2
    assert g["predicted_sync_step_s"] == pytest.approx(6.0)
    assert g["predicted_stream_step_s"] == pytest.approx(5.0)
    assert g["speedup"] == pytest.approx(6.0 / 5.2)
    assert g["balance"] == pytest.approx(1.0)


def test_one_round_is_counted_with_a_note(tmp_path):
    g = streaming_gain(write_run(tmp_path / "run", "stream", {1: STREAM[2]}))
    assert g["status"] == "ok" and g["rounds"] == [1]
    assert g["speedup"] == pytest.approx(6.75 / 5.0)
    assert "one round only" in g["note"]


def test_async_is_not_compared(tmp_path):
    g = streaming_gain(write_run(tmp_path / "run", "async", STREAM))
    assert g["status"] == "not_applicable" and "off-policy" in g["reason"]
    assert g["speedup"] is None and g["predicted_sync_step_s"] is None


@pytest.mark.parametrize("damage,reason", [
    ("no_dir", "no metrics.jsonl"),
    ("no_events", "no events.jsonl"),
    ("empty_metrics", "no rounds"),
    ("bad_events", "cannot read this run's trace"),
    ("no_warm_items", "no item events"),
    ("bad_metrics", "not a number"),
])
def test_unusable_runs_say_why(tmp_path, damage, reason):
    root = write_run(tmp_path / "run", "stream", STREAM)
    if damage == "no_dir":
        root = tmp_path / "nowhere"
    elif damage == "no_events":
        (root / "events.jsonl").unlink()
    elif damage == "empty_metrics":
        (root / "metrics.jsonl").write_text("")
    elif damage == "bad_events":
        (root / "events.jsonl").write_text('{"round": 2, "event": "item", "finished_at_s": "soon"}\n')
    elif damage == "bad_metrics":
        (root / "metrics.jsonl").write_text('{"round": "second", "schedule": "stream", "step_time_s": 1.0}\n')
    elif damage == "no_warm_items":
        keep = [line for line in (root / "events.jsonl").read_text().splitlines()
                if json.loads(line)["event"] != "item" or json.loads(line)["round"] == 1]
        (root / "events.jsonl").write_text("\n".join(keep) + "\n")
    g = streaming_gain(root)
    assert g["status"] == "unavailable" and reason in g["reason"]
    assert set(g) == set(GAIN_KEYS) and g["speedup"] is None


def test_schedule_inferred_from_events_when_metrics_lack_it(tmp_path):
    root = write_run(tmp_path / "run", "stream", STREAM)
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    (root / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "schedule"}) + "\n"
                                                for r in rows))
    g = streaming_gain(root)  # no batch_backward, no staleness: a stream trace
    assert g["schedule"] == "stream" and g["speedup"] == pytest.approx(5.625 / 4.4)


def test_warm_rounds_left_out_when_they_lack_items(tmp_path):
    root = write_run(tmp_path / "run", "stream", STREAM)
    keep = [line for line in (root / "events.jsonl").read_text().splitlines()
            if not (json.loads(line)["event"] == "item" and json.loads(line)["round"] == 3)]
    (root / "events.jsonl").write_text("\n".join(keep) + "\n")
    g = streaming_gain(root)
    assert g["rounds"] == [2] and "[3]" in g["note"]
    assert g["speedup"] == pytest.approx(6.75 / 5.0)  # round 2 alone, measured over the same round


# ---------------------------------------------------------------------------- `tsrl train` end to end


def hand_sync_prediction(run_dir: Path, k: int) -> float:
    """The lazy baseline's step time for round k of a stream run, straight from its files:
    last arrival + sum of item costs * B * T_max / sum T + step + weight sync (one learner)."""
    ev = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    items = [e for e in ev if e["round"] == k and e["event"] == "item"]
    toks = [e["tokens"] for e in items]
    work = sum(e["learner_cost_s"] for e in items) * len(toks) * max(toks) / sum(toks)
    spans = sum(e["end_s"] - e["start_s"] for e in ev if e["round"] == k and e["event"] in ("step", "weight_sync"))
    return max(e["finished_at_s"] for e in items) + work + spans


@pytest.mark.slow
def test_train_reports_what_streaming_bought(tmp_path):
    from tsrl_cli.cli import app

    runner = CliRunner()
    base = ["train", "experiments/smoke/tiny_cpu.yaml", "--rounds", "2"]
    res = runner.invoke(app, [*base, "--out", str(tmp_path / "stream"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    g = doc["streaming"]
    assert g["status"] == "ok" and g["schedule"] == "stream" and g["rounds"] == [2]
    run = tmp_path / "stream"
    measured = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1]["step_time_s"]
    assert g["measured_step_s"] == pytest.approx(measured) == pytest.approx(doc["step_time_mean_s"])
    assert g["predicted_sync_step_s"] == pytest.approx(hand_sync_prediction(run, 2))
    assert g["speedup"] == pytest.approx(hand_sync_prediction(run, 2) / measured)

    res = runner.invoke(app, [*base, "--out", str(tmp_path / "sync"), "--schedule", "sync"])
    assert res.exit_code == 0, res.output
    g = streaming_gain(tmp_path / "sync")
    assert g["status"] == "ok" and g["schedule"] == "sync"
    for text in ("stream step, predicted", "streaming speedup", "balance", f"{g['speedup']:.2f}x"):
        assert text in res.stdout, text
