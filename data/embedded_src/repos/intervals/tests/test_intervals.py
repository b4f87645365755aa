import pytest

from intervals import Interval, covering, format_intervals, gaps, merge, parse, total_length


def test_bad_interval():
    with pytest.raises(ValueError):
        Interval(3, 1)


def test_single_point_ok():
    assert Interval(2, 2).length() == 1


def test_length():
    assert Interval(1, 5).length() == 5


def test_equality():
    assert Interval(1, 2) == Interval(1, 2)
    assert Interval(1, 2) != Interval(1, 3)


def test_repr():
    assert repr(Interval(1, 4)) == "Interval(1, 4)"


def test_contains_inside():
    assert Interval(1, 5).contains(3)


def test_contains_edges():
    assert Interval(1, 5).contains(1)
    assert Interval(1, 5).contains(5)


def test_contains_outside():
    assert not Interval(1, 5).contains(6)


def test_overlaps():
    assert Interval(1, 5).overlaps(Interval(5, 8))


def test_no_overlap():
    assert not Interval(1, 4).overlaps(Interval(5, 8))


def test_touches_adjacent():
    assert Interval(1, 4).touches(Interval(5, 8))


def test_not_touching():
    assert not Interval(1, 3).touches(Interval(5, 8))


def test_intersection():
    assert Interval(1, 5).intersection(Interval(3, 9)) == Interval(3, 5)


def test_intersection_none():
    assert Interval(1, 2).intersection(Interval(4, 5)) is None


def test_shift():
    assert Interval(1, 3).shift(2) == Interval(3, 5)


def test_merge_overlapping():
    assert merge([Interval(1, 3), Interval(2, 6)]) == [Interval(1, 6)]


def test_merge_adjacent():
    assert merge([Interval(1, 2), Interval(3, 4)]) == [Interval(1, 4)]


def test_merge_sorted_output():
    assert merge([Interval(8, 9), Interval(1, 2)]) == [Interval(1, 2), Interval(8, 9)]


def test_merge_nested():
    assert merge([Interval(1, 10), Interval(2, 3)]) == [Interval(1, 10)]


def test_merge_empty():
    assert merge([]) == []


def test_total_length():
    assert total_length([Interval(1, 3), Interval(2, 5), Interval(10, 10)]) == 6


def test_gaps():
    assert gaps([Interval(1, 2), Interval(5, 6), Interval(9, 9)]) == [Interval(3, 4), Interval(7, 8)]


def test_gaps_none():
    assert gaps([Interval(1, 2), Interval(3, 4)]) == []


def test_covering():
    assert covering([Interval(1, 5), Interval(4, 8), Interval(9, 9)], 4) == 2


def test_covering_none():
    assert covering([Interval(1, 2)], 7) == 0


def test_parse():
    assert parse("1-3, 5, 7-9") == [Interval(1, 3), Interval(5, 5), Interval(7, 9)]


def test_parse_skips_empty():
    assert parse("2,,4") == [Interval(2, 2), Interval(4, 4)]


def test_format():
    assert format_intervals([Interval(1, 3), Interval(5, 5)]) == "1-3, 5"


def test_parse_format_round_trip():
    assert format_intervals(parse("1-2, 4, 6-10")) == "1-2, 4, 6-10"
