"""`tsrl eval` held before a given trajectory, so that a test interrupts it at a known moment.

    python tests/evals/held_eval.py READY N -- eval embedded ...

runs `tsrl eval ...` (the same entry point as `python -m tsrl_cli`) with one change: the agent loop's
(N+1)-th trajectory creates the file READY and then awaits forever, until the run is cancelled. A test
waits for READY and sends its signal: the evaluation cannot have finished first (it is waiting), and
exactly N records are whole on disk (concurrency 1: each record is appended before the next trajectory
starts). The wait is an `await`, so SIGINT takes the same path as in an eval caught between turns.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from tsrl_cli.cli import main
from tsrl_cli.evals import runner


def hold_after(ready: Path, n: int) -> None:
    real = runner.run_agent  # an AttributeError here: the runner no longer calls the agent loop by this name
    started = 0

    async def held(*args, **kwargs):
        nonlocal started
        started += 1
        if started > n:
            ready.touch()
            await asyncio.Event().wait()  # never set: only a cancellation (SIGINT) ends it
        return await real(*args, **kwargs)

    runner.run_agent = held


if __name__ == "__main__":
    ready, n, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: held_eval.py READY N -- ARGS..."
    hold_after(Path(ready), int(n))
    # as in a terminal: a pytest started in the background by a script (`pytest &` in bash) hands its
    # children SIGINT ignored, and an eval that ignores the SIGINT finishes instead of stopping
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["tsrl", *argv]
    main()
