import pytest

from money import CurrencyMismatch, Money, largest, parse, total


def test_requires_int():
    with pytest.raises(TypeError):
        Money(1.5)


def test_equality():
    assert Money(100) == Money(100, "EUR")
    assert Money(100) != Money(100, "USD")


def test_repr():
    assert repr(Money(5, "USD")) == "Money(5, 'USD')"


def test_add():
    assert Money(150).add(Money(275)) == Money(425)


def test_add_mismatch():
    with pytest.raises(CurrencyMismatch):
        Money(1, "EUR").add(Money(1, "USD"))


def test_subtract():
    assert Money(500).subtract(Money(120)) == Money(380)


def test_subtract_negative_result():
    assert Money(100).subtract(Money(250)) == Money(-150)


def test_times():
    assert Money(125).times(3) == Money(375)


def test_percent():
    assert Money(1000).percent(15) == Money(150)


def test_percent_rounds_half_up():
    assert Money(150).percent(1) == Money(2)


def test_percent_rounds_down():
    assert Money(149).percent(1) == Money(1)


def test_is_zero():
    assert Money(0).is_zero()
    assert not Money(1).is_zero()


def test_is_negative():
    assert Money(-1).is_negative()
    assert not Money(0).is_negative()


def test_less_than():
    assert Money(1).less_than(Money(2))
    assert not Money(2).less_than(Money(2))


def test_allocate_even():
    assert Money(900).allocate(3) == [Money(300)] * 3


def test_allocate_remainder():
    assert Money(100).allocate(3) == [Money(34), Money(33), Money(33)]


def test_allocate_sum_preserved():
    parts = Money(1001).allocate(7)
    assert sum(p.cents for p in parts) == 1001


def test_allocate_bad_parts():
    with pytest.raises(ValueError):
        Money(100).allocate(0)


def test_split_by_ratio():
    assert Money(100).split_by_ratio([1, 1, 1]) == [Money(34), Money(33), Money(33)]


def test_split_by_ratio_uneven():
    assert Money(1000).split_by_ratio([3, 1]) == [Money(750), Money(250)]


def test_split_bad_ratios():
    with pytest.raises(ValueError):
        Money(100).split_by_ratio([0, 0])


def test_format():
    assert Money(1234).format() == "12.34 EUR"


def test_format_small():
    assert Money(5, "USD").format() == "0.05 USD"


def test_format_negative():
    assert Money(-250).format() == "-2.50 EUR"


def test_parse():
    assert parse("12.34 EUR") == Money(1234)


def test_parse_negative():
    assert parse("-0.50 USD") == Money(-50, "USD")


def test_parse_whole():
    assert parse("7 EUR") == Money(700)


def test_parse_bad_decimals():
    with pytest.raises(ValueError):
        parse("1.5 EUR")


def test_total():
    assert total([Money(100), Money(250), Money(5)]) == Money(355)


def test_total_empty():
    assert total([], "USD") == Money(0, "USD")


def test_largest():
    assert largest([Money(5), Money(50), Money(20)]) == Money(50)
