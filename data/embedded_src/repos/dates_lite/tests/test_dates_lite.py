import pytest

from dates_lite import (
    add_days,
    day_of_year,
    days_between,
    days_in_month,
    days_in_year,
    end_of_month,
    format_date,
    from_ordinal,
    is_leap,
    is_valid,
    parse_date,
    quarter,
    to_ordinal,
    weekday,
)


def test_leap_divisible_by_4():
    assert is_leap(2024)


def test_not_leap():
    assert not is_leap(2023)


def test_century_not_leap():
    assert not is_leap(1900)


def test_400_leap():
    assert is_leap(2000)


def test_days_in_february_leap():
    assert days_in_month(2024, 2) == 29


def test_days_in_february():
    assert days_in_month(2023, 2) == 28


def test_days_in_april():
    assert days_in_month(2023, 4) == 30


def test_days_in_december():
    assert days_in_month(2023, 12) == 31


def test_bad_month():
    with pytest.raises(ValueError):
        days_in_month(2023, 13)


def test_days_in_year():
    assert days_in_year(2024) == 366
    assert days_in_year(2023) == 365


def test_is_valid():
    assert is_valid(2024, 2, 29)


def test_is_valid_false():
    assert not is_valid(2023, 2, 29)


def test_is_valid_day_zero():
    assert not is_valid(2023, 1, 0)


def test_day_of_year_first():
    assert day_of_year(2023, 1, 1) == 1


def test_day_of_year_march():
    assert day_of_year(2024, 3, 1) == 61


def test_ordinal_start():
    assert to_ordinal(1, 1, 1) == 0


def test_ordinal_round_trip():
    for date in [(1, 1, 1), (1999, 12, 31), (2000, 2, 29), (2024, 7, 15)]:
        assert from_ordinal(to_ordinal(*date)) == date


def test_add_days_across_month():
    assert add_days((2023, 1, 31), 1) == (2023, 2, 1)


def test_add_days_across_year():
    assert add_days((2023, 12, 31), 1) == (2024, 1, 1)


def test_add_days_negative():
    assert add_days((2024, 3, 1), -1) == (2024, 2, 29)


def test_days_between():
    assert days_between((2024, 1, 1), (2024, 3, 1)) == 60


def test_weekday_epoch():
    assert weekday(1, 1, 1) == "Monday"


def test_weekday_known():
    assert weekday(2024, 7, 4) == "Thursday"


def test_format_date():
    assert format_date(2024, 3, 9) == "2024-03-09"


def test_parse_date():
    assert parse_date("2024-03-09") == (2024, 3, 9)


def test_parse_invalid():
    with pytest.raises(ValueError):
        parse_date("2023-02-30")


def test_parse_malformed():
    with pytest.raises(ValueError):
        parse_date("2023/02/03")


def test_end_of_month():
    assert end_of_month(2024, 2) == (2024, 2, 29)


def test_quarter():
    assert [quarter(m) for m in (1, 3, 4, 12)] == [1, 1, 2, 4]
