"""What each schedule trains on (tsrl_cli/report/bias.py): the table on a tree written here, every expected
number worked out by hand from the rows below, and on the committed runs.

The tree (GRPO unless said):
- audit/sync/seed1: a run written before `sampled` rows and item `turns`/`exit` existed. 2 rounds x 4
  trajectories; its learner rows account for metrics' tally, so the sampled distribution is derived.
- audit/async/seed1: 3 rounds x 2 trajectories with `sampled` rows; round 1 at staleness 0, rounds 2-3 at 1;
  one trajectory cut by wall_clock, one by token_limit.
- audit/stream/seed1: the run with cut trajectories. Round 1 sampled 4, one never reached the learner;
  round 2 sampled 2, reached the learner, but the round has no step. loss.max_open_groups 1, one item deferred.
- mismatch/sync/seed1: learner rows that do not account for the tally (the positive control of the derivation).
- opd/stream/seed1: an OPD run of the older format: turn items only, turns = their count.
"""

import json
import math

import pytest
from report_helpers import build, read_csv

from tsrl_cli.report import bias
from tsrl_cli.report.load import load_results


def write_run(d, schedule, metrics, events, objective="grpo", max_open_groups=None):
    d.mkdir(parents=True)
    cap = "null" if max_open_groups is None else max_open_groups
    (d / "config.yaml").write_text(f"name: {d.parent.parent.name}\nobjective: {objective}\nschedule: {schedule}\n"
                                   f"seed: 1\nloss:\n  max_open_groups: {cap}\n"
                                   "devices:\n  rollout: cpu\n  learner: cpu\n  teacher: null\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"round": k, "schedule": schedule, "objective": objective,
                                                         "seed": 1, "step_time_s": 2.0, **m}) + "\n"
                                             for k, m in enumerate(metrics, 1)))
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (d / "DONE").write_text("{}")


