"""`tsrl policy probe`: sample a policy on tasks through the real agent loop and sandboxes."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.errors import UsageError

policy_app = typer.Typer(name="policy", help="Inspect policies: success rate and trajectory statistics.",
                         no_args_is_help=True, add_completion=False)


TASK_ALIASES = {"embedded-train": ["embedded_repair_train", "embedded_terminal_train"],
                "embedded-heldout": ["embedded_repair_heldout", "embedded_terminal_heldout"]}


def expand_task_sets(names: list[str]) -> list[str]:
    return [n for name in names for n in TASK_ALIASES.get(name, [name])]


@policy_app.command(
    "probe",
    epilog="Examples:  tsrl policy probe  ·  tsrl policy probe --model data/embedded_policy/teacher  ·  "
           "tsrl policy probe --tasks embedded-heldout --samples 4 --json",
)
def probe(
    *,
    model: Annotated[str, typer.Option(help="Policy directory (model + ChatML tokenizer, as save_pretrained writes). Default: the embedded student; data/embedded_policy/teacher is the teacher.")] = "data/embedded_policy/student",
    tasks: Annotated[list[str] | None, typer.Option(help="Prepared dataset(s) to sample on (repeatable), e.g. embedded_repair_train; `embedded-train` (default) and `embedded-heldout` name both embedded sets of a split.")] = None,
    samples: Annotated[int, typer.Option(help="Samples per task (a GRPO group).")] = 8,
    limit: Annotated[int | None, typer.Option(help="First N tasks of each dataset (default: all).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed (per request seeds derive from it).")] = 0,
    records: Annotated[str | None, typer.Option(help="JSON-lines file of per-trajectory records, appended as each trajectory ends; run again with the same file to resume an interrupted probe (the full embedded probe is hours on 2 cores).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")] = False,
) -> None:
    """Print success rate, reward variance per group, turns, tokens, tool time and duration spread."""
    from pathlib import Path

    from tsrl_cli.console import console, err_console, progress_printer

    try:
        if samples < 1:
            raise UsageError("--samples must be >= 1")
        if not (Path(model) / "config.json").is_file():
            hint = ("the embedded default policy is built by `tsrl prepare-data embedded`" if "embedded_policy" in model
                    else "pass a directory written by save_pretrained (e.g. a tsrl train checkpoint)")
            raise UsageError(f"--model {model}: not a policy directory (no config.json); {hint}")
        tasks = expand_task_sets(tasks or ["embedded-train"])
        from dataclasses import asdict

        from tsrl_cli.agent.loop import AgentLimits
        from tsrl_cli.embedded.demos import dataset_tasks
        from tsrl_cli.embedded.sft import ProbeRecords, load_policy, policy_weights_sha256, probe_policy

        pairs = [p for name in tasks for p in dataset_tasks(name, limit)]
        limits = AgentLimits()
        log = None
        if records is not None:
            log = ProbeRecords(records, {"model_sha256": policy_weights_sha256(model), "samples": samples,
                                         "temperature": temperature, "seed": seed, "limits": asdict(limits)})
            try:
                log.load()
            except ValueError as e:
                raise UsageError(f"--records {e}") from None
            if log.prior and not json_out:
                err_console.print(f"[dim]· resuming: {len(log.prior)} trajectories already in {records}"
                                  + (" (a torn last line was dropped)" if log.dropped else "") + "[/dim]", highlight=False)
        m, tok = load_policy(model)
        show = progress_printer(not json_out)
        try:
            res = probe_policy(m, tok, pairs, samples=samples, temperature=temperature, seed=seed, limits=limits,
                               progress=lambda done, total: show(f"trajectories {done}/{total}"),
                               prior=log.prior if log else None, on_result=log.append if log else None)
        finally:
            if log is not None:
                log.close()
    except UsageError as e:
        err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    # per-trajectory records stay in --json (without their decoded text); the summary is printed
    per_traj = [{k: v for k, v in r.items() if k != "text"} for r in res.pop("results", [])]
    if json_out:
        res["results"] = per_traj
        typer.echo(json.dumps(res, default=str))
        return
    console.print(f"[bold]policy probe[/bold]: {model} on {', '.join(tasks)} ({samples} samples per task, T={temperature})",
                  highlight=False, soft_wrap=True)
    console.print_json(json.dumps(res, default=str))
