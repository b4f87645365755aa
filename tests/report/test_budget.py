"""The fixed-budget table and figure on hand-made runs: each row's arm read from its config.yaml, one
budget for the experiments of one workload, reward at the budget and the stream gap derived by hand."""

import json

import pytest
from report_helpers import build, markdown_cells, read_csv

from tsrl_cli.report.tables import arm_label


def write_run(root, exp, sched, seed, wall_per_round, reward_per_round, tis=None, sigma=0.5, offpolicy=True):
    """10 rounds: wall_s = wall_per_round * k, reward_mean = reward_per_round * k (+ 0.02 on seed 2 of stream)."""
    d = root / exp / sched / f"seed{seed}"
    d.mkdir(parents=True)
    off = f"offpolicy:\n  max_staleness: 1\n  tis_cap: {'null' if tis is None else tis}\n" if offpolicy else ""
    (d / "config.yaml").write_text(f"name: {exp}\nobjective: grpo\nschedule: {sched}\nseed: {seed}\nrounds: 10\n"
                                   f"model:\n  policy: builtin:toy\ndata:\n  train: [builtin:echo]\n"
                                   f"rollout:\n  tool_latency_sigma: {sigma}\n{off}"
                                   f"run:\n  out: {d}\ndevices:\n  rollout: cpu\n  learner: cpu\n  teacher: null\n")
    bump = 0.02 if (sched, seed) == ("stream", 2) else 0.0
    rows = [{"round": k, "wall_s": wall_per_round * k, "reward_mean": reward_per_round * k + bump}
            for k in range(1, 11)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "DONE").write_text("{}")


@pytest.fixture(scope="module")
def budget_report(tmp_path_factory):
    """a: stream and async without TIS; b: async with TIS cap 2.0, the same workload (only name and
    offpolicy differ); c: another workload (sigma 1.0), stream only. 2 cpu devices each."""
    root = tmp_path_factory.mktemp("budget") / "r"
    for seed in (1, 2):
        write_run(root, "a", "stream", seed, 10.0, 0.1)  # device_s 20 k: ends at 200
        write_run(root, "a", "async", seed, 5.0, 0.02)  # 10 k: ends at 100, the group's smallest
        write_run(root, "b", "async", seed, 6.0, 0.05, tis=2.0)  # 12 k: ends at 120
    write_run(root, "c", "stream", 1, 3.0, 0.1, sigma=1.0)  # its own budget: 60
    out = root.parent / "out"
    return out, build(root, out)


def test_arms_budget_and_gap_by_hand(budget_report):
    out, _ = budget_report
    rows = {(r["experiment"], r["schedule"]): r for r in read_csv(out / "tables" / "reward_at_budget.csv")}
    assert list(rows) == [("a", "stream"), ("a", "async"), ("b", "async"), ("c", "stream")]
    assert [r["arm"] for r in rows.values()] == ["stream", "async, no TIS", "async, TIS cap 2.0", "stream"]
    assert [r["budget_group"] for r in rows.values()] == ["a + b", "a + b", "a + b", "c"]
    assert [float(r["budget_device_s"]) for r in rows.values()] == [100.0, 100.0, 100.0, 60.0]
    # the last round within 100 device-s, then the mean of its last 5 rounds' reward
    stream = rows["a", "stream"]  # round 5: mean(0.1 .. 0.5) = 0.3; seed 2 0.32
    assert stream["rounds_at_budget"] == "5 5" and float(stream["reward_mean"]) == pytest.approx(0.31)
    no_tis = rows["a", "async"]  # round 10: mean(0.02 * 6 .. 0.02 * 10) = 0.16
    assert no_tis["rounds_at_budget"] == "10 10" and float(no_tis["reward_mean"]) == pytest.approx(0.16)
    tis = rows["b", "async"]  # round 8 (96 <= 100 < 108): mean(0.05 * 4 .. 0.05 * 8) = 0.3
    assert tis["rounds_at_budget"] == "8 8" and float(tis["reward_mean"]) == pytest.approx(0.30)
    # stream - arm per seed, x 100: no TIS 14 and 16, TIS 0 and 2; b has no stream: the group's (a's)
    assert float(no_tis["gap_points_mean"]) == pytest.approx(15.0)
    assert float(no_tis["gap_points_std"]) == pytest.approx(2 ** 0.5)
    assert float(tis["gap_points_mean"]) == pytest.approx(1.0) and tis["vs_stream_experiment"] == "a"
    assert stream["gap_points_mean"] == "" and rows["c", "stream"]["rounds_at_budget"] == "10"


def test_budget_markdown_figure_and_claim(budget_report):
    out, doc = budget_report
    header, *body = markdown_cells((out / "tables" / "reward_at_budget.md").read_text())
    assert header == ["experiment · schedule", "arm (config.yaml)", "budget device-hours (cpu)",
                      "rounds within budget", "reward at budget", "stream − arm, points"]
    assert [r[1] for r in body] == ["stream", "async, no TIS", "async, TIS cap 2.0", "stream"]
    assert body[1][5].startswith("15 ± 1.4")
    curve = read_csv(out / "figures" / "reward_vs_device_s.csv")
    assert {r["budget_group"] for r in curve} == {"a + b"}  # c has one arm: no comparison to draw
    at = [r for r in curve if r["what"] == "at budget"]
    assert [(r["arm"], float(r["device_s"])) for r in at] == [("stream", 100.0), ("async, no TIS", 100.0),
                                                             ("async, TIS cap 2.0", 100.0)]
    means = [r for r in curve if r["what"] == "mean" and r["schedule"] == "stream"]
    assert [int(r["round"]) for r in means] == list(range(5, 11))  # full 5-round windows only
    assert float(means[0]["device_s"]) == 100.0 and float(means[0]["reward"]) == pytest.approx(0.31)
    assert str(out / "figures" / "reward_vs_device_s.png") in doc["figures"]
    md = (out / "REPORT.md").read_text()
    assert ("a + b: stream 0.31 vs async, no TIS 0.16 (+15 percentage points of reward), async, TIS cap 2.0 0.3 "
            "(+1 percentage points of reward) at 0.0278 device-hours (cpu)") in md


def test_arm_label_reads_the_config():
    assert arm_label("stream", {"offpolicy": {"tis_cap": 2.0}}) == "stream"  # TIS is async-only
    assert arm_label("async", {"offpolicy": {"tis_cap": 2.0}}) == "async, TIS cap 2.0"
    assert arm_label("async", {"offpolicy": {"tis_cap": None}}) == "async, no TIS"
    assert arm_label("async", {}) == "async, TIS not in config.yaml"
