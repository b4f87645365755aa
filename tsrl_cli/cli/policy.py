"""`tsrl policy probe`: sample a policy on tasks through the real agent loop and sandboxes."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import ChatTemplateOpt, DeviceOpt, JsonOpt, LimitOpt, OutOpt, ThinkingOpt, announce_device

policy_app = typer.Typer(name="policy", help="Inspect policies: success rate and trajectory statistics.",
                         no_args_is_help=True, add_completion=False)


@policy_app.command(
    "probe",
    epilog="Examples:  tsrl policy probe  ·  tsrl policy probe --model data/embedded_policy/teacher  ·  "
           "tsrl policy probe --tasks embedded-heldout --samples 4 --json",
)
def probe(
    *,
    model: Annotated[str, typer.Option(help="Policy directory (model + its tokenizer, as save_pretrained writes). "
                                            "Default: the embedded student; data/embedded_policy/teacher is "
                                            "the teacher.")] = "data/embedded_policy/student",
    tasks: Annotated[list[str] | None, typer.Option(help="Prepared dataset(s) to sample on (repeatable), "
                                                         "e.g. embedded_repair_train; "
                                                         "`embedded-train` (default) and `embedded-heldout` name both "
                                                         "embedded sets of a split.")] = None,
    samples: Annotated[int, typer.Option(help="Samples per task (a GRPO group).")] = 8,
    limit: LimitOpt = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed (per-request seeds derive from it).")] = 0,
    chat_template: ChatTemplateOpt = "auto",
    thinking: ThinkingOpt = False,
    device: DeviceOpt = None,
    out: OutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Print success rate, reward variance per group, turns, tokens, tool time and duration spread.

    Records go to --out (default results/probe/<model folder>); an interrupted probe resumes there.
    """
    from tsrl_cli.console import console, progress_printer
    from tsrl_cli.evals.probe import probe_policy

    with cli_errors():
        res = probe_policy(model, tasks or ["embedded-train"], samples=samples, temperature=temperature, seed=seed,
                           limit=limit, out_dir=out, device=announce_device(device), chat_template=chat_template,
                           thinking=thinking, progress=progress_printer(not json_out))
    if json_out:
        typer.echo(json.dumps(res, default=str))
        return
    res.pop("results")
    console.print(f"[bold]policy probe[/bold]: {model} on {', '.join(res['datasets'])} ({samples} samples per task, "
                  f"T={temperature}; {res['resumed_trajectories']} trajectories resumed from {res['out']})",
                  highlight=False, soft_wrap=True)
    console.print_json(json.dumps(res, default=str))
