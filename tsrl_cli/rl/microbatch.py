"""The micro-batch planner: which queued items are backwarded together, and on which rank.

Pure Python (no torch): items in, micro-batches out. An item only needs `row` (items with the
same row share one row of the batch: an OPD trajectory's queued turns, whose longest prefix scores
them all) and `end` (the positions its row must cover). The round learner (rl/learner.py) decides
each item's fold target; the planner never mixes targets, which keeps micro-batching exact.

    plan(classes, world=1, max_items=None, max_tokens=None) -> [MicroBatch]

  classes     {target: [item, ...]} in arrival order (the first arrival's class first)
  max_items   rows per micro-batch at most (None: no cap)
  max_tokens  positions per micro-batch at most (None: no cap): rows x width padded, the rows' own lengths
              packed; a row wider than the cap still goes, alone
  packed      rows end to end, no padding (rl/batchloss.py Layout): what a batch costs and what the cap counts
  world       ranks of a learner group: up to one micro-batch each. One rank takes the first batch
              only (the next step replans with what arrived meanwhile); with more ranks than
              batches, the widest batch that has two rows or more is split in half, until every
              rank has one or none can split.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


class Planned(Protocol):
    @property
    def row(self) -> Hashable: ...  # items with the same row share one row of a micro-batch

    @property
    def end(self) -> int: ...  # positions [start, end) its row covers (start: 0 unless the item has one)


@dataclass
class MicroBatch:
    """Items backwarded together (arrival order), and the fold target their gradient goes to."""

    items: list
    target: tuple  # ("round",) | ("member", group_id, reward) | ("unit", key)
    rows: int = 0
    width: int = 0  # positions of the widest row: every row is padded to it
    real: int = 0  # the rows' own positions (sum of their lengths)
    packed: bool = False  # rows end to end: no padding
    prefix: Hashable = None  # the group whose prompt part the rows attend to (rl/prefix.py), or None
    prompt: int = 0  # prompt positions this batch forwarded for its group (its first cut batch), backpropagated later

    @property
    def tokens(self) -> int:
        """Token positions one forward and backward of this batch computes, padding included."""
        return (self.real if self.packed else self.rows * self.width) + self.prompt

    @property
    def real_tokens(self) -> int:
        """The positions of real tokens it computes: the rows' own and its prompt part's."""
        return self.real + self.prompt


def length(it: Planned) -> int:
    """The positions an item's row covers: [start, end)."""
    return it.end - getattr(it, "start", 0)


def rows_of(items: Sequence[Planned]) -> list[list[Planned]]:
    """The items grouped by row, rows in order of their first item."""
    rows: dict = {}
    for it in items:
        rows.setdefault(it.row, []).append(it)
    return list(rows.values())


def batch_of(items: Sequence[Planned], target: tuple, packed: bool = False) -> MicroBatch:
    rows = rows_of(items)
    return MicroBatch(list(items), target, len(rows), max(length(it) for it in items),
                      sum(max(length(it) for it in row) for row in rows), packed)


def chunks(items: Sequence[Planned], max_items: int | None, max_tokens: int | None,
           packed: bool = False) -> list[list[Planned]]:
    """Consecutive rows of `items` cut into chunks within both caps (a row is never cut)."""
    out: list[list[Planned]] = []
    cur: list[list[Planned]] = []
    width = total = 0
    for row in rows_of(items):
        w = max(length(it) for it in row)
        cost = total + w if packed else (len(cur) + 1) * max(width, w)
        if cur and ((max_items is not None and len(cur) + 1 > max_items)
                    or (max_tokens is not None and cost > max_tokens)):
            out.append([x for r in cur for x in r])
            cur, width, total = [], 0, 0
        cur.append(row)
        width, total = max(width, w), total + w
    if cur:
        out.append([x for r in cur for x in r])
    return out


def split_for_ranks(batches: list[MicroBatch], world: int) -> list[MicroBatch]:
    """More ranks than batches: halve the widest splittable batch (by rows) until each rank has one."""
    batches = list(batches)
    while len(batches) < world:
        splittable = [b for b in batches if b.rows > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda b: b.tokens)
        rows = rows_of(b.items)
        half = {id(x) for row in rows[: len(rows) // 2] for x in row}
        i = batches.index(b)
        batches[i:i + 1] = [batch_of([x for x in b.items if id(x) in half], b.target, b.packed),
                            batch_of([x for x in b.items if id(x) not in half], b.target, b.packed)]
    return batches


def plan(classes: Mapping[tuple, Sequence[Planned]], world: int = 1, max_items: int | None = None,
         max_tokens: int | None = None, packed: bool = False) -> list[MicroBatch]:
    """The next step's micro-batches: at most one per rank (see the module docstring)."""
    batches: list[MicroBatch] = []
    for target, items in classes.items():
        for chunk in chunks(items, max_items, max_tokens, packed):
            batches.append(batch_of(chunk, target, packed))
            if world == 1:
                return batches
    return split_for_ranks(batches, world)[:world]
