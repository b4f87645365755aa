"""The two consoles: results on stdout, progress/logs/errors on stderr.

Progress is shown only on a TTY and never in --json mode, so `--json` output is one document.
"""

from __future__ import annotations

import sys

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def progress_printer(enabled: bool):
    """A callback for library code: one dim line on stderr per step, or nothing."""
    if not enabled:
        return lambda msg: None
    return lambda msg: err_console.print(f"[dim]· {msg}[/dim]", highlight=False)


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
