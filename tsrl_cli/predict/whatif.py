"""The what-if knobs: a traced round on a different machine or workload (learner speed, tool speed, the
spread of arrivals).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from tsrl_cli.errors import UsageError
from tsrl_cli.traces import Item, RoundTrace


def what_if(items, learner_speed: float = 1.0, tool_speed: float = 1.0, spread: float = 1.0) -> list[Item]:
    """The same round on a different machine or workload.

    learner_speed X: every item's learner cost / X. tool_speed X: every arrival time / X (the minimal
    trace does not split generation from tool time, so all of it scales). spread X: each arrival's
    deviation from the median arrival times X, clipped at 0 (nothing arrives before the round starts).
    """
    check_speeds(learner_speed, tool_speed, spread)
    if not items:
        return []
    at = _what_if_clock(items, tool_speed, spread)
    return [replace(i, finished_at_s=at(i.finished_at_s), learner_cost_s=i.learner_cost_s / learner_speed)
            for i in items]


def check_speeds(learner_speed: float, tool_speed: float, spread: float) -> None:
    """The knobs' ranges, a UsageError naming the flag: speeds > 0, spread >= 0."""
    for name, v in (("--learner-speed", learner_speed), ("--tool-speed", tool_speed)):
        if not v > 0:
            raise UsageError(f"{name} must be > 0 (got {v})")
    if not spread >= 0:
        raise UsageError(f"--spread must be >= 0 (got {spread})")


def _what_if_clock(items, tool_speed: float, spread: float):
    """what_if's map of an arrival time (items' median as the centre), for items and OPD trajectory ends alike."""
    med = statistics.median(i.finished_at_s for i in items)
    return lambda t: max(0.0, med + spread * (t - med)) / tool_speed


def what_if_round(r: RoundTrace, learner_speed: float, tool_speed: float, spread: float) -> RoundTrace:
    """A traced round through what_if: its items, OPD trajectory ends, batch and rollout seconds."""
    if not r.items:
        return r
    at = _what_if_clock(r.items, tool_speed, spread)
    return replace(r, items=tuple(what_if(r.items, learner_speed, tool_speed, spread)),
                   ends=tuple((k, at(t), n) for k, t, n in r.ends),
                   batch_work_s=None if r.batch_work_s is None else r.batch_work_s / learner_speed,
                   rollout_s=None if r.rollout_s is None else r.rollout_s / tool_speed)
