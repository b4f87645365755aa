"""Calendar arithmetic on (year, month, day) tuples, without the datetime module."""

MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def is_leap(year):
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0


def days_in_month(year, month):
    if month < 1 or month > 12:
        raise ValueError("month must be 1..12")
    if month == 2 and is_leap(year):
        return 29
    return MONTH_DAYS[month - 1]


def days_in_year(year):
    return 366 if is_leap(year) else 365


def is_valid(year, month, day):
    if month < 1 or month > 12:
        return False
    return 1 <= day <= days_in_month(year, month)


def day_of_year(year, month, day):
    """1 for January 1st."""
    total = day
    for m in range(1, month):
        total += days_in_month(year, m)
    return total


def to_ordinal(year, month, day):
    """Days since 0001-01-01, which is day 0."""
    days = 0
    for y in range(1, year):
        days += days_in_year(y)
    return days + day_of_year(year, month, day) - 1


def from_ordinal(ordinal):
    year = 1
    while ordinal >= days_in_year(year):
        ordinal -= days_in_year(year)
        year += 1
    month = 1
    while ordinal >= days_in_month(year, month):
        ordinal -= days_in_month(year, month)
        month += 1
    return (year, month, ordinal + 1)


def add_days(date, n):
    return from_ordinal(to_ordinal(*date) + n)


def days_between(start, end):
    return to_ordinal(*end) - to_ordinal(*start)


def weekday(year, month, day):
    """Name of the weekday; 0001-01-01 was a Monday."""
    return WEEKDAYS[to_ordinal(year, month, day) % 7]


def format_date(year, month, day):
    return "%04d-%02d-%02d" % (year, month, day)


def parse_date(text):
    parts = text.split("-")
    if len(parts) != 3:
        raise ValueError("expected YYYY-MM-DD")
    year, month, day = int(parts[0]), int(parts[1]), int(parts[2])
    if not is_valid(year, month, day):
        raise ValueError("no such date")
    return (year, month, day)


def end_of_month(year, month):
    return (year, month, days_in_month(year, month))


def quarter(month):
    return (month - 1) // 3 + 1
