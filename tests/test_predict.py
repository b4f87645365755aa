"""The event model against hand-computed rounds, the trace readers, and `tsrl predict` end to end."""

import json

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.errors import UsageError
from tsrl_cli.predict import Item, drain_time, load_trace, predict_round, predict_trace, what_if

runner = CliRunner()


def items(*pairs):
    return [Item(a, c) for a, c in pairs]


def test_two_arrivals():
    # arrive at 1 s (2 s of work) and 3 s (1 s); step 0.5, sync 0.25, one learner
    # sync: 3 + 3 + 0.75 = 6.75; stream: [1, 3] then [3, 4] -> 4 + 0.75 = 4.75; async: max(3, 3.5) + 0.25
    p = predict_round(items((1, 2), (3, 1)), step_s=0.5, sync_s=0.25)
    assert p["sync_s"] == pytest.approx(6.75)
    assert p["stream_s"] == pytest.approx(4.75)
    assert p["async_s"] == pytest.approx(3.75)
    assert p["speedup"] == pytest.approx(6.75 / 4.75)
    assert p["ceiling"] == pytest.approx((3 + 3 + 0.75) / (3 + 0.75))


@pytest.mark.parametrize("n", [1, 4, 100, 10_000])
def test_exact_balance_tends_to_two(n):
    # n items arriving uniformly over T, each costing T/n: work == makespan == T
    # stream: each item starts on arrival and ends as the next arrives -> T + T/n; sync: 2T
    T = 10.0
    p = predict_round([Item(T * (i + 1) / n, T / n) for i in range(n)])
    assert p["sync_s"] == pytest.approx(2 * T)
    assert p["stream_s"] == pytest.approx(T * (1 + 1 / n))
    assert p["speedup"] == pytest.approx(2 * n / (n + 1))
    assert p["ceiling"] == pytest.approx(2.0)


def test_rollout_dominated_bounded_by_makespan():
    # 100 arrivals over 10 s, 1 ms of work each: W = 0.1 s << M = 10 s
    p = predict_round([Item(0.1 * (i + 1), 0.001) for i in range(100)])
    assert p["sync_s"] == pytest.approx(10.1)
    assert p["stream_s"] == pytest.approx(10.001)
    assert p["speedup"] == pytest.approx(10.1 / 10.001)
    assert p["speedup"] <= p["ceiling"] == pytest.approx((10 + 0.1) / 10)


def test_learner_dominated_bounded_by_work():
    # arrivals 0, 1, 2 s, 3 s of work each: the learner never waits after the first arrival
    p = predict_round(items((0, 3), (1, 3), (2, 3)))
    assert p["sync_s"] == pytest.approx(2 + 9)
    assert p["stream_s"] == pytest.approx(9)
    assert p["speedup"] == pytest.approx(p["ceiling"]) == pytest.approx((2 + 9) / 9)


def test_multiple_learners():
    # two learners. Arrivals 1, 2, 3 with costs 4, 1, 1: A runs [1, 5]; B runs [2, 3] then [3, 4]
    p = predict_round(items((1, 4), (2, 1), (3, 1)), learners=2)
    assert p["stream_s"] == pytest.approx(5)
    assert p["sync_s"] == pytest.approx(3 + 6 / 2)  # lazy batch split evenly over the learners
    assert p["async_s"] == pytest.approx(max(3, 3))
    # four items, two at 0 s and two at 1 s, 2 s each: the late pair waits for a free learner until 2 s
    assert drain_time(items((0, 2), (0, 2), (1, 2), (1, 2)), learners=2) == pytest.approx(4)
    assert predict_round(items((0, 2), (0, 2), (1, 2), (1, 2)), learners=2)["sync_s"] == pytest.approx(1 + 4)


