"""`tsrl env exec`: run one command in a fresh sandbox, exactly as the agent's bash tool would.

The command's stdout and stderr are passed through; a summary (exit code, duration, the limit
that fired, the isolation) goes to stderr. `--json` prints one document instead.
Exit codes: 0 the command ran (whatever its own exit code), 2 bad usage or no sandbox available,
1 the docker executor's image could not be pulled (registry unreachable, credentials refused).
`tsrl env pull`: every image the tasks of some datasets run in, pulled once (envs/pull.py).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt
from tsrl_cli.errors import UsageError

env_app = typer.Typer(
    name="env",
    help="Task environments: run commands in a sandbox.",
    no_args_is_help=True,
    add_completion=False,
)


@env_app.command(
    "exec",
    epilog="Examples:  tsrl env exec --workdir ./task -- pytest -q  ·  tsrl env exec --workdir ./task "
           "--json -- 'ls -la'",
)
def exec_(
    command: Annotated[list[str], typer.Argument(help="The command, after `--`; several words are joined with spaces "
                                                      "and run by `bash -c`.")],
    task: Annotated[str | None, typer.Option(help="Task id in --dataset: runs in that task's environment, "
                                                  "as the agent's tool does.")] = None,
    dataset: Annotated[str | None, typer.Option(help="Prepared dataset (name under data/ or a path) "
                                                     "holding --task.")] = None,
    workdir: Annotated[str | None, typer.Option(help="Instead of --task: a directory; "
                                                     "the sandbox works on a fresh copy of it.")] = None,
    executor: Annotated[str, typer.Option(help="local (bubblewrap or unshare) or docker.")] = "local",
    image: Annotated[str | None, typer.Option(help="Docker image (docker executor).")] = None,
    base_image: Annotated[list[str] | None, typer.Option("--base-image",
                                                         help="--task with --executor docker: FROM_IMAGE=LOCAL_IMAGE, "
                                                              "build the task's Dockerfile FROM a local image "
                                                              "(repeatable; as tsrl train's).")] = None,
    timeout_s: Annotated[float, typer.Option(help="Wall-clock limit in seconds; the whole process tree is "
                                                  "killed at it.")] = 60.0,
    allow_unisolated: Annotated[bool, typer.Option("--allow-unisolated",
                                                   help="Run without isolation when neither bwrap nor unshare is "
                                                        "available (unsafe for untrusted tasks).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run COMMAND in a fresh sandbox of the task and report its output, exit code, duration and limits."""
    from tsrl_cli.console import err_console
    from tsrl_cli.sandbox import open_sandbox

    with cli_errors():
        if timeout_s <= 0:
            raise UsageError(f"--timeout-s {timeout_s}: must be positive")
        if (task is None) == (workdir is None):
            raise UsageError("pass either --task ID (with --dataset NAME) or --workdir DIR")
        if task is not None:  # the task's own environment: same start state and tool as the agent's
            from tsrl_cli.envs.tasks import run_in_task

            if dataset is None:
                raise UsageError("--task needs --dataset NAME (a prepared dataset; `tsrl env list` shows them)")
            from tsrl_cli.config import parse_base_images
            from tsrl_cli.console import progress_printer

            res, isolation, summary, visible = run_in_task(
                task, dataset, " ".join(command), timeout_s, executor=executor, allow_unisolated=allow_unisolated,
                base_images=parse_base_images(base_image or []), progress=progress_printer(not json_out))
        else:
            if base_image:
                raise UsageError("--base-image: only with --task (a task's Dockerfile is built); use --image here")
            with open_sandbox(workdir, executor=executor, image=image, allow_unisolated=allow_unisolated) as sb:
                res = sb.run(" ".join(command), timeout_s)
                isolation, summary, visible = sb.isolation, sb.isolation_summary, sb.visible_roots
    if json_out:
        typer.echo(json.dumps({**res.to_dict(), "executor": executor, "isolation": isolation,
                               "visible_roots": visible}))
        raise typer.Exit(0)
    err_console.print(f"[dim]sandbox: {executor}, isolation {summary}[/dim]", highlight=False, soft_wrap=True)
    err_console.print("[dim]visible of the host: " + "; ".join(visible) + "[/dim]", highlight=False, soft_wrap=True)
    sys.stdout.write(res.stdout)
    sys.stdout.flush()
    sys.stderr.write(res.stderr)
    limit = res.limit or "none"
    more = " (output truncated)" if res.truncated else ""
    err_console.print(f"exit code {res.exit_code} · {res.duration_s:.2f} s · limit fired: {limit}{more}",
                      highlight=False, soft_wrap=True)
    raise typer.Exit(0)