def item(k, gid, i, tokens, fin, back, staleness=0, **extra):
    return {"round": k, "event": "item", "id": f"{gid}/{i}", "group_id": gid, "sample_index": i, "turn": None,
            "finished_at_s": fin, "backward_start_s": back, "backward_end_s": back + 0.1, "learner_cost_s": None,
            "tokens": tokens, "loss_tokens": tokens // 10, "staleness": staleness, "reward": 0.5, **extra}


def frame_events(k, rollout, at_s, step=True):
    ev = [{"round": k, "event": "rollout", "start_s": rollout[0], "end_s": rollout[1]},
          {"round": k, "event": "round_end", "at_s": at_s, "learners": 1}]
    return ev + ([{"round": k, "event": "step", "start_s": at_s - 0.2, "end_s": at_s - 0.1}] if step else [])


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("bias")
    # sync: round 1 tasks t/a x2, t/b x2; round 2 t/a drawn twice (groups t/a and t/a#2)
    ev = [item(1, "t/a", 0, 100, 0.2, 1.2), item(1, "t/a", 1, 200, 0.4, 1.2), item(1, "t/b", 0, 300, 0.6, 1.2),
          item(1, "t/b", 1, 400, 1.0, 1.2), *frame_events(1, (0.0, 1.0), 2.0),
          item(2, "t/a", 0, 150, 0.6, 1.0), item(2, "t/a", 1, 250, 0.7, 1.0), item(2, "t/a#2", 0, 350, 0.8, 1.0),
          item(2, "t/a#2", 1, 450, 0.9, 1.0), *frame_events(2, (0.5, 0.9), 2.0)]
    tally = {"turns_mean": 2.0, "exit_reasons": {"submitted": 3, "max_turns": 1}, "trajectories": 4}
    write_run(root / "audit" / "sync" / "seed1", "sync", [{**tally, "tokens": 1000}, {**tally, "tokens": 1200}], ev)
    # async: rollouts of rounds 2 and 3 start before their round (start_s < 0)
    ev, metrics = [], []
    rounds = [((0.0, 1.0), 2.0, [(90, 1, "submitted"), (110, 2, "submitted")], 0),
              ((-0.5, 0.1), 1.0, [(120, 3, "wall_clock"), (80, 4, "submitted")], 1),
              ((-0.2, 0.3), 1.5, [(300, 2, "token_limit"), (100, 2, "submitted")], 1)]
    for k, (ro, at, trajs, stale) in enumerate(rounds, 1):
        ev += [item(k, "t/a", i, tok, 0.1 * i, 0.5, stale, turns=n, exit=x) for i, (tok, n, x) in enumerate(trajs)]
        ev.append({"round": k, "event": "sampled", "tasks": {"t/a": 2}, "tokens": [t[0] for t in trajs],
                   "turns": [t[1] for t in trajs]})
        ev += frame_events(k, ro, at)
        exits = {}
        for _, _, x in trajs:
            exits[x] = exits.get(x, 0) + 1
        metrics.append({"trajectories": 2, "tokens": sum(t[0] for t in trajs),
                        "turns_mean": sum(t[1] for t in trajs) / 2, "exit_reasons": exits})
    write_run(root / "audit" / "async" / "seed1", "async", metrics, ev)
    # stream: round 1 sampled 4, t/a/1 (200 tokens) never reached the learner; round 2 has no step
    ev = [item(1, "t/a", 0, 100, 0.1, 0.1, turns=1, exit="submitted", deferred=False),
          item(1, "t/b", 0, 300, 0.2, 0.5, turns=2, exit="wall_clock", deferred=True),
          item(1, "t/b", 1, 400, 0.3, 0.5, turns=2, exit="submitted", deferred=False),
          {"round": 1, "event": "sampled", "tasks": {"t/a": 2, "t/b": 2}, "tokens": [100, 200, 300, 400],
           "turns": [1, 1, 2, 2]}, *frame_events(1, (0.0, 0.4), 1.0),
          item(2, "t/a", 0, 500, 0.1, 0.2, turns=3, exit="submitted", deferred=False),
          item(2, "t/a", 1, 600, 0.2, 0.3, turns=3, exit="submitted", deferred=False),
          {"round": 2, "event": "sampled", "tasks": {"t/a": 2}, "tokens": [500, 600], "turns": [3, 3]},
          *frame_events(2, (0.0, 0.3), 1.0, step=False)]
    tally = [{"trajectories": 4, "tokens": 1000, "turns_mean": 1.5, "exit_reasons": {"submitted": 3, "wall_clock": 1}},
             {"trajectories": 2, "tokens": 1100, "turns_mean": 3.0, "exit_reasons": {"submitted": 2}}]
    write_run(root / "audit" / "stream" / "seed1", "stream", tally, ev, max_open_groups=1)
    # mismatch: the tally says 1001 tokens, the learner rows 1000: nothing is derived from them
    ev = [item(1, "t/a", i, tok, 0.1, 0.5) for i, tok in enumerate((100, 200, 300, 400))] + frame_events(1, (0, 1), 2.0)
    write_run(root / "mismatch" / "sync" / "seed1", "sync",
              [{"trajectories": 4, "tokens": 1001, "turns_mean": 1.0, "exit_reasons": {"submitted": 4}}], ev)
    # OPD, older format: trajectory t/a/0 has 3 turn rows, t/a/1 one; learner_work sums their tokens
    ev = [{**item(1, "t/a", 0, 20, 0.1 * j, 0.1 * j + 0.05), "id": f"t/a/0/t{j}", "turn": j} for j in range(3)]
    ev += [{**item(1, "t/a", 1, 30, 0.2, 0.3), "id": "t/a/1/t0", "turn": 0}, *frame_events(1, (0, 0.5), 1.0),
           {"round": 1, "event": "learner_work", "trajectory_tokens": 500}]
    write_run(root / "opd" / "stream" / "seed1", "stream",
              [{"trajectories": 2, "tokens": 500, "turns_mean": 2.0, "exit_reasons": {"submitted": 2}}], ev, "opd")
    return root


@pytest.fixture(scope="module")
def audit(tree):
    table, tasks, fig = bias.bias_table(load_results(tree))
    return {(r["experiment"], r["schedule"]): r for r in table.records()}, tasks, fig, table


def test_sync_of_the_older_format_derives_what_it_sampled(audit):
    r = audit[0][("audit", "sync")]
    assert (r["sampled"], r["trained"], r["trained_pct"], r["not_trained"]) == (8, 8, 100.0, 0)
    assert r["sampled_source"] == "derived"
    assert r["tokens_sampled_mean"] == r["tokens_trained_mean"] == 2200 / 8
    # p90 of 100, 150, ..., 450 (linear between order statistics): position 0.9 * 7 = 6.3 -> 400 + 0.3 * 50
    assert r["tokens_sampled_p90"] == pytest.approx(415.0) and r["tokens_trained_p90"] == pytest.approx(415.0)
    assert r["turns_sampled_mean"] == 2.0 and r["turns_trained_mean"] is None  # item rows without `turns`
    assert (r["tasks"], r["task_trained_pct_min"]) == (2, 100.0)  # t/a#2 is task t/a
    assert r["staleness_shares"] == "0: 100 %" and r["staleness_max"] == 0
    assert r["cut_short_sampled_pct"] == 25.0 and r["cut_short_by"] == "max_turns 25 %"
    assert r["wait_s_mean"] == pytest.approx((1.0 + 0.8 + 0.6 + 0.2 + 0.4 + 0.3 + 0.2 + 0.1) / 8)
    assert r["rollout_wait_s_mean"] == pytest.approx(2.0 + 0.5 - 1.0)  # round 2 starts at 2.0, its rollout 0.5 later
    tasks = audit[1]
    got = tasks[(tasks["experiment"] == "audit") & (tasks["schedule"] == "sync")]
    assert dict(zip(got["task"], got["sampled"], strict=True)) == {"t/a": 6, "t/b": 2}


def test_async_staleness_and_cuts(audit):
    r = audit[0][("audit", "async")]
    assert (r["sampled"], r["trained"], r["sampled_source"]) == (6, 6, "rollout")
    assert r["staleness_shares"] == "0: 33.3 %, 1: 66.7 %"
    assert r["staleness_mean"] == pytest.approx(4 / 6) and r["staleness_max"] == 1
    assert r["cut_short_sampled_pct"] == pytest.approx(100 * 2 / 6) == r["cut_short_trained_pct"]
    assert r["cut_short_by"] == "token_limit 16.7 %, wall_clock 16.7 %"
    assert r["turns_sampled_mean"] == r["turns_trained_mean"] == pytest.approx(14 / 6)
    assert r["tokens_sampled_mean"] == r["tokens_trained_mean"] == pytest.approx(800 / 6)
    # round 2's rollout starts 0.5 s before it (abs 1.5), round 1's ended at 1.0; round 3: 3.0 - 0.2 - 2.1
    assert r["rollout_wait_s_mean"] == pytest.approx((0.5 + 0.7) / 2)


def test_cut_trajectories_are_counted(audit):
    """The stream run: one trajectory of round 1 never reached the learner, round 2 had no step."""
    r = audit[0][("audit", "stream")]
    assert (r["sampled"], r["trained"], r["not_trained"], r["rounds_without_step"]) == (6, 3, 3, 1)
    assert r["trained_pct"] == 50.0
    assert r["tokens_sampled_mean"] == pytest.approx(2100 / 6)  # 100 ... 600
    assert r["tokens_trained_mean"] == pytest.approx(800 / 3)  # 100, 300, 400: the sampled 200 is missing
    assert r["turns_sampled_mean"] == pytest.approx(12 / 6) and r["turns_trained_mean"] == pytest.approx(5 / 3)
    tasks = audit[1]
    got = tasks[(tasks["experiment"] == "audit") & (tasks["schedule"] == "stream")]
    assert dict(zip(got["task"], got["trained_pct"], strict=True)) == {"t/a": 25.0, "t/b": 100.0}  # t/a: 1 of 4
    assert r["task_trained_pct_min"] == 25.0
    assert (r["deferred"], r["max_open_groups"]) == (1, 1)
    assert r["cut_short_trained_pct"] == pytest.approx(100 / 3)  # t/b/0 ended at wall_clock


def test_a_tally_the_learner_rows_do_not_match_derives_nothing(audit):
    """Positive control of the derivation: one token off, and the sampled distribution is not recorded."""
    r = audit[0][("mismatch", "sync")]
    assert r["sampled_source"] == "tally" and r["sampled"] == 4 == r["trained"]
    assert r["tokens_sampled_mean"] == pytest.approx(1001 / 4) and r["tokens_trained_mean"] == 250.0
    assert r["tokens_sampled_p90"] is None and r["tokens_trained_p90"] == pytest.approx(370.0)
    assert r["tasks"] is None
    row = {h: f(r) for h, f in audit[3].md}
    assert row["tasks: least share trained"] == bias.NOT_RECORDED
    assert row["tokens/trajectory sampled → trained, mean (p90)"] == "250 → 250 (p90 not recorded → 370)"


def test_opd_of_the_older_format_counts_turn_rows(audit):
    r = audit[0][("opd", "stream")]
    assert (r["sampled"], r["trained"], r["sampled_source"]) == (2, 2, "derived")
    assert r["turns_trained_mean"] == 2.0 and r["tokens_trained_mean"] == 250.0  # learner_work's 500 over 2
    assert r["tokens_trained_p90"] is None  # per-trajectory tokens: not recorded in turn rows
    assert r["deferred"] is None and r["max_open_groups"] is None


def test_figure_rows(audit):
    """Each distribution's shares sum to 1; sampled bins only where its distribution was recorded; the token
    bins are shared by every schedule."""
    fig = audit[2]
    bins = fig[fig["kind"] == "bin"]
    for _, g in bins.groupby(["schedule", "quantity", "set"]):
        assert g["share"].sum() == pytest.approx(1.0)
    stream = bins[(bins["schedule"] == "stream") & (bins["quantity"] == "turns")]
    assert set(stream["set"]) == {"sampled", "trained"}
    stale = bins[(bins["schedule"] == "async") & (bins["quantity"] == "staleness")]
    assert dict(zip(stale["low"], stale["share"], strict=True)) == pytest.approx({0: 2 / 6, 1: 4 / 6})
    tokens = bins[bins["quantity"] == "tokens"]
    assert len({(a, b) for a, b in zip(tokens["low"], tokens["high"], strict=True)}) == bias.TOKEN_BINS
    mean = fig[(fig["kind"] == "mean") & (fig["schedule"] == "async") & (fig["quantity"] == "tokens")]
    assert dict(zip(mean["set"], mean["value"], strict=True)) == pytest.approx({"sampled": 800 / 6, "trained": 800 / 6})


@pytest.mark.slow
def test_report_writes_the_table_and_figure(tree, tmp_path):
    doc = build(tree, tmp_path / "r")
    out = tmp_path / "r"
    assert (out / "figures" / "trained_vs_sampled.png").is_file()
    assert "### What each schedule trains on" in (out / "REPORT.md").read_text()
    rows = read_csv(out / "tables" / "trained_vs_sampled.csv")
    assert {(r["experiment"], r["schedule"]) for r in rows} == {
        ("audit", "sync"), ("audit", "stream"), ("audit", "async"), ("mismatch", "sync"), ("opd", "stream")}
    assert str(out / "figures" / "trained_vs_sampled.png") in doc["figures"]


def test_task_of():
    assert bias.task_of("embedded_repair/x-1#2") == "embedded_repair/x-1" == bias.task_of("embedded_repair/x-1")
    assert bias.task_of("a#b") == "a#b"  # only a numeric copy suffix is the plan's


def _cells(out):
    return {(r["experiment"], r["schedule"]): r for r in read_csv(out / "tables" / "trained_vs_sampled.csv")}


def test_committed_sync_and_stream_train_on_everything_at_staleness_0(built_committed):
    rows = _cells(built_committed[0])
    assert rows and {s for _, s in rows} == {"sync", "stream"}
    for r in rows.values():
        assert r["sampled"] == r["trained"] and float(r["trained_pct"]) == 100.0
        assert r["staleness_shares"] == "0: 100 %" and r["sampled_source"] == "derived"
        assert float(r["task_trained_pct_min"]) == 100.0
        assert math.isclose(float(r["tokens_sampled_mean"]), float(r["tokens_trained_mean"]), rel_tol=1e-12)


def test_committed_async_trains_on_the_previous_weights(built_budget):
    """30 rounds, max_staleness 1: round 1 at staleness 0, every later round at 1."""
    rows = _cells(built_budget[0])
    for (exp, sched), r in rows.items():
        assert r["sampled"] == r["trained"] == "2880"
        share = "0: 100 %" if sched == "stream" else "0: 3.33 %, 1: 96.7 %"
        assert r["staleness_shares"] == share, (exp, sched)
