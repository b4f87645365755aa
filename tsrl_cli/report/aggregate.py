"""The one aggregation every table uses (the ThunderSyncRL report's measurement discipline: 40 rounds
per seed, rounds 1-4 warm-up, seeds 42-44), on the tidy frame of rounds from report/load.py.

Rounds 1..warmup (default 4) are warm-up and dropped; rounds warmup+1..last_round (default 5..40) are
reduced per seed (mean, or max for peaks); then mean, std (n-1) and a 95 % Student-t interval over
seeds. Per-seed values that are not per round (device-seconds to a target) enter at the second stage,
`over_seeds`. Missing and non-finite values are NaN and are skipped at both stages; a seed with no
counted round is left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from tsrl_cli.report.load import RUN, numeric

WARMUP_ROUNDS = 4
LAST_ROUND = 40
CELL = ["experiment", "schedule"]  # one table row
STATS = ("mean", "std", "ci_low", "ci_high")


def per_seed(rounds: pd.DataFrame, key: str, warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND,
             how: str = "mean") -> pd.DataFrame:
    """The first stage, one row per run: `value` = `how` (mean | max) of `key` over rounds
    warmup+1..last_round (NaN when none counts), `n_rounds` = how many rounds counted."""
    counted = numeric(rounds, key).where(rounds["round"].between(warmup + 1, last_round))
    g = rounds[RUN].assign(value=counted).groupby(RUN, sort=False)["value"]
    return g.agg(value=how, n_rounds="count").reset_index()


def over_seeds(values: pd.DataFrame, col: str = "value", by: list[str] = CELL,
               prefix: str | None = None) -> pd.DataFrame:
    """The second stage, one row per group of `by`: mean, sample std (n-1) and the 95 % t-interval of
    the mean over the group's seeds (NaN values dropped; std and interval NaN with one seed), n_seeds.
    Columns are named `<prefix>_mean` ... `<prefix>_n_seeds` when a prefix is given."""
    p = f"{prefix}_" if prefix else ""
    out = values.groupby(by, sort=False)[col].agg(**{f"{p}mean": "mean", f"{p}std": "std", f"{p}n_seeds": "count"})
    n, mean = out[f"{p}n_seeds"], out[f"{p}mean"]
    half = n.map(lambda k: t_quantile_975(k - 1) if k > 1 else math.nan) * out[f"{p}std"] / n ** 0.5
    out[f"{p}ci_low"], out[f"{p}ci_high"] = mean - half, mean + half
    return out.reset_index()


def aggregate(rounds: pd.DataFrame, key: str, warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND,
              how: str = "mean") -> pd.DataFrame:
    """Both stages per (experiment, schedule): `<key>_mean`, `_std`, `_ci_low`, `_ci_high`, `_n_seeds`
    (seeds that had a counted round) and n_rounds (rounds counted per seed, the smallest over them)."""
    seeds = per_seed(rounds, key, warmup, last_round, how).dropna(subset=["value"])
    out = over_seeds(seeds, prefix=key)
    return out.merge(seeds.groupby(CELL, sort=False)["n_rounds"].min().reset_index(), on=CELL, how="left")


def seed_value(rounds: Mapping[int, float | None], warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND,
               how: str = "mean") -> tuple[float | None, int]:
    """The first stage for one run given as {round: value} (tsrl sweep's status line): value, rounds counted."""
    frame = pd.DataFrame({"experiment": "", "schedule": "", "seed": 0, "round": list(rounds),
                          "value": pd.Series(list(rounds.values()), dtype="object")})
    if frame.empty:
        return None, 0
    row = per_seed(frame, "value", warmup, last_round, how).iloc[0]
    return (None if pd.isna(row["value"]) else float(row["value"])), int(row["n_rounds"])


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
