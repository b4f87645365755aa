"""The one place where exceptions become a one-line message on stderr and an exit code."""

from __future__ import annotations

import contextlib
import os

import typer

from tsrl_cli.errors import OperationFailed, UsageError


def fail(e: Exception, code: int) -> typer.Exit:
    """Print `error: <first line>` on stderr (the whole message with TSRL_DEBUG=1) and return Exit(code)."""
    from rich.markup import escape

    from tsrl_cli.console import err_console

    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    # escaped: messages hold brackets such as tsrl[hub] that rich would read as markup
    err_console.print(f"[red]error:[/red] {escape(first)}", highlight=False, soft_wrap=True)
    if code == 1 and os.environ.get("TSRL_DEBUG"):
        err_console.print(escape(text), highlight=False, soft_wrap=True)
    elif code == 1 and text != first:
        err_console.print("[dim](set TSRL_DEBUG=1 for the full message)[/dim]")
    return typer.Exit(code)


@contextlib.contextmanager
def cli_errors():
    """Around a command's library call: UsageError -> exit 2, OperationFailed -> exit 1."""
    try:
        yield
    except UsageError as e:
        raise fail(e, 2) from None
    except OperationFailed as e:
        raise fail(e, 1) from None
