import pytest

from roman import add, count_symbols, is_valid, longest_below, sort_numerals, subtract, to_int, to_roman


def test_to_roman_one():
    assert to_roman(1) == "I"


def test_to_roman_three():
    assert to_roman(3) == "III"


def test_to_roman_four():
    assert to_roman(4) == "IV"


def test_to_roman_nine():
    assert to_roman(9) == "IX"


def test_to_roman_forty_two():
    assert to_roman(42) == "XLII"


def test_to_roman_1994():
    assert to_roman(1994) == "MCMXCIV"


def test_to_roman_max():
    assert to_roman(3999) == "MMMCMXCIX"


def test_to_roman_zero_raises():
    with pytest.raises(ValueError):
        to_roman(0)


def test_to_roman_too_big_raises():
    with pytest.raises(ValueError):
        to_roman(4000)


def test_to_roman_float_raises():
    with pytest.raises(TypeError):
        to_roman(2.5)


def test_to_int_simple():
    assert to_int("III") == 3


def test_to_int_four():
    assert to_int("IV") == 4


def test_to_int_ninety():
    assert to_int("XC") == 90


def test_to_int_1994():
    assert to_int("MCMXCIV") == 1994


def test_to_int_lowercase():
    assert to_int("xii") == 12


def test_to_int_bad_symbol():
    with pytest.raises(ValueError):
        to_int("XIZ")


def test_to_int_empty():
    with pytest.raises(ValueError):
        to_int("")


def test_round_trip():
    for n in (1, 14, 49, 88, 444, 999, 2024):
        assert to_int(to_roman(n)) == n


def test_is_valid_true():
    assert is_valid("XIV") is True


def test_is_valid_non_canonical():
    assert is_valid("IIII") is False


def test_is_valid_garbage():
    assert is_valid("ABC") is False


def test_add():
    assert add("XIV", "VI") == "XX"


def test_add_to_max():
    assert add("MMM", "CMXCIX") == "MMMCMXCIX"


def test_subtract():
    assert subtract("XX", "VI") == "XIV"


def test_subtract_to_one():
    assert subtract("II", "I") == "I"


def test_subtract_to_zero_raises():
    with pytest.raises(ValueError):
        subtract("V", "V")


def test_sort_numerals():
    assert sort_numerals(["X", "II", "V"]) == ["II", "V", "X"]


def test_count_symbols():
    assert count_symbols("XIV") == 3


def test_count_symbols_strips():
    assert count_symbols(" MM ") == 2


def test_longest_below_ten():
    assert longest_below(10) == 8


def test_longest_below_forty():
    assert longest_below(40) == 38
