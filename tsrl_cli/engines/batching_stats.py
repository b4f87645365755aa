"""A batcher's figures between two takes (BatchingStats: throughput, admission waits, turns per engine
step), which train takes once per round into metrics.jsonl, and the nearest-rank quantile they use.
"""

from __future__ import annotations

import math
import statistics
import threading


def quantile_nearest_rank(xs: list[float], q: float) -> float:
    """The q-quantile by nearest rank: the ceil(q*n)-th smallest value (p95 of 20 values: the 19th)."""
    ordered = sorted(xs)
    return ordered[max(math.ceil(q * len(ordered)), 1) - 1]


class BatchingStats:
    """A batcher's figures between two take()s (train takes them once per round).

    Per turn: its admission wait, from generate() called to the first engine step it is in (static:
    the engine call), and its generated tokens. Per engine step (static: per engine call): the turns in
    it. Written by the batcher's thread, taken by another.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self.waits_s: list[float] = []
        self.running: list[int] = []
        self.turns = self.tokens = 0
        self.first_submitted: float | None = None
        self.last_returned: float | None = None

    def stepped(self, waits_s: list[float], running: int) -> None:
        """One engine step (call) over `running` turns, of which the newly admitted waited `waits_s`."""
        with self._lock:
            self.waits_s += waits_s
            self.running.append(running)

    def returned(self, submitted_at: float, returned_at: float, tokens: int) -> None:
        with self._lock:
            self.turns += 1
            self.tokens += tokens
            self.first_submitted = submitted_at if self.first_submitted is None else min(self.first_submitted,
                                                                                        submitted_at)
            self.last_returned = returned_at if self.last_returned is None else max(self.last_returned, returned_at)

    def take(self) -> dict:
        """The figures since the last take, and a fresh start:

        turns, generated_tokens: turns returned and the tokens they generated;
        tokens_per_s: generated_tokens / (last return - first submission among them), the engine's
          throughput as its sessions saw it (tool time between turns included);
        queue_wait_mean_s, queue_wait_p95_s: admission waits (p95 by nearest rank);
        running_mean: turns per engine step (static: per engine call); steps: engine steps (calls).
        Figures of nothing are None.
        """
        with self._lock:
            span = (self.last_returned - self.first_submitted) if self.turns else None
            out = {"turns": self.turns, "generated_tokens": self.tokens,
                   "tokens_per_s": self.tokens / span if span else None,
                   "queue_wait_mean_s": statistics.fmean(self.waits_s) if self.waits_s else None,
                   "queue_wait_p95_s": quantile_nearest_rank(self.waits_s, 0.95) if self.waits_s else None,
                   "running_mean": statistics.fmean(self.running) if self.running else None,
                   "steps": len(self.running)}
            self._clear()
        return out