def test_async_steady_state():
    # rollout-bound: the period is the makespan; learner-bound: work/L + step; the weight sync adds to both
    assert predict_round(items((5, 1)), step_s=1, sync_s=0.5)["async_s"] == pytest.approx(5.5)
    assert predict_round(items((1, 5)), step_s=1, sync_s=0.5)["async_s"] == pytest.approx(6.5)


def test_what_if_knobs():
    its = items((1, 2), (2, 2), (6, 2))
    assert [i.finished_at_s for i in what_if(its, spread=0)] == [2, 2, 2]
    assert [i.finished_at_s for i in what_if(its, spread=2)] == [0, 2, 10]  # median 2: 2 + 2*(1-2) = 0
    assert [i.finished_at_s for i in what_if(its, spread=3)] == [0, 2, 14]  # 2 + 3*(1-2) = -1, clipped at 0
    assert [i.finished_at_s for i in what_if(its, tool_speed=2)] == [0.5, 1, 3]
    assert [i.learner_cost_s for i in what_if(its, learner_speed=4)] == [0.5, 0.5, 0.5]
    with pytest.raises(UsageError, match="--tool-speed"):
        what_if(its, tool_speed=0)


def test_minimal_trace_rounds_and_warmup(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"round": r, "finished_at_s": 1.0 * r, "learner_cost_s": 1.0} for r in range(1, 7)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = predict_trace(load_trace(p))
    assert len(doc["rounds"]) == 6 and doc["rounds_counted"] == [5, 6]
    assert doc["sync_s"] == pytest.approx((6 + 7) / 2) and doc["stream_s"] == pytest.approx((6 + 7) / 2)


def _write_run(d, schedule):
    """Two rounds of one run: round 5 as in test_two_arrivals (measured 5.0 s), round 6 the same (4.5 s)."""
    d.mkdir()
    ev, metrics = [], []
    for rnd, measured in ((5, 5.0), (6, 4.5)):
        if schedule == "stream":
            ev += [{"round": rnd, "event": "item", "id": "a", "finished_at_s": 1.0, "backward_start_s": 1.0,
                    "backward_end_s": 3.0, "learner_cost_s": 2.0, "loss_tokens": 10, "staleness": 0},
                   {"round": rnd, "event": "item", "id": "b", "finished_at_s": 3.0, "backward_start_s": 3.0,
                    "backward_end_s": 4.0, "learner_cost_s": 1.0, "loss_tokens": 5, "staleness": 0}]
            t = 4.0
        else:  # one batch backward of 3 s after the last arrival, shared 2:1 by loss_tokens
            ev += [{"round": rnd, "event": "item", "id": "a", "finished_at_s": 1.0, "learner_cost_s": None,
                    "loss_tokens": 10},
                   {"round": rnd, "event": "item", "id": "b", "finished_at_s": 3.0, "learner_cost_s": None,
                    "loss_tokens": 5},
                   {"round": rnd, "event": "batch_backward", "start_s": 3.0, "end_s": 6.0, "items": 2,
                    "loss_tokens": 15}]
            t = 6.0
        ev += [{"round": rnd, "event": "step", "start_s": t, "end_s": t + 0.5},
               {"round": rnd, "event": "weight_sync", "start_s": t + 0.5, "end_s": t + 0.75},
               {"round": rnd, "event": "round_end", "at_s": measured, "learners": 1}]
        metrics.append({"round": rnd, "schedule": schedule, "step_time_s": measured})
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return d


def test_run_dir_compares_with_measured(tmp_path):
    doc = predict_trace(load_trace(_write_run(tmp_path / "run", "stream")))
    assert doc["schedule"] == "stream" and doc["measured_from"] == "metrics.jsonl step_time_s"
    errs = [r["error_pct"] for r in doc["rounds"]]
    assert errs == pytest.approx([100 * (4.75 - 5) / 5, 100 * (4.75 - 4.5) / 4.5])
    assert doc["mean_abs_error_pct"] == pytest.approx((5 + 100 * 0.25 / 4.5) / 2) and doc["error_rows"] == 2


