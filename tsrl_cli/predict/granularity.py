"""Granularity: stream's backwards per trajectory (as it arrives) or per group (when its last member arrives),
and how much the arrivals of one group move together. Pure python.

    group_jobs(items)   stream's backwards under learner.granularity group: each item released when its
                        group's last item arrived, at its own cost
    arrival_icc(items)  the within-group intra-class correlation of arrival times, ICC(1): the share of the
                        arrivals' variance that lies between groups. Near 1: a group's members finish
                        together, so waiting for the group costs little; near 0: they spread as the round does

ICC(1) of a one-way random-effects model (Shrout & Fleiss 1979), groups of unequal size n_g with
n0 = (N - sum n_g^2 / N) / (G - 1):  ICC = (MSB - MSW) / (MSB + (n0 - 1) MSW).
"""

from __future__ import annotations

from tsrl_cli.traces import Item


def _by_group(items) -> dict[str, list[Item]]:
    out: dict[str, list[Item]] = {}
    for i in items:
        if i.group is not None:
            out.setdefault(i.group, []).append(i)
    return out


def group_jobs(items) -> list[tuple[float, float, str | None]] | None:
    """(release s, cost s, trajectory) per item under granularity group; None when the items carry no groups."""
    groups = _by_group(items)
    if not groups or any(i.group is None for i in items):
        return None
    last = {g: max(i.finished_at_s for i in members) for g, members in groups.items()}
    return [(last[i.group], i.learner_cost_s, i.trajectory) for i in items]


def arrival_icc(items) -> float | None:
    """ICC(1) of the items' arrival times within their groups; None without two groups of two or more."""
    groups = [[i.finished_at_s for i in members] for members in _by_group(items).values() if len(members) > 1]
    if len(groups) < 2:
        return None
    n_total = sum(len(g) for g in groups)
    k = len(groups)
    grand = sum(sum(g) for g in groups) / n_total
    means = [sum(g) / len(g) for g in groups]
    ssb = sum(len(g) * (m - grand) ** 2 for g, m in zip(groups, means, strict=True))
    ssw = sum((x - m) ** 2 for g, m in zip(groups, means, strict=True) for x in g)
    msb, msw = ssb / (k - 1), ssw / (n_total - k)
    n0 = (n_total - sum(len(g) ** 2 for g in groups) / n_total) / (k - 1)
    denom = msb + (n0 - 1) * msw
    return (msb - msw) / denom if denom > 0 else None
