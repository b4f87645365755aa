"""`tsrl env exec`: run one command in a fresh sandbox, exactly as the agent's bash tool would.

The command's stdout and stderr are passed through; a summary (exit code, duration, the limit
that fired, the isolation) goes to stderr. `--json` prints one document instead.
Exit codes: 0 the command ran (whatever its own exit code), 2 bad usage or no sandbox available.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from tsrl_cli.errors import UsageError

env_app = typer.Typer(
    name="env",
    help="Task environments: run commands in a sandbox.",
    no_args_is_help=True,
    add_completion=False,
)


@env_app.command(
    "exec",
    epilog="Examples:  tsrl env exec --workdir ./task -- pytest -q  ·  tsrl env exec --workdir ./task --json -- 'ls -la'",
)
def exec_(
    command: Annotated[list[str], typer.Argument(help="The command, after `--`; several words are joined with spaces and run by `bash -c`.")],
    workdir: Annotated[str, typer.Option(help="The task's starting directory; the sandbox works on a fresh copy of it.")],
    executor: Annotated[str, typer.Option(help="local (bubblewrap or unshare) or docker.")] = "local",
    image: Annotated[str | None, typer.Option(help="Docker image (docker executor).")] = None,
    timeout_s: Annotated[float, typer.Option(help="Wall-clock limit in seconds; the whole process tree is killed at it.")] = 60.0,
    allow_unisolated: Annotated[bool, typer.Option("--allow-unisolated", help="Run without isolation when neither bwrap nor unshare is available (unsafe for untrusted tasks).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")] = False,
) -> None:
    """Run COMMAND in a fresh sandbox of the task and report its output, exit code, duration and limits."""
    from tsrl_cli.console import err_console
    from tsrl_cli.sandbox import open_sandbox

    try:
        if timeout_s <= 0:
            raise UsageError(f"--timeout-s {timeout_s}: must be positive")
        with open_sandbox(workdir, executor=executor, image=image, allow_unisolated=allow_unisolated) as sb:
            if not json_out:
                err_console.print(f"[dim]sandbox: {sb.executor}, isolation {sb.isolation_summary}[/dim]",
                                  highlight=False, soft_wrap=True)
            res = sb.run(" ".join(command), timeout_s)
            isolation = sb.isolation
    except UsageError as e:
        err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if json_out:
        typer.echo(json.dumps({**res.to_dict(), "executor": executor, "isolation": isolation}))
        raise typer.Exit(0)
    sys.stdout.write(res.stdout)
    sys.stdout.flush()
    sys.stderr.write(res.stderr)
    limit = res.limit or "none"
    more = " (output truncated)" if res.truncated else ""
    err_console.print(f"exit code {res.exit_code} · {res.duration_s:.2f} s · limit fired: {limit}{more}",
                      highlight=False, soft_wrap=True)
    raise typer.Exit(0)