@env_app.command("list", epilog="Examples:  tsrl env list  ·  tsrl env list --dataset swe_smith --json")
def list_(
    dataset: Annotated[str | None, typer.Option(help="Prepared dataset to list the tasks of (default: "
                                                     "list the datasets under data/).")] = None,
    limit: Annotated[int, typer.Option(help="Show at most this many tasks (0 = all).")] = 50,
    json_out: JsonOpt = False,
) -> None:
    """List prepared datasets, or the tasks of one (ids first)."""
    from tsrl_cli.console import console, err_console

    with cli_errors():
        from tsrl_cli.datasets.store import list_datasets, open_dataset
        from tsrl_cli.envs.images import task_image
        from tsrl_cli.envs.tasks import start_dir

        if dataset is None:
            rows = list_datasets()
            if json_out:
                typer.echo(json.dumps({"datasets": rows}))
            elif not rows:
                err_console.print("no prepared datasets under data/ (see `tsrl prepare-data --help`)")
            for r in [] if json_out else rows:
                console.print(f"{r['name']}\t{r['kind']}\t{r['tasks']} tasks\t{r['source']}", highlight=False)
            raise typer.Exit(0)
        ds = open_dataset(dataset)
        d, tasks = ds.path, ds.tasks
        shown = tasks if limit <= 0 else tasks[:limit]
        rows = [{"task_id": t.task_id, "kind": t.kind, "split": t.split,
                 "local_start": str(start_dir(d, t)) if start_dir(d, t) else None, "image": task_image(t)}
                for t in shown]
    if json_out:
        typer.echo(json.dumps({"dataset": str(d), "num_tasks": len(tasks), "tasks": rows}))
        raise typer.Exit(0)
    for r in rows:
        where = "local" if r["local_start"] else f"image {r['image']}"
        console.print(f"{r['task_id']}\t{r['kind']}\t{r['split']}\t{where}", highlight=False, soft_wrap=True)
    if len(shown) < len(tasks):
        err_console.print(f"[dim]{len(shown)} of {len(tasks)} tasks shown (--limit 0 for all)[/dim]")


@env_app.command("base-image",
                 epilog="Examples:  tsrl env base-image  ·  tsrl train ... --set rollout.executor=docker "
                        "--base-image ubuntu:24.04=$(tsrl env base-image)")
def base_image(json_out: JsonOpt = False) -> None:
    """Build (once; about a minute) or find the local Debian base image, and print its tag.

    For machines that cannot pull from a registry: a task Dockerfile's FROM can be built from it with
    `--base-image FROM=TAG` (tsrl train, tsrl eval tbench). Made with debootstrap from Debian's
    packages (python3, pytest, git, bash); needs root, debootstrap and a Docker daemon.
    Exit codes: 0 the tag is printed, 1 the build failed, 2 no Docker daemon or debootstrap.
    """
    from tsrl_cli.console import err_console

    with cli_errors():
        from tsrl_cli.sandbox.docker_client import docker_unavailable_reason
        from tsrl_cli.sandbox.images import ensure_base_image

        reason = docker_unavailable_reason()
        if reason:
            raise UsageError(f"tsrl env base-image: {reason}")
        tag = ensure_base_image(lambda m: err_console.print(f"[dim]· {m}[/dim]", highlight=False))
    typer.echo(json.dumps({"image": tag}) if json_out else tag)


@env_app.command("pull",
                 epilog="Examples:  tsrl env pull swe_smith  ·  tsrl env pull swebench_verified --dry-run --json  ·  "
                        "tsrl env pull seta_env --base-image ubuntu:24.04=$(tsrl env base-image)")
def pull(
    datasets: Annotated[list[str], typer.Argument(help="Prepared datasets (names under data/ or paths).")],
    max_parallel_pulls: Annotated[int, typer.Option(help="Pulls at once.")] = 4,
    base_image: Annotated[list[str] | None, typer.Option("--base-image",
                                                         help="FROM_IMAGE=LOCAL_IMAGE: a Dockerfile FROM built from a "
                                                              "local image is not pulled (repeatable; as tsrl "
                                                              "train's).")] = None,
    min_free_gib: Annotated[float, typer.Option(help="GiB the daemon's disk must keep free after the pulls.")] = 10.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what is missing and what it costs; "
                                                            "pull nothing.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Pull every image the datasets' tasks run in, once, before a run needs them.

    Resolves each task's image as its harness names it (SWE-bench's per-instance image, SWE-smith's
    per-repository one, a terminal task's docker_image, else the FROM images its Dockerfile is built
    from), asks each registry what the missing ones download, refuses in one line when the daemon's
    disk cannot hold them, then pulls them a few at a time with progress.
    Exit codes: 0 every image is here (or --dry-run), 1 a pull failed or the disk is too small,
    2 a bad dataset, image name or option, or no Docker daemon.
    """
    from tsrl_cli.config import parse_base_images
    from tsrl_cli.console import console, progress_printer
    from tsrl_cli.envs.pull import pull_datasets

    with cli_errors():
        res = pull_datasets(list(datasets), base_images=parse_base_images(base_image or []),
                            parallel=max_parallel_pulls,
                            min_free_gib=min_free_gib, dry_run=dry_run, progress=progress_printer(not json_out))
    if json_out:
        typer.echo(json.dumps(res))
        raise typer.Exit(0)
    if dry_run:
        for image in res["missing"]:
            size = res["sizes"].get(image)
            console.print(f"{image}\t{'unknown' if size is None else f'{size / 2**30:.2f} GiB'}", highlight=False,
                          soft_wrap=True)
    console.print(f"{res['images']} images: {res['present']} were here, {len(res['pulled'])} pulled"
                  + (f", {len(res['missing'])} missing (dry run)" if dry_run else "")
                  + f" · {res['seconds']:.0f} s", highlight=False)
