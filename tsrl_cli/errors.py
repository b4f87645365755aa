"""The two kinds of failure a command reports, and their exit codes (cli/_errors.py maps them).

    UsageError       bad input, flag or config: the message names the place and the fix. Exit 2.
    OperationFailed  the input was fine and the work ran, but failed (a worker process crashed, an
                     external harness failed). Exit 1.
Anything else is a bug: one line and exit 1, the traceback with TSRL_DEBUG=1.
"""


class UsageError(Exception):
    """Bad input, bad flag or bad config: the message names the place and the fix. Exit 2."""


class ScopeError(UsageError):
    """A loss setting outside the scope where streaming is exact (docs/streaming.md, "Scope")."""


class OperationFailed(RuntimeError):
    """The operation ran and failed; the first line of the message says what, the rest is detail. Exit 1."""
