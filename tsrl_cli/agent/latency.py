"""Injected tool latency, for the paper's duration-spread experiments.

The delay is added after each real tool call and recorded separately in the events
(`injected_latency_s`), so it is never mistaken for real tool time.
  lognormal: median_s * exp(sigma * N(0, 1))
  trace:     delays replayed in order (cycled) from a file, one number of seconds per line

`balanced_median_s` picks the lognormal median that holds a round's expected tool makespan fixed
as sigma grows (experiments/spread_balanced/).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tsrl_cli.errors import UsageError


@dataclass(frozen=True)
class ToolLatency:
    kind: str = "none"  # none | lognormal | trace
    median_s: float = 0.0
    sigma: float = 0.0
    trace: tuple[float, ...] = ()

    @classmethod
    def lognormal(cls, median_s: float, sigma: float) -> ToolLatency:
        if median_s < 0 or sigma < 0:
            raise UsageError("tool latency: median_s and sigma must be >= 0")
        return cls("lognormal", median_s, sigma)

    @classmethod
    def from_trace(cls, path: str | Path) -> ToolLatency:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"{p}: latency trace not found (one delay in seconds per line)")
        vals = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    v = float(line)
                except ValueError:
                    raise UsageError(f"{p}:{n}: not a number of seconds: {line.strip()!r}") from None
                if v < 0 or not math.isfinite(v):
                    raise UsageError(f"{p}:{n}: a delay must be a finite number >= 0")
                vals.append(v)
        if not vals:
            raise UsageError(f"{p}: latency trace is empty")
        return cls("trace", trace=tuple(vals))

    def sample(self, rng: random.Random, call_index: int) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "lognormal":
            return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        if self.kind == "trace":
            return self.trace[call_index % len(self.trace)]
        raise UsageError(f"tool latency kind {self.kind!r} is unknown; use none, lognormal or trace")


def expected_max_total_s(latency: ToolLatency, calls_N: Sequence[int], samples: int = 20_000,
                         seed: int = 0) -> float:
    """Monte Carlo E[max_i sum_k delay_ik], seconds: the injected-latency part of a round's makespan.

    Args:
        calls_N: tool calls of each of the round's N trajectories (all run at once).
    The tool timeout's cut of long draws is left out (at the family's medians, < 1e-4 of draws).
    """
    rng = random.Random(seed)
    total = 0.0
    for _ in range(samples):
        total += max(sum(latency.sample(rng, k) for k in range(n)) for n in calls_N)
    return total / samples


def balanced_median_s(mean_s: float, sigma: float, calls_N: Sequence[int], extra_s: float = 0.0,
                      samples: int = 20_000, seed: int = 0) -> float:
    """Lognormal median whose expected round makespan of injected latency equals sigma 0's (+ extra_s).

    At sigma 0 every call takes mean_s, so the tool makespan is max(calls_N) * mean_s. A lognormal's
    draws scale with its median, so E[max] at median m is m * E[max at median 1]; solve for m.
    extra_s (seconds) is added to that target, to offset the rest of the makespan (generation) where
    it shrinks with sigma.
    """
    unit = expected_max_total_s(ToolLatency.lognormal(1.0, sigma), calls_N, samples, seed)
    return (max(calls_N) * mean_s + extra_s) / unit
