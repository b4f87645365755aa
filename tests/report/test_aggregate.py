"""The warm-up-aware aggregation on hand-made numbers."""

import math

import pandas as pd
import pytest

from tsrl_cli.report.aggregate import aggregate, over_seeds, per_seed, seed_value, t_quantile_975

WARMUP_NOISE = 1000.0  # rounds 1-4 carry a value that would wreck every mean if it were counted


def rounds(*post_warmup, start=5):
    d = {r: WARMUP_NOISE for r in range(1, 5)}
    d.update({start + i: v for i, v in enumerate(post_warmup)})
    return d


def frame(by_seed, experiment="e", schedule="stream", key="x"):
    """{seed: {round: value}} -> the tidy frame of rounds that report/load.py makes."""
    return pd.DataFrame([{"experiment": experiment, "schedule": schedule, "seed": s, "round": r, key: v}
                         for s, rs in by_seed.items() for r, v in rs.items()])


def one(by_seed, **kw):
    (row,) = aggregate(frame(by_seed), "x", **kw).to_dict("records")
    return row


def test_warmup_excluded_per_seed_mean_then_over_seeds():
    # per seed, rounds 5-6: (2+4)/2 = 3, (4+6)/2 = 5, (6+8)/2 = 7 -> mean 5, std 2 (n-1)
    s = one({42: rounds(2, 4), 43: rounds(4, 6), 44: rounds(6, 8)})
    assert s["x_mean"] == pytest.approx(5.0) and s["x_std"] == pytest.approx(2.0)
    t2 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))  # t(0.975, df=2) in closed form: 4.3026527...
    half = t2 * 2.0 / math.sqrt(3)  # t * std / sqrt(n)
    assert (s["x_ci_low"], s["x_ci_high"]) == pytest.approx((5 - half, 5 + half), rel=1e-9)
    assert s["x_n_seeds"] == 3 and s["n_rounds"] == 2


def test_seed_weights_are_equal_whatever_their_round_count():
    # seed 42 has 4 counted rounds, seed 43 one: the mean is over seeds (2 and 10), not over rounds
    s = one({42: rounds(1, 2, 3, 2), 43: rounds(10)})
    assert s["x_mean"] == pytest.approx(6.0) and s["n_rounds"] == 1


def test_last_round_none_and_empty_seeds():
    by_seed = {42: {**rounds(1, None, 3), 41: 99.0}, 43: {1: 5.0, 2: 5.0}, 44: rounds(5)}
    s = one(by_seed, last_round=40)
    assert s["x_mean"] == pytest.approx((2 + 5) / 2) and s["x_n_seeds"] == 2  # round 41 cut, None dropped, 43 warm-up
    assert one({42: rounds(1, 2, 30)}, last_round=6)["x_mean"] == pytest.approx(1.5)
    assert one({42: rounds(1, 2)}, warmup=0)["x_mean"] == pytest.approx((4 * WARMUP_NOISE + 3) / 6)
    assert one({42: rounds(1, float("inf"), "n/a", 3)})["x_mean"] == pytest.approx(2.0)  # not numbers: not counted


def test_reduce_max_for_peaks():
    (r,) = per_seed(frame({7: rounds(3, 9, 4)}), "x", how="max").to_dict("records")
    assert (r["value"], r["n_rounds"]) == (9, 3)
    assert one({1: rounds(3, 9), 2: rounds(7, 1)}, how="max")["x_mean"] == pytest.approx(8.0)


def test_cells_are_kept_apart():
    f = pd.concat([frame({1: rounds(2)}, schedule="sync"), frame({1: rounds(4)}, schedule="stream"),
                   frame({1: rounds(8)}, experiment="f", schedule="sync")])
    got = {(r["experiment"], r["schedule"]): r["x_mean"] for r in aggregate(f, "x").to_dict("records")}
    assert got == {("e", "sync"): 2.0, ("e", "stream"): 4.0, ("f", "sync"): 8.0}


def test_one_seed_has_no_spread_and_none_is_empty():
    (s,) = over_seeds(pd.DataFrame({"experiment": "e", "schedule": "s", "value": [3.0]})).to_dict("records")
    assert s["mean"] == 3.0 and math.isnan(s["std"]) and math.isnan(s["ci_low"])
    (s,) = over_seeds(pd.DataFrame({"experiment": "e", "schedule": "s", "value": [None, float("nan")]},
                                   dtype=object).astype({"value": float})).to_dict("records")
    assert math.isnan(s["mean"]) and s["n_seeds"] == 0


def test_seed_value_is_the_first_stage():
    assert seed_value(rounds(2, None, 4)) == (pytest.approx(3.0), 2)
    assert seed_value({1: 5.0, 2: 5.0}) == (None, 0)
    assert seed_value({}) == (None, 0)


@pytest.mark.parametrize("df,t", [(1, 12.706204736), (2, 4.302652730), (3, 3.182446305), (4, 2.776445105),
                                  (9, 2.262157163), (30, 2.042272456), (120, 1.979930405)])
def test_t_quantile_against_tables(df, t):
    assert t_quantile_975(df) == pytest.approx(t, rel=1e-8)
