"""Closed integer intervals [start, end] and operations on lists of them."""


class Interval:
    def __init__(self, start, end):
        if start > end:
            raise ValueError("start must not be after end")
        self.start = start
        self.end = end

    def __eq__(self, other):
        return isinstance(other, Interval) and self.start == other.start and self.end == other.end

    def __repr__(self):
        return "Interval(%d, %d)" % (self.start, self.end)

    def length(self):
        """Number of integers in the interval."""
        return self.end - self.start + 1

    def contains(self, value):
        return self.start <= value <= self.end

    def overlaps(self, other):
        return self.start <= other.end and other.start <= self.end

    def touches(self, other):
        """True when the intervals overlap or are adjacent (like [1, 2] and [3, 4])."""
        return self.start <= other.end + 1 and other.start <= self.end + 1

    def intersection(self, other):
        if not self.overlaps(other):
            return None
        return Interval(max(self.start, other.start), min(self.end, other.end))

    def shift(self, offset):
        return Interval(self.start + offset, self.end + offset)


def merge(intervals):
    """Merge overlapping or adjacent intervals; the result is sorted."""
    ordered = sorted(intervals, key=lambda iv: (iv.start, iv.end))
    result = []
    for iv in ordered:
        if result and result[-1].touches(iv):
            last = result[-1]
            result[-1] = Interval(last.start, max(last.end, iv.end))
        else:
            result.append(Interval(iv.start, iv.end))
    return result


def total_length(intervals):
    """Integers covered by at least one interval."""
    return sum(iv.length() for iv in merge(intervals))


def gaps(intervals):
    """The intervals missing between the merged intervals."""
    merged = merge(intervals)
    result = []
    for i in range(1, len(merged)):
        result.append(Interval(merged[i - 1].end + 1, merged[i].start - 1))
    return result


def covering(intervals, value):
    """How many intervals contain value."""
    count = 0
    for iv in intervals:
        if iv.contains(value):
            count += 1
    return count


def parse(text):
    """Parse '1-3, 5, 7-9' into intervals."""
    result = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            left, right = part.split("-", 1)
            result.append(Interval(int(left), int(right)))
        else:
            result.append(Interval(int(part), int(part)))
    return result


def format_intervals(intervals):
    """Inverse of parse: single points are written as one number."""
    parts = []
    for iv in intervals:
        if iv.start == iv.end:
            parts.append(str(iv.start))
        else:
            parts.append("%d-%d" % (iv.start, iv.end))
    return ", ".join(parts)
