"""The one aggregation every table uses (the ThunderSyncRL report's measurement
discipline: 40 rounds per seed, rounds 1-4 warm-up, seeds 42-44).

Rounds 1..warmup (default 4) are warm-up and dropped; rounds warmup+1..last_round (default 5..40)
are reduced per seed (mean, or max for peaks); then mean, std (n-1) and a 95 % Student-t interval
over seeds. Per-seed scalars that are not per round (core-seconds to a target) enter at the
second stage, `over_seeds`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

WARMUP_ROUNDS = 4
LAST_ROUND = 40


@dataclass(frozen=True)
class Spread:
    mean: float | None
    std: float | None  # sample std over seeds (n - 1); None with one seed
    ci_low: float | None  # 95 % Student-t interval of the mean over seeds; None with one seed
    ci_high: float | None
    n_seeds: int
    n_rounds: int = 0  # rounds counted per seed (the smallest over seeds)

    def as_row(self, prefix: str) -> dict:
        return {f"{prefix}_mean": self.mean, f"{prefix}_std": self.std, f"{prefix}_ci_low": self.ci_low,
                f"{prefix}_ci_high": self.ci_high}


def over_seeds(values: list[float]) -> Spread:
    """Mean, sample std and the 95 % t-interval of per-seed values (None entries are dropped)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(xs)
    if n == 0:
        return Spread(None, None, None, None, 0)
    mean = statistics.fmean(xs)
    if n == 1:
        return Spread(mean, None, None, None, 1)
    std = statistics.stdev(xs)
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return Spread(mean, std, mean - half, mean + half, n)


def aggregate(by_seed: Mapping[int, Mapping[int, float | None]], warmup: int = WARMUP_ROUNDS,
              last_round: int = LAST_ROUND, reduce: Callable[[list[float]], float] = statistics.fmean) -> Spread:
    """by_seed[seed][round] = value -> Spread over seeds of reduce(values of rounds warmup+1..last_round).

    A seed with no counted round (all warm-up, or all None) is left out; n_seeds says how many stayed.
    """
    per_seed, n_rounds = [], []
    for rounds in by_seed.values():
        v, n = seed_value(rounds, warmup, last_round, reduce)
        if v is not None:
            per_seed.append(v)
            n_rounds.append(n)
    s = over_seeds(per_seed)
    return Spread(s.mean, s.std, s.ci_low, s.ci_high, s.n_seeds, min(n_rounds, default=0))


def seed_value(rounds: Mapping[int, float | None], warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND,
               reduce: Callable[[list[float]], float] = statistics.fmean) -> tuple[float | None, int]:
    """The first stage for one seed: reduce(values of rounds warmup+1..last_round), and how many."""
    xs = [v for r, v in rounds.items() if warmup < r <= last_round and v is not None and math.isfinite(v)]
    return (reduce(xs) if xs else None), len(xs)


def t_quantile_975(df: int) -> float:
    """Two-sided 95 % Student-t quantile (t such that P(|T| < t) = 0.95), by bisection.

    df=2 gives 4.302653, df=1 gives 12.706205 (standard tables); no scipy needed.
    """
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_abs_cdf(mid, df) < 0.95 else (lo, mid)
    return (lo + hi) / 2


def _t_abs_cdf(t: float, df: int) -> float:
    """P(|T| < t) for integer df, closed form (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:
        total, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):  # cos + 2/3 cos^3 + (2*4)/(3*5) cos^5 + ...
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return 2 / math.pi * (theta + s * total) if df > 1 else 2 * theta / math.pi
    total, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):  # 1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ...
        total += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return s * total
