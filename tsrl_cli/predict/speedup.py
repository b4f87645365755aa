"""The speedup of one schedule over another, and the event model's bound on sync / stream (the ceiling)."""

from __future__ import annotations


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b (a step time over another: the speedup of b's schedule); None where a is unknown or b is 0 or unknown."""
    return a / b if a is not None and b else None


def ceiling(makespan_s: float, work_s: float, batch_work_s: float, learners: int = 1,
            overhead_s: float = 0.0) -> float | None:
    """The bound on sync / stream: (M + Wb/L + s) / (max(M, W/L) + s), s = step + sync (None: 0 / 0)."""
    return ratio(makespan_s + batch_work_s / learners + overhead_s, max(makespan_s, work_s / learners) + overhead_s)
