"""`tsrl bench speedup --balance auto` (rl/bench.py balance): the latency where a line through two calibration runs'
makespans meets the learner's measured work, checked on given measurements; the real runs are in
tests/rl/test_train.py."""

from __future__ import annotations

import pytest

from tsrl_cli.config import load_config
from tsrl_cli.errors import UsageError
from tsrl_cli.rl import bench


def fake(points):
    """A _calibrate answering each latency with the given (makespan, learner busy) seconds, recording the calls."""
    calls = []

    def run(base, latency, run_dir, progress):
        calls.append((latency, base.rounds, run_dir.name))
        m, w = points[latency]
        return {"tool_latency_median_s": latency, "rollout_makespan_s": m, "learner_busy_s": w}
    return run, calls


def test_the_latency_where_makespan_meets_the_learner_work(monkeypatch, tmp_path):
    base = load_config("experiments/smoke/tiny_cpu.yaml", ["rollout.tool_latency_median_s=0.8"])
    run, calls = fake({0.0: (2.0, 5.9), 0.8: (4.0, 6.1)})  # makespan 2 + 2.5 L; work 6.0
    monkeypatch.setattr(bench, "_calibrate", run)
    got = bench.balance(base, tmp_path)
    assert [c[0] for c in calls] == [0.0, 0.8] and [c[2] for c in calls] == ["latency-0", "latency-0.8"]
    assert got["tool_latency_median_s"] == pytest.approx((6.0 - 2.0) / 2.5)  # 1.6 s: 2 + 2.5 x 1.6 = 6
    assert (got["generation_s"], got["makespan_per_latency_s"], got["learner_work_s"]) == pytest.approx((2, 2.5, 6))


def test_no_latency_in_the_config_calibrates_at_half_a_second(monkeypatch, tmp_path):
    base = load_config("experiments/smoke/tiny_cpu.yaml")
    run, calls = fake({0.0: (1.0, 3.0), 0.5: (2.0, 3.0)})
    monkeypatch.setattr(bench, "_calibrate", run)
    assert bench.balance(base, tmp_path)["tool_latency_median_s"] == pytest.approx(1.0)
    assert [c[0] for c in calls] == [0.0, 0.5]


@pytest.mark.parametrize("points,msg", [({0.0: (3.0, 2.0), 0.5: (4.0, 2.0)}, "below the rollout's generation"),
                                        ({0.0: (3.0, 5.0), 0.5: (2.9, 5.0)}, "did not grow")])
def test_what_latency_cannot_balance_is_an_error(monkeypatch, tmp_path, points, msg):
    monkeypatch.setattr(bench, "_calibrate", fake(points)[0])
    with pytest.raises(UsageError, match=msg):
        bench.balance(load_config("experiments/smoke/tiny_cpu.yaml"), tmp_path)
