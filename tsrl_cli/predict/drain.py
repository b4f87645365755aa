"""Stream's drain: when a round's backwards end, each on the first free learner in arrival order.

The queue of the event model (tsrl_cli.predict): arrivals on the rollout's clock, FIFO list scheduling over
L learners, optionally a trajectory's queued turns coalesced into one backward (OPD). Pure python.
"""

from __future__ import annotations

import math
from collections import deque

from tsrl_cli.traces import Item


def drain_time(items: tuple[Item, ...] | list[Item], learners: int = 1, *, rollout_slowdown: float = 0.0,
               per_backward_s: float = 0.0, coalesce: bool = False) -> float:
    """When the last item's work ends, each item on the first free learner, in arrival order.

    rollout_slowdown c: arrival times are the rollout's own (uncontended) clock, which advances at
    1 / (1 + c) of real time while any learner computes. per_backward_s: added to every backward.
    coalesce: a learner that takes an item also takes the queued items of its trajectory, in one
    backward that costs the most expensive of them (an OPD row over the latest turn's prefix).
    With the defaults this is FIFO list scheduling: start = max(arrival, first free learner).
    """
    jobs = [(i.finished_at_s, i.learner_cost_s, i.trajectory) for i in items]
    return drain_jobs(jobs, learners, rollout_slowdown, per_backward_s, coalesce)


def drain_jobs(jobs: list[tuple[float, float, str | None]], learners: int, rollout_slowdown: float,
               per_backward_s: float, coalesce: bool, costs: list[float] | None = None) -> float:
    """drain_time on (arrival s, cost s, trajectory) tuples: the fit calls it for every round at every step.
    costs: when given, each backward's cost (its per_backward_s left out) is appended, in start order."""
    if learners == 1:
        return _drain_one(jobs, rollout_slowdown, per_backward_s, coalesce, costs)
    return _drain_many(jobs, learners, rollout_slowdown, per_backward_s, coalesce, costs)


def _drain_many(jobs: list[tuple[float, float, str | None]], learners: int, rollout_slowdown: float,
                per_backward_s: float, coalesce: bool, costs: list[float] | None = None) -> float:
    """drain_jobs on any number of learners: a list of free times, the queue a list rebuilt when a backward
    coalesces."""
    arrivals = sorted(jobs, key=lambda j: j[0])
    free = [0.0] * learners  # when each learner is next free (real seconds)
    queue: list[tuple[float, float, str | None]] = []
    t = v = end = 0.0  # real time, the rollout's clock, the last backward's end
    n, k = len(arrivals), 0
    while k < n or queue:
        if queue:
            idle = [j for j in range(learners) if free[j] <= t]
            while queue and idle:  # start work on every idle learner
                head = queue.pop(0)
                cost = head[1]
                if coalesce and head[2] is not None:
                    cost = max([cost] + [i[1] for i in queue if i[2] == head[2]])
                    queue = [i for i in queue if i[2] != head[2]]
                j = idle.pop(0)
                free[j] = t + cost + per_backward_s
                if costs is not None:
                    costs.append(cost)
                end = max(end, free[j])
        if k == n:  # nothing left to arrive: the queue waits for learners only
            if queue:
                t = min(f for f in free if f > t)
            continue
        busy = [f for f in free if f > t]
        rate = 1.0 / (1.0 + rollout_slowdown) if busy else 1.0
        t_arrive = t + max(0.0, arrivals[k][0] - v) / rate
        t_free = min(busy) if busy else math.inf
        if t_arrive <= t_free:
            t, v = t_arrive, max(v, arrivals[k][0])
            while k < n and arrivals[k][0] <= v:
                queue.append(arrivals[k])
                k += 1
        else:
            v += (t_free - t) * rate
            t = t_free
    return end


def _drain_one(jobs: list[tuple[float, float, str | None]], rollout_slowdown: float, per_backward_s: float,
               coalesce: bool, costs: list[float] | None = None) -> float:
    """drain_jobs on one learner: the same floats from the same operations in the same order as _drain_many
    (tests/test_predict.py checks it on random rounds), about 3x faster: `tsrl calibrate`'s fit calls it some
    500,000 times. The queue holds
    indices into the arrivals; a coalesced backward marks its trajectory's other queued turns gone (skipped
    when they reach the head) where _drain_many rebuilds the queue."""
    arrivals = sorted(jobs, key=lambda j: j[0])
    slow = 1.0 / (1.0 + rollout_slowdown)
    queue: deque[int] = deque()
    gone: set[int] = set()
    queued: dict[str, deque[int]] = {}  # coalescing: each trajectory's queued indices, oldest first
    live = 0  # queued and not gone
    free = t = v = end = 0.0  # when the learner is next free, real time, the rollout's clock, the last end
    n, k = len(arrivals), 0
    while k < n or live:
        if live and free <= t:  # idle: the head starts (coalescing, with its trajectory's queued turns)
            h = queue.popleft()
            while h in gone:
                h = queue.popleft()
            live -= 1
            cost, traj = arrivals[h][1], arrivals[h][2]
            if coalesce and traj is not None:
                mine = queued[traj]
                mine.popleft()  # h, the oldest of them
                if mine:
                    cost = max([cost] + [arrivals[i][1] for i in mine])
                    gone.update(mine)
                    live -= len(mine)
                    mine.clear()
            free = t + cost + per_backward_s
            if costs is not None:
                costs.append(cost)
            if free > end:  # noqa: PLR1730  max(end, free): the builtin's call cost a quarter of this loop
                end = free
        if k == n:  # nothing left to arrive: the queue waits for the learner only
            if live:
                if not free > t:  # _drain_many's min() of no busy learner: a backward of zero cost
                    raise ValueError("a backward of zero cost with turns still queued")
                t = free
            continue
        busy = free > t
        rate = slow if busy else 1.0
        a = arrivals[k][0]
        t_arrive = t + (a - v if a - v > 0.0 else 0.0) / rate  # noqa: FURB136  max(0.0, a - v), as above
        t_free = free if busy else math.inf
        if t_arrive <= t_free:
            t = t_arrive
            if a > v:  # noqa: PLR1730  max(v, a), as above
                v = a
            while k < n and arrivals[k][0] <= v:
                if coalesce and arrivals[k][2] is not None:
                    queued.setdefault(arrivals[k][2], deque()).append(k)
                queue.append(k)
                live += 1
                k += 1
        else:
            v += (t_free - t) * rate
            t = t_free
    return end
