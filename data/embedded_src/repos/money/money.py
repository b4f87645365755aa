"""Money amounts in integer cents with a currency code."""


class CurrencyMismatch(Exception):
    pass


class Money:
    def __init__(self, cents, currency="EUR"):
        if not isinstance(cents, int):
            raise TypeError("cents must be an int")
        self.cents = cents
        self.currency = currency

    def __eq__(self, other):
        return isinstance(other, Money) and self.cents == other.cents and self.currency == other.currency

    def __repr__(self):
        return "Money(%d, %r)" % (self.cents, self.currency)

    def _check(self, other):
        if self.currency != other.currency:
            raise CurrencyMismatch(self.currency + " vs " + other.currency)

    def add(self, other):
        self._check(other)
        return Money(self.cents + other.cents, self.currency)

    def subtract(self, other):
        self._check(other)
        return Money(self.cents - other.cents, self.currency)

    def times(self, factor):
        """Multiply by an integer factor."""
        return Money(self.cents * factor, self.currency)

    def percent(self, pct):
        """pct percent of the amount, rounded half up to whole cents."""
        return Money((self.cents * pct + 50) // 100, self.currency)

    def is_zero(self):
        return self.cents == 0

    def is_negative(self):
        return self.cents < 0

    def less_than(self, other):
        self._check(other)
        return self.cents < other.cents

    def allocate(self, parts):
        """Split into `parts` amounts that differ by at most one cent; larger ones first."""
        if parts <= 0:
            raise ValueError("parts must be positive")
        base = self.cents // parts
        extra = self.cents % parts
        result = []
        for i in range(parts):
            if i < extra:
                result.append(Money(base + 1, self.currency))
            else:
                result.append(Money(base, self.currency))
        return result

    def split_by_ratio(self, ratios):
        """Split proportionally to integer ratios; leftover cents go to the first parts."""
        total = sum(ratios)
        if total <= 0:
            raise ValueError("ratios must sum to a positive number")
        shares = [self.cents * r // total for r in ratios]
        leftover = self.cents - sum(shares)
        for i in range(leftover):
            shares[i] += 1
        return [Money(s, self.currency) for s in shares]

    def format(self):
        sign = "-" if self.cents < 0 else ""
        cents = abs(self.cents)
        return "%s%d.%02d %s" % (sign, cents // 100, cents % 100, self.currency)


def parse(text):
    """Parse '12.34 EUR' or '-0.50 USD'."""
    amount, currency = text.split()
    negative = amount.startswith("-")
    if negative:
        amount = amount[1:]
    if "." in amount:
        whole, frac = amount.split(".")
        if len(frac) != 2:
            raise ValueError("need exactly two decimals")
    else:
        whole, frac = amount, "00"
    cents = int(whole) * 100 + int(frac)
    if negative:
        cents = -cents
    return Money(cents, currency)


def total(amounts, currency="EUR"):
    result = Money(0, currency)
    for amount in amounts:
        result = result.add(amount)
    return result


def largest(amounts):
    best = amounts[0]
    for amount in amounts[1:]:
        if best.less_than(amount):
            best = amount
    return best
