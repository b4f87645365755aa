"""Roman numerals: conversion both ways, validation and arithmetic."""

SYMBOLS = [
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
]

VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}

MAX_VALUE = 3999


def to_roman(number):
    """Return the Roman numeral for an integer between 1 and 3999."""
    if not isinstance(number, int):
        raise TypeError("number must be an int")
    if number < 1 or number > MAX_VALUE:
        raise ValueError("number out of range")
    parts = []
    for value, symbol in SYMBOLS:
        while number >= value:
            parts.append(symbol)
            number -= value
    return "".join(parts)


def to_int(numeral):
    """Return the integer value of a Roman numeral (subtractive notation allowed)."""
    if not numeral:
        raise ValueError("empty numeral")
    total = 0
    previous = 0
    for char in reversed(numeral.upper()):
        if char not in VALUES:
            raise ValueError("bad symbol: " + char)
        value = VALUES[char]
        if value < previous:
            total -= value
        else:
            total += value
            previous = value
    return total


def is_valid(numeral):
    """True when the numeral is written in canonical form."""
    try:
        value = to_int(numeral)
    except ValueError:
        return False
    if value < 1 or value > MAX_VALUE:
        return False
    return to_roman(value) == numeral.upper()


def add(a, b):
    """Add two Roman numerals and return a Roman numeral."""
    return to_roman(to_int(a) + to_int(b))


def subtract(a, b):
    """Subtract b from a; the result must stay positive."""
    result = to_int(a) - to_int(b)
    if result <= 0:
        raise ValueError("result is not positive")
    return to_roman(result)


def sort_numerals(numerals):
    """Sort numerals by value, smallest first."""
    return sorted(numerals, key=to_int)


def count_symbols(numeral):
    """How many symbols a numeral uses, e.g. 'XIV' -> 3."""
    return len(numeral.strip())


def longest_below(limit):
    """The number below `limit` whose numeral is the longest (smallest such number on ties)."""
    best = 1
    best_len = 1
    for n in range(1, limit):
        length = len(to_roman(n))
        if length > best_len:
            best = n
            best_len = length
    return best
