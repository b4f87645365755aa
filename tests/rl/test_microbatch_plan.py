"""The micro-batch planner on plain integers: rows, caps, ranks (rl/microbatch.py; no model, no torch)."""

from dataclasses import dataclass

from tsrl_cli.rl import microbatch
from tsrl_cli.rl.microbatch import batch_of, chunks, plan, rows_of, split_for_ranks


@dataclass(frozen=True)
class It:
    row: int
    end: int


def shape(batches):
    return [(b.target, [(i.row, i.end) for i in b.items], b.rows, b.width) for b in batches]


def test_items_of_one_row_share_it_and_rows_keep_first_arrival_order():
    items = [It(1, 5), It(2, 3), It(1, 9), It(3, 4)]
    assert [[i.end for i in r] for r in rows_of(items)] == [[5, 9], [3], [4]]
    b = batch_of(items, ("round",))
    assert (b.rows, b.width, b.tokens) == (3, 9, 27)  # three rows padded to the widest, 9


def test_item_cap_counts_rows_not_items():
    items = [It(1, 5), It(1, 6), It(2, 3), It(3, 4), It(4, 2)]
    got = chunks(items, max_items=2, max_tokens=None)
    assert [[(i.row, i.end) for i in c] for c in got] == [[(1, 5), (1, 6), (2, 3)], [(3, 4), (4, 2)]]


def test_token_cap_counts_padded_positions_and_a_wide_row_goes_alone():
    items = [It(1, 4), It(2, 4), It(3, 5), It(4, 20), It(5, 1)]
    got = chunks(items, max_items=None, max_tokens=10)
    # rows 1, 2: 2 x 4 = 8 <= 10; adding row 3 would pad 3 x 5 = 15. Row 4 alone is over the cap and still goes.
    assert [[i.row for i in c] for c in got] == [[1, 2], [3], [4], [5]]
    assert chunks(items, None, None) == [items]  # no cap: one chunk


def test_one_rank_takes_the_first_batch_only():
    classes = {("member", "g", 1.0): [It(1, 3), It(2, 3)], ("round",): [It(3, 7)]}
    assert shape(plan(classes, world=1)) == [(("member", "g", 1.0), [(1, 3), (2, 3)], 2, 3)]
    assert shape(plan(classes, world=1, max_items=1)) == [(("member", "g", 1.0), [(1, 3)], 1, 3)]


def test_targets_never_mix_and_each_rank_gets_at_most_one_batch():
    classes = {("member", "g", 1.0): [It(1, 3), It(2, 3)], ("member", "g", 0.0): [It(3, 5)], ("round",): [It(4, 7)]}
    got = plan(classes, world=2)
    assert shape(got) == [(("member", "g", 1.0), [(1, 3), (2, 3)], 2, 3), (("member", "g", 0.0), [(3, 5)], 1, 5)]


def test_more_ranks_than_batches_split_the_widest_splittable_in_half():
    classes = {("round",): [It(1, 2), It(2, 8), It(3, 8), It(4, 3)], ("unit", "k"): [It(5, 40)]}
    got = plan(classes, world=3)
    # the unit's one row cannot split; the round batch (4 rows x 8) splits into rows {1, 2} and {3, 4}
    assert shape(got) == [(("round",), [(1, 2), (2, 8)], 2, 8), (("round",), [(3, 8), (4, 3)], 2, 8),
                          (("unit", "k"), [(5, 40)], 1, 40)]
    assert len(plan(classes, world=8)) == 5  # every batch of one row: no more splits, three ranks idle


def test_split_keeps_rows_whole():
    b = batch_of([It(1, 2), It(1, 6), It(2, 3)], ("round",))
    halves = split_for_ranks([b], 2)
    assert [[(i.row, i.end) for i in h.items] for h in halves] == [[(1, 2), (1, 6)], [(2, 3)]]
    assert split_for_ranks([batch_of([It(1, 2), It(1, 6)], ("round",))], 2)[0].rows == 1  # one row: unsplit


def test_the_planner_imports_no_torch():
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(microbatch.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.split(".")[0] == "torch" or m.startswith("tsrl_cli") for m in names)