def test_sync_trace_shares_batch_backward_by_loss_tokens(tmp_path):
    trace = load_trace(_write_run(tmp_path / "run", "sync") / "events.jsonl")
    assert [i.learner_cost_s for i in trace.rounds[0].items] == pytest.approx([2.0, 1.0])
    doc = predict_trace(trace)
    assert doc["schedule"] == "sync"
    assert doc["sync_s"] == pytest.approx(6.75) and doc["stream_s"] == pytest.approx(4.75)


def test_what_if_keeps_the_measured_comparison(tmp_path):
    doc = predict_trace(load_trace(_write_run(tmp_path / "run", "stream")), learner_speed=2)
    r = doc["rounds"][0]
    assert r["predicted_s"] == pytest.approx(4.75) and r["as_traced"]["stream_s"] == pytest.approx(4.75)
    assert r["stream_s"] == pytest.approx(3 + 0.5 + 0.75)  # [1, 2] then [3, 3.5]
    assert doc["what_if"] == {"learner_speed": 2}


# ---------------------------------------------------------------------------- CLI


def test_cli_two_line_csv_json(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("finished_at_s,learner_cost_s\n1.0,2.0\n3.0,1.0\n")
    res = runner.invoke(app, ["predict", "--trace", str(p), "--step-s", "0.5", "--sync-s", "0.25", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["sync_s"], doc["stream_s"], doc["async_s"]) == pytest.approx((6.75, 4.75, 3.75))
    assert doc["speedup"] == pytest.approx(6.75 / 4.75) and "rounds" not in doc


def test_cli_human_output_and_help(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("finished_at_s,learner_cost_s\n1.0,2.0\n3.0,1.0\n")
    res = runner.invoke(app, ["predict", "--trace", str(p), "--learners", "2"])
    assert res.exit_code == 0 and "speedup sync/stream" in res.stdout and "learners=2" in res.stdout
    assert runner.invoke(app, ["predict", "--help"]).exit_code == 0


@pytest.mark.parametrize("content,msg", [
    ("finished_at_s\n1.0\n", "trace.csv:2: field 'learner_cost_s': missing"),
    ("finished_at_s,learner_cost_s\n1.0,-2\n", "must be a finite number >= 0"),
    ("finished_at_s,learner_cost_s\n1.0,abc\n", "not a number"),
    ("finished_at_s,learner_cost_s\n", "no rows"),
])
def test_cli_bad_trace_exit_2(tmp_path, content, msg):
    p = tmp_path / "trace.csv"
    p.write_text(content)
    res = runner.invoke(app, ["predict", "--trace", str(p)])
    assert res.exit_code == 2 and msg in res.stderr and len(res.stderr.strip().splitlines()) <= 2


def test_cli_bad_flags_exit_2(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("finished_at_s,learner_cost_s\n1.0,2.0\n")
    assert runner.invoke(app, ["predict", "--trace", str(p), "--learners", "0"]).exit_code == 2
    assert runner.invoke(app, ["predict", "--trace", str(tmp_path / "none.csv")]).exit_code == 2


def test_items_generated_before_the_round_wait_at_its_start():
    """async: data generated ahead has negative finished_at_s; it is queued at t=0 (hand-computed)."""
    from tsrl_cli.predict import Item, predict_round

    p = predict_round([Item(-3.0, 1.0), Item(-1.0, 1.0), Item(2.0, 1.0)])
    assert p["stream_s"] == 3.0  # 0-1, 1-2, then the third arrives at 2 and ends at 3
    assert p["sync_s"] == 2.0 + 3.0  # last arrival 2, then 3 s of work
    q = predict_round([Item(-3.0, 1.0), Item(-1.0, 2.0)])
    assert q["sync_s"] == 3.0 and q["stream_s"] == 3.0  # everything waits at 0: no arrival to overlap


def test_padded_batch_by_hand(tmp_path):
    """A sync round: items of 10, 20, 30 tokens arrive at 1, 2, 3 s; the padded batch (3 x 30 = 90
    positions) took 6 s, so the items' own costs are 6 * T / 90 = 2/3, 4/3, 2 s.
    sync = 3 + 6 + 0.5 = 9.5; stream: [1, 5/3], [2, 10/3], [10/3, 16/3] -> 16/3 + 0.5."""
    ev = [{"round": 1, "event": "item", "id": str(k), "finished_at_s": float(k), "learner_cost_s": None,
           "tokens": 10 * k, "loss_tokens": 5 * k} for k in (1, 2, 3)]
    ev += [{"round": 1, "event": "batch_backward", "start_s": 3.0, "end_s": 9.0, "items": 3, "loss_tokens": 30},
           {"round": 1, "event": "step", "start_s": 9.0, "end_s": 9.5}]
    f = tmp_path / "events.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in ev))
    trace = load_trace(f)
    assert [i.learner_cost_s for i in trace.rounds[0].items] == pytest.approx([2 / 3, 4 / 3, 2.0])
    doc = predict_trace(trace)
    assert doc["sync_s"] == pytest.approx(9.5) and doc["batch_work_s"] == pytest.approx(6.0)
    assert doc["stream_s"] == pytest.approx(16 / 3 + 0.5) and doc["work_s"] == pytest.approx(4.0)
    # the same items priced from a stream trace (costs known, no batch): Wb = 4 * 90 / 60 = 6 again
    p = predict_round([Item(1.0, 2 / 3, 10), Item(2.0, 4 / 3, 20), Item(3.0, 2.0, 30)], step_s=0.5)
    assert p["batch_work_s"] == pytest.approx(6.0) and p["sync_s"] == pytest.approx(9.5)
    # without lengths, the batch is the items' work
    assert predict_round(items((1, 1), (2, 1)))["batch_work_s"] == pytest.approx(2.0)


def test_unpadded_sync_batch_shares_by_real_tokens(tmp_path):
    """sync_batching per_item writes padded: false; its 4 s are the items' own work, split 10:30."""
    ev = [{"round": 1, "event": "item", "id": "a", "finished_at_s": 1.0, "learner_cost_s": None, "tokens": 10},
          {"round": 1, "event": "item", "id": "b", "finished_at_s": 2.0, "learner_cost_s": None, "tokens": 30},
          {"round": 1, "event": "batch_backward", "start_s": 2.0, "end_s": 6.0, "items": 2, "padded": False}]
    f = tmp_path / "events.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in ev))
    doc = predict_trace(load_trace(f))
    assert doc["sync_s"] == pytest.approx(6.0) and doc["stream_s"] == pytest.approx(5.0)  # [1,2], [2,5]


def test_async_uses_the_rollout_duration(tmp_path):
    """Async round: its data was generated from -1.0 to 0.5 s (1.5 s of rollout, started in the
    previous round); batch 0.7 s, step 0.1 s. max(R = 1.5, 0.7 + 0.1) = 1.5, not max(M = 0.5, 0.8)."""
    ev = [{"round": 1, "event": "item", "id": "a", "finished_at_s": -0.2, "learner_cost_s": None, "staleness": 1},
          {"round": 1, "event": "item", "id": "b", "finished_at_s": 0.5, "learner_cost_s": None, "staleness": 1},
          {"round": 1, "event": "rollout", "start_s": -1.0, "end_s": 0.5},
          {"round": 1, "event": "batch_backward", "start_s": 0.5, "end_s": 1.2, "items": 2},
          {"round": 1, "event": "step", "start_s": 1.2, "end_s": 1.3}]
    f = tmp_path / "events.jsonl"
    f.write_text("".join(json.dumps(e) + "\n" for e in ev))
    doc = predict_trace(load_trace(f))
    assert doc["schedule"] == "async" and doc["async_s"] == pytest.approx(1.5)
    assert doc["sync_s"] == pytest.approx(0.5 + 0.7 + 0.1)  # sync/stream still use the last arrival


# ---------------------------------------------------------------------------- OPD: the unit of a backward


def _opd_run(d, unit=None, *, gap=0.5, b_at=2.0, marked=False):
    """A stream OPD round recorded under learner.opd_unit `unit` (None: a config.yaml without the key).

    Trajectory A: turn 0 (rows end at 10) scored at 1.0, turn 1 (end 30) at 3.0, A's end at 3.0 + gap, 30 tokens;
    B: one turn (end 20) scored at b_at, its end at b_at + gap, 20 tokens. Measured turn costs 1, 2, 3 s over
    the learner_work's 10 + 20 + 30 = 60 positions: 0.1 s a position. Step 0.5 s, weight sync 0.25 s.
    marked: A1 and B0 carry `last` (the rollout knew as they closed that no turn follows)."""
    d.mkdir()
    ev = []
    for gid, i, k, end, tok, at, cost in (("A", 0, 0, 10, 5, 1.0, 1.0), ("B", 0, 0, 20, 6, b_at, 2.0),
                                         ("A", 0, 1, 30, 8, 3.0, 3.0)):
        ev.append({"round": 1, "event": "item", "id": f"{gid}/{i}/t{k}", "group_id": gid, "sample_index": i,
                   "turn": k, "finished_at_s": at, "learner_cost_s": cost, "tokens": tok, "loss_tokens": tok,
                   "staleness": 0, "prefix_tokens": end, "last": marked and (gid, k) in (("A", 1), ("B", 0))})
    ev += [{"round": 1, "event": "trajectory", "id": "A/0", "group_id": "A", "sample_index": 0,
            "finished_at_s": 3.0 + gap, "tokens": 30},
           {"round": 1, "event": "trajectory", "id": "B/0", "group_id": "B", "sample_index": 0,
            "finished_at_s": b_at + gap, "tokens": 20},
           {"round": 1, "event": "learner_work", "positions": 60, "trajectory_tokens": 50, "padded_tokens": 60},
           {"round": 1, "event": "step", "start_s": 7.0, "end_s": 7.5},
           {"round": 1, "event": "weight_sync", "start_s": 7.5, "end_s": 7.75},
           {"round": 1, "event": "round_end", "at_s": 7.75, "learners": 1}]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (d / "metrics.jsonl").write_text(json.dumps({"round": 1, "schedule": "stream", "step_time_s": 7.75}) + "\n")
    (d / "config.yaml").write_text("name: x\nobjective: opd\n" + (f"learner:\n  opd_unit: {unit}\n" if unit else ""))
    return d


def test_opd_units_priced_by_hand(tmp_path):
    """Per position (0.1 s): turn  A0 [1, 2], B0 [2, 4], A1 [4, 7] -> 7 + 0.75; 60 positions.
    trajectory  B at its end 2.5: [2.5, 4.5]; A at 3.5 (row 30: 3 s): [4.5, 7.5] -> 8.25; 50 positions.
    The lazy batch: 2 x 30 = 60 positions (6 s): sync = last arrival 3 + 6 + 0.75 = 9.75.
    Here the turn unit wins: its last backwards start at the last turns' scores, before the ends."""
    trace = load_trace(_opd_run(tmp_path / "run"))
    assert trace.opd_unit == "turn"  # a config.yaml written before the key: the run backwarded turns
    assert [i.positions for i in trace.rounds[0].items] == [10, 20, 30]  # prefix_tokens: the turn's end
    doc = predict_trace(trace)
    u = doc["opd_units"]
    assert u["per_position_s"] == pytest.approx(0.1) and (u["lazy_positions"], u["trajectory_tokens"]) == (60, 50)
    assert (u["turn"]["stream_s"], u["turn"]["positions"]) == (pytest.approx(7.75), 60)
    assert (u["trajectory"]["stream_s"], u["trajectory"]["positions"]) == (pytest.approx(8.25), 50)
    assert u["best"] == "turn" and u["turn"]["positions_over_lazy"] == pytest.approx(1.0)
    assert doc["stream_s"] == pytest.approx(7.75) and doc["sync_s"] == pytest.approx(9.75)
    assert doc["batch_work_s"] == pytest.approx(6.0) and doc["mean_abs_error_pct"] == pytest.approx(0.0)
    what = predict_trace(trace, opd_unit="trajectory")  # the other unit: a what-if, the error stays as traced
    assert what["what_if"] == {"opd_unit": "trajectory"} and what["stream_s"] == pytest.approx(8.25)
    assert what["opd_unit"] == "trajectory" and what["mean_abs_error_pct"] == pytest.approx(0.0)
    assert predict_trace(trace, opd_unit="turn")["what_if"] == {}  # the run's own unit is no what-if


def test_opd_trajectory_unit_wins_when_the_learner_lags(tmp_path):
    """B scored at 0.5, ends at once (gap 0): turn  B0 [0.5, 2.5], A0 queued [2.5, 3.5], A1 [3.5, 6.5] -> 7.25;
    trajectory  B [0.5, 2.5], A at 3.0 [3.0, 6.0] -> 6.75: A0's backward was pure extra work."""
    u = predict_trace(load_trace(_opd_run(tmp_path / "run", gap=0.0, b_at=0.5)))["opd_units"]
    assert u["turn"]["stream_s"] == pytest.approx(7.25) and u["trajectory"]["stream_s"] == pytest.approx(6.75)
    assert u["best"] == "trajectory"


def test_opd_turns_marked_last_start_the_trajectory_row_at_their_scores(tmp_path):
    """The same round with A1 and B0 marked last: trajectory  B at its last turn's scores 2.0: [2.0, 4.0]; A at 3.0:
    [4.0, 7.0] -> 7.75, the turn unit's time with 50 positions instead of 60 (unmarked: 8.25, the test above)."""
    trace = load_trace(_opd_run(tmp_path / "run", marked=True))
    assert [i.last for i in trace.rounds[0].items] == [False, True, True]
    u = predict_trace(trace)["opd_units"]
    assert (u["trajectory"]["stream_s"], u["trajectory"]["positions"]) == (pytest.approx(7.75), 50)
    assert u["turn"]["stream_s"] == pytest.approx(7.75)


def test_opd_trajectory_run_is_drained_per_trajectory(tmp_path):
    """Recorded under the trajectory unit: each trajectory one backward at its end, costing its turns' measured
    costs summed (their shares of its row): B 2 s at 2.5 -> [2.5, 4.5]; A 1 + 3 s at 3.5 -> [4.5, 8.5] -> 9.25."""
    trace = load_trace(_opd_run(tmp_path / "run", "trajectory"))
    assert trace.opd_unit == "trajectory"
    doc = predict_trace(trace)
    assert doc["opd_unit"] == "trajectory" and doc["stream_s"] == pytest.approx(9.25)
    assert doc["work_s"] == pytest.approx(6.0)


def test_cli_opd_unit(tmp_path):
    d = _opd_run(tmp_path / "run")
    res = runner.invoke(app, ["predict", "--trace", str(d), "--opd-unit", "trajectory"])
    assert res.exit_code == 0, res.output
    assert "OPD units" in res.stdout and "opd_unit=trajectory" in res.stdout and "turn (best)" in res.stdout
    res = runner.invoke(app, ["predict", "--trace", str(d), "--opd-unit", "turns"])
    assert res.exit_code == 2 and "--opd-unit 'turns' is unknown" in res.stderr
    p = tmp_path / "trace.csv"
    p.write_text("finished_at_s,learner_cost_s\n1.0,2.0\n")
    res = runner.invoke(app, ["predict", "--trace", str(p), "--opd-unit", "turn"])
    assert res.exit_code == 2 and "no OPD turns" in res.stderr


def test_the_one_learner_drain_is_the_general_one_step_for_step():
    """_drain_one (tsrl calibrate's fit calls it ~500,000 times) against _drain_many on one learner: the same
    end time and backward costs, bit for bit, on random rounds (ties, turns of one trajectory, slowdown,
    per-backward cost, coalescing on and off). Positive control: the comparison sees coalescing switched off."""
    import random

    from tsrl_cli.predict import _drain_many, _drain_one

    rng = random.Random(0)
    differs = 0
    for _ in range(3000):
        trajs = [None] if rng.random() < 0.3 else [f"t{i}" for i in range(rng.randint(1, 6))]
        jobs = [(rng.choice([rng.uniform(0, 5), float(rng.randint(0, 4))]), rng.uniform(1e-3, 0.5), rng.choice(trajs))
                for _ in range(rng.randint(0, 30))]
        slow, per = rng.choice([0.0, rng.random()]), rng.choice([0.0, 0.01 * rng.random()])
        coalesce = rng.random() < 0.7
        ca, cb = [], []
        assert (_drain_one(jobs, slow, per, coalesce, ca), ca) == (_drain_many(jobs, 1, slow, per, coalesce, cb), cb)
        differs += _drain_one(jobs, slow, per, True) != _drain_many(jobs, 1, slow, per, False)
    assert differs > 100


# ---- granularity: per trajectory or per group; the within-group arrival correlation ---------------------
def test_group_granularity_waits_for_each_groups_last_arrival():
    # two groups; g1's members arrive at 1 and 5, g2's at 2 and 3; each backward costs 1 s, one learner
    items = [Item(1.0, 1.0, group="g1"), Item(2.0, 1.0, group="g2"), Item(3.0, 1.0, group="g2"),
             Item(5.0, 1.0, group="g1")]
    r = predict_round(items)
    assert r["stream_s"] == pytest.approx(6.0)  # per trajectory: 1-2, 2-3, 3-4, 5-6
    # per group: g2 released at 3 (3-4, 4-5), g1 released at 5 (5-6, 6-7)
    assert r["stream_group_s"] == pytest.approx(7.0)
    assert r["speedup_group"] == pytest.approx(r["sync_s"] / 7.0)
    assert predict_round([Item(1.0, 1.0), Item(2.0, 1.0)])["stream_group_s"] is None  # no groups: not predicted


def test_arrival_icc_by_hand():
    from tsrl_cli.predict import arrival_icc

    # two groups of two: means 1 and 5 (grand 3), each spread +-1: MSB = 2 * 2 * 4 / 1 = 16, MSW = 4 / 2 = 2
    # ICC = (16 - 2) / (16 + (2 - 1) * 2) = 14 / 18
    items = [Item(0.0, 1.0, group="a"), Item(2.0, 1.0, group="a"), Item(4.0, 1.0, group="b"), Item(6.0, 1.0, group="b")]
    assert arrival_icc(items) == pytest.approx(14 / 18)
    together = [Item(t, 1.0, group=g) for g, t in (("a", 1.0), ("a", 1.0), ("b", 5.0), ("b", 5.0))]
    assert arrival_icc(together) == pytest.approx(1.0)  # a group's members arrive at once
    assert arrival_icc(items[:2]) is None  # one group: nothing to correlate


def test_minimal_trace_with_groups_reports_both_granularities(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("finished_at_s,learner_cost_s,group_id\n1,1,g1\n2,1,g2\n3,1,g2\n5,1,g1\n")
    doc = predict_trace(load_trace(p), warmup=0)
    assert doc["stream_s"] == pytest.approx(6.0) and doc["stream_group_s"] == pytest.approx(7.0)
    assert doc["arrival_icc"] is not None and doc["speedup_group"] < doc["speedup"]
