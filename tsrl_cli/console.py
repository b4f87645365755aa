"""The two consoles: results on stdout, progress/logs/errors on stderr.

Progress is shown only on a TTY and never in --json mode, so `--json` output is one document.
"""

from __future__ import annotations

import re

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console()
err_console = Console(stderr=True)

_FRACTION = re.compile(r"(\d+)/(\d+)")
_NEXT_WORD = re.compile(r"\s*[A-Za-z]*")


def progress_printer(enabled: bool):
    """A callback for library code (`progress(msg)`): a dim line per step on stderr.

    On a TTY, a message carrying a count "N/M" drives a progress bar instead (one bar per message
    shape, e.g. "validated 30/150 tasks"), so long builds show how far they are.
    """
    if not enabled:
        return lambda msg: None
    if not err_console.is_terminal:
        return lambda msg: err_console.print(f"[dim]· {msg}[/dim]", highlight=False)
    return _BarPrinter()


class _BarPrinter:
    def __init__(self):
        self._progress = None
        self._tasks: dict[str, int] = {}

    def __call__(self, msg: str) -> None:
        m = _FRACTION.search(msg)
        if m is None or int(m.group(2)) == 0:
            (self._progress.console if self._progress else err_console).print(f"[dim]· {msg}[/dim]", highlight=False)
            return
        done, total = int(m.group(1)), int(m.group(2))
        # one bar per stream of messages: the text up to the first count and the word after it ("pulled #
        # images"), so what follows (the image just pulled, a running loss) updates the bar, not a new one
        key = msg[:m.start()] + "#" + _NEXT_WORD.match(msg, m.end()).group(0)
        if self._progress is None:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=False)
            self._progress.start()
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(" ".join(key.replace("#", "").split()), total=total)
        # the description follows the message, so running figures after the count (e.g. "resolved 3/5") stay current
        desc = " ".join(_FRACTION.sub("", re.sub(r"\(\d+ s\)", "", msg), count=1).split())
        self._progress.update(self._tasks[key], completed=min(done, total), total=total, description=desc)
        if all(t.finished for t in self._progress.tasks):
            self._progress.stop()
            self._progress, self._tasks = None, {}
