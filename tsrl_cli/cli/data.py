"""`tsrl prepare-data` and `tsrl data show|check`: task data in one record format."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt
from tsrl_cli.errors import OperationFailed, UsageError

data_app = typer.Typer(
    help="Inspect and validate prepared task data.", no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)

def prepare_data(
    source: Annotated[str, typer.Argument(help="swe-smith | seta-env | swebench-verified | terminal-bench | "
                                               "embedded | swebench-local (a small SWE-bench-format set built here, "
                                               "images included; needs Docker).")],
    *,
    from_: Annotated[str, typer.Option("--from", help="`hub` (needs network and `pip install 'tsrl\\[hub]'`) or a "
                                                      "local parquet/jsonl/json file or folder.")] = "hub",
    out: Annotated[str | None, typer.Option(help="Output folder (default data/<source>, "
                                                 "dashes as underscores).")] = None,
    allow_empty_statement: Annotated[bool, typer.Option("--allow-empty-statement",
                                                        help="Keep repair tasks whose problem statement is empty "
                                                             "(dropped by default).")] = False,
    language: Annotated[list[str] | None, typer.Option(help="Keep repair tasks in this language (repeatable; "
                                                            "from the row, else the patch's file extensions).")] = None,
    include: Annotated[list[str] | None, typer.Option(help="Keep tasks whose repo (owner/name) or, for terminal tasks, "
                                                           "task id matches this glob (repeatable).")] = None,
    exclude: Annotated[list[str] | None, typer.Option(help="Drop tasks whose repo or task id matches this glob "
                                                           "(repeatable).")] = None,
    dedupe: Annotated[bool | None, typer.Option("--dedupe/--no-dedupe",
                                                help="Drop tasks with the same patch (repair) or instruction "
                                                     "(terminal). Default: on for training sets, off for evaluation "
                                                     "sets.")] = None,
    limit: Annotated[int | None, typer.Option(help="Keep the first N tasks after all filters.")] = None,
    eval_set: Annotated[list[str] | None, typer.Option(help="Prepared evaluation set to "
                                                            "keep out of a training set (repeatable). Default: "
                                                            "every evaluation set prepared next to --out.")] = None,
    keep_eval_repos: Annotated[bool, typer.Option(help="Keep training tasks from repositories that an evaluation set "
                                                       "uses (evaluation instances are always dropped).")] = False,
    on_error: Annotated[str | None, typer.Option(help="Malformed row or task directory: "
                                                      "skip (count it) or fail (exit 2). Default: "
                                                      "fail for evaluation sets, skip for training sets.")] = None,
    seed: Annotated[int, typer.Option(help="embedded: seed of the generated suite (deterministic for a seed).")] = 0,
    policy: Annotated[bool, typer.Option("--policy/--no-policy", help="embedded: also build the default "
                                                                      "student and teacher (data/embedded_policy; "
                                                                      "about 45 min on 2 cores, kept when already "
                                                                      "built from the same data and recipe).")] = True,
    rebuild_policy: Annotated[bool, typer.Option("--rebuild-policy",
                                                 help="embedded: train the policies again even when a build of the "
                                                      "same data exists.")] = False,
    policy_out: Annotated[str | None, typer.Option(help="embedded: folder for student/ and teacher/ (default "
                                                        "<out>/embedded_policy, what `tsrl train` loads).")] = None,
    pull_images: Annotated[bool, typer.Option("--pull-images", help="Then pull every image the prepared tasks run in, "
                                                                    "as `tsrl env pull OUT` does (sized, disk-checked, "
                                                                    "a few at a time).")] = False,
    max_parallel_pulls: Annotated[int, typer.Option(help="--pull-images: pulls at once.")] = 4,
    json_out: JsonOpt = False,
) -> None:
    """Convert a public task set (hub or local files) into tsrl task records with a manifest.

    Prints the task count after each filter. Exit 0 on success, 2 on bad input (nothing is written then).
    With --pull-images the JSON document carries the pull's summary under "pull"; a pull that fails
    exits 1 (2 for an image name the registry does not know) with the records already written (`tsrl env
    pull OUT` finishes it).
    """
    from tsrl_cli.console import console, progress_printer

    with cli_errors():  # before anything is written
        if pull_images and source in ("embedded", "swebench-local"):
            raise UsageError(f"--pull-images: the {source} tasks run from local folders or images built here; "
                             "nothing to pull (leave the flag out)")
        if pull_images:
            from tsrl_cli.envs.pull import check_parallel

            check_parallel(max_parallel_pulls)
    if source == "embedded":
        return _prepare_embedded(out or "data", seed, json_out, policy, rebuild_policy, policy_out)
    if source == "swebench-local":
        return _prepare_swebench_local(out or "data/swebench_local", seed, json_out)
    with cli_errors():
        from tsrl_cli.datasets.prepare import PrepareOptions, prepare

        opts = PrepareOptions(
            source=source, origin=from_, out=out, nonempty_statement=not allow_empty_statement,
            languages=tuple(language or ()), include=tuple(include or ()), exclude=tuple(exclude or ()),
            dedupe=dedupe, limit=limit, eval_sets=tuple(eval_set) if eval_set else None,
            keep_eval_repos=keep_eval_repos, on_error=on_error,
        )
        res = prepare(opts, progress=progress_printer(not json_out))
    if not json_out:
        _render_prepare(console, res)
    if pull_images:
        with cli_errors():
            from tsrl_cli.envs.pull import pull_datasets

            try:
                res["pull"] = pull_datasets([res["out"]], parallel=max_parallel_pulls,
                                            progress=progress_printer(not json_out))
            except (UsageError, OperationFailed) as e:  # the records stay: say so, and how to finish
                raise type(e)(f"{e} (the tasks are written to {res['out']}; `tsrl env pull {res['out']}` "
                              "pulls what is missing)") from None
        if not json_out:
            p = res["pull"]
            console.print(f"{p['images']} images: {p['present']} were here, {len(p['pulled'])} pulled · "
                          f"{p['seconds']:.0f} s", highlight=False)
    if json_out:
        typer.echo(json.dumps(res))


def _prepare_embedded(out_root: str, seed: int, json_out: bool, policy: bool = True, rebuild: bool = False,
                      policy_out: str | None = None) -> None:
    """Build the shipped suite and prepare its four datasets (see tsrl_cli/embedded/prepare.py)."""
    from tsrl_cli.console import console, progress_printer

    with cli_errors():
        from tsrl_cli.embedded.prepare import prepare_embedded

        res = prepare_embedded(out_root, seed, progress=progress_printer(not json_out), build_policy=policy,
                               rebuild_policy=rebuild, policy_out=policy_out)
    if json_out:
        typer.echo(json.dumps(res))
        return
    for name, r in res.items():
        if isinstance(r, dict) and name != "policy":
            _render_prepare(console, r)
    pol = res.get("policy")
    if pol:
        state = "kept (already built from these training sets)" if pol.get("unchanged") else \
            f"trained in {pol['seconds']['total']} s"
        console.print(f"default policy: {pol['out']}/student and /teacher ({pol['params']:,} parameters each), {state}",
                      highlight=False, soft_wrap=True)
    console.print(f"embedded suite built and prepared in {res['seconds']} s", highlight=False)


def _prepare_swebench_local(out: str, seed: int, json_out: bool) -> None:
    """Build the local SWE-bench-format set and its images, then prepare it (tsrl_cli/embedded/swebench_set.py)."""
    from tsrl_cli.console import console, progress_printer

    with cli_errors():
        from tsrl_cli.embedded.swebench_set import prepare_swebench_local

        res = prepare_swebench_local(out, seed, progress=progress_printer(not json_out))
    if json_out:
        typer.echo(json.dumps(res))
        return
    _render_prepare(console, res["prepare"])
    b = res["build"]
    state = "kept (already built from the same sources)" if b["unchanged"] else f"built in {b['seconds']['total']} s"
    console.print(f"{len(b['images'])} instance images on this machine ({', '.join(b['images'].values())}); "
                  f"{state}. Check the grader: tsrl eval swebench --dataset {out} "
                  f"--grade-only {b['controls']['gold']} (all resolved; empty.jsonl and break_p2p.jsonl: none)",
                  highlight=False, soft_wrap=True)


def _render_prepare(console, res: dict) -> None:
    from rich.table import Table

    console.print(f"[bold]{res['source']}[/bold] ({res['role']} set, {res['kind']} tasks) from {res['dataset_id']}",
                  highlight=False, soft_wrap=True)
    t = Table(show_header=False)
    t.add_column()
    t.add_column(justify="right")
    for step, n in res["counts"]:
        t.add_row(step, f"{n:,}")
    console.print(t)
    bad = res["malformed"]
    if bad["count"]:
        console.print(f"skipped {bad['count']} malformed input(s); first: {bad['first'][0]['message']}",
                      highlight=False, soft_wrap=True)
    ov = res["overlaps"]
    sets = ov.get("eval_sets", ov.get("train_sets", []))
    if sets:
        verb = "removed" if "eval_sets" in ov else "found (not removed)"
        console.print(f"overlap with {', '.join(sets)}: {ov['same_instance']} same instance or text, "
                      f"{ov['same_repo']} same repo ({', '.join(ov['repos'][:5])}"
                      f"{' …' if len(ov['repos']) > 5 else ''}); {verb}: "
                      f"{ov['removed'] if 'eval_sets' in ov else ov['same_instance'] + ov['same_repo']}",
                      highlight=False, soft_wrap=True)
    state = "unchanged, nothing written" if res["unchanged"] else f"wrote {res['written']:,} task(s)"
    console.print(f"{res['out']}: {state} (revision {res['source_revision'][:19]})", highlight=False)


@data_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="Prepared dataset: a folder, or a name under data/.")],
    *,
    rows: Annotated[int, typer.Option(help="How many rows to print.")] = 3,
    json_out: JsonOpt = False,
) -> None:
    """Print a prepared dataset's source, counts, split and a few rows."""
    from tsrl_cli.console import console

    with cli_errors():
        from tsrl_cli.datasets.check import show as show_dataset

        res = show_dataset(name, rows=rows)
    if json_out:
        typer.echo(json.dumps(res))
        return
    m = res["manifest"]
    console.print(f"[bold]{res['path']}[/bold]: {res['num_tasks']:,} {m['kind']} tasks, split {m['split']} "
                  f"({m['role']} set) from {m['dataset_id']} @ {m['source_revision'][:19]}", highlight=False)
    console.print("counts: " + ", ".join(f"{s} {n:,}" for s, n in m["counts"]), highlight=False, soft_wrap=True)
    for row in res["rows"]:
        console.print(row, highlight=False, soft_wrap=True)


@data_app.command("check")
def check(
    name: Annotated[str, typer.Argument(help="Prepared dataset: a folder, or a name under data/.")],
    *,
    json_out: JsonOpt = False,
) -> None:
    """Validate a prepared dataset: file hashes, schema, required fields, task directories.

    Exit 0 when valid, 1 when problems are found, 2 when NAME is not a prepared dataset.
    """
    from tsrl_cli.console import console

    with cli_errors():
        from tsrl_cli.datasets.check import check as check_dataset

        res = check_dataset(name)
    if json_out:
        typer.echo(json.dumps(res))
    else:
        for p in res["problems"][:50]:
            console.print(f"[red]✗[/red] {p}", highlight=False, soft_wrap=True)
        verdict = "[green]OK[/green]" if res["ok"] else f"[red]{len(res['problems'])} problem(s)[/red]"
        console.print(f"{res['path']}: {res['num_tasks']:,} tasks, {verdict}", highlight=False)
    raise typer.Exit(0 if res["ok"] else 1)
