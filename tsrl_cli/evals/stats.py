"""Confidence intervals for resolved rates.

A resolved rate from n trials is a binomial proportion. The Wilson score interval (Wilson 1927)
stays inside [0, 1] and keeps close to its nominal coverage at the small n and extreme rates an
evaluation of a few dozen tasks gives, where the normal (Wald) interval collapses to a point at
0 % or 100 %. Trials are taken as independent: with several samples of the same task they are
not, and the interval is then narrower than it should be (docs/evaluation.md).
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # standard normal quantile at 0.975


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) of the Wilson score interval for `successes` out of `n` trials.

        centre = (p + z²/2n) / (1 + z²/n),   half = z·sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n)

    n = 0 gives (0, 1): no trial says nothing.
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
