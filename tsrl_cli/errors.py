"""Errors that the CLI turns into a one-line message and exit code 2 (bad input or usage)."""


class UsageError(Exception):
    """Bad input, bad flag or bad config: the message names the place and the fix. Exit 2."""


class ScopeError(UsageError):
    """A loss setting outside the scope where streaming is exact (README, "Scope")."""
