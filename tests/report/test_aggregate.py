"""The warm-up-aware aggregation on hand-made numbers."""

import math

import pytest

from tsrl_cli.report.aggregate import aggregate, over_seeds, seed_value, t_quantile_975

WARMUP_NOISE = 1000.0  # rounds 1-4 carry a value that would wreck every mean if it were counted


def rounds(*post_warmup, start=5):
    d = {r: WARMUP_NOISE for r in range(1, 5)}
    d.update({start + i: v for i, v in enumerate(post_warmup)})
    return d


def test_warmup_excluded_per_seed_mean_then_over_seeds():
    # per seed, rounds 5-6: (2+4)/2 = 3, (4+6)/2 = 5, (6+8)/2 = 7 -> mean 5, std 2 (n-1)
    s = aggregate({42: rounds(2, 4), 43: rounds(4, 6), 44: rounds(6, 8)})
    assert s.mean == pytest.approx(5.0) and s.std == pytest.approx(2.0)
    t2 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))  # t(0.975, df=2) in closed form: 4.3026527...
    half = t2 * 2.0 / math.sqrt(3)  # t * std / sqrt(n)
    assert (s.ci_low, s.ci_high) == pytest.approx((5 - half, 5 + half), rel=1e-9)
    assert s.n_seeds == 3 and s.n_rounds == 2


def test_seed_weights_are_equal_whatever_their_round_count():
    # seed 42 has 4 counted rounds, seed 43 one: the mean is over seeds (2 and 10), not over rounds
    s = aggregate({42: rounds(1, 2, 3, 2), 43: rounds(10)})
    assert s.mean == pytest.approx(6.0) and s.n_rounds == 1


def test_last_round_none_and_empty_seeds():
    by_seed = {42: {**rounds(1, None, 3), 41: 99.0}, 43: {1: 5.0, 2: 5.0}, 44: rounds(5)}
    s = aggregate(by_seed, last_round=40)
    assert s.mean == pytest.approx((2 + 5) / 2) and s.n_seeds == 2  # round 41 cut, None dropped, seed 43 all warm-up
    assert aggregate({42: rounds(1, 2, 30)}, last_round=6).mean == pytest.approx(1.5)
    assert aggregate({42: rounds(1, 2)}, warmup=0).mean == pytest.approx((4 * WARMUP_NOISE + 3) / 6)


def test_reduce_max_for_peaks():
    assert seed_value(rounds(3, 9, 4), reduce=max) == (9, 3)
    assert aggregate({1: rounds(3, 9), 2: rounds(7, 1)}, reduce=max).mean == pytest.approx(8.0)


def test_one_seed_has_no_spread_and_none_is_empty():
    s = over_seeds([3.0])
    assert s.mean == 3.0 and s.std is None and s.ci_low is None
    assert over_seeds([None, float("nan")]).mean is None


@pytest.mark.parametrize("df,t", [(1, 12.706204736), (2, 4.302652730), (3, 3.182446305), (4, 2.776445105),
                                  (9, 2.262157163), (30, 2.042272456), (120, 1.979930405)])
def test_t_quantile_against_tables(df, t):
    assert t_quantile_975(df) == pytest.approx(t, rel=1e-8)
