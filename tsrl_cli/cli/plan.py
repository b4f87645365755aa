"""`tsrl plan EXPERIMENT.yaml`: each process's peak memory against its device's capacity (tsrl_cli.plan).

Exit codes: 0 every process fits, 1 something does not (named with its figures), 2 bad input (no config.json,
an unknown model type, a bad key).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt, SetOpt

PLAN_EPILOG = ("Examples:  tsrl plan experiments/node8/grpo_full.yaml  ·  "
               "tsrl plan experiments/node8/opd_full.yaml --capacity-gib 74.5 --json  ·  "
               "tsrl plan experiments/node8/grpo_lora.yaml --capacity-gib 131.3 --host-gib 1024")


def plan(
    experiment: Annotated[str, typer.Argument(help="Experiment YAML; the models' architecture "
                                                   "comes from model.policy_config / model.teacher_config, "
                                                   "else the model folders' config.json.")],
    *,
    set_: SetOpt = None,
    capacity_gib: Annotated[float | None, typer.Option(help="Memory of every CUDA device, GiB (default: "
                                                            "this machine's GPU where it has that index, "
                                                            "else an 80 GB device, 74.5 GiB).")] = None,
    host_gib: Annotated[float | None, typer.Option(help="Host memory, GiB, for CPU processes and host-memory "
                                                        "buffers (default: the experiment's devices.host_memory_gib, "
                                                        "else this machine's).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Plan an experiment's memory from its models' config.json alone: peak bytes per process, measured on fake
    tensors (no weights, no GPU), against each device's capacity."""
    from tsrl_cli.console import console

    with cli_errors():
        from tsrl_cli.config import load_config
        from tsrl_cli.plan import plan_experiment

        res = plan_experiment(load_config(experiment, set_ or []), capacity_gib=capacity_gib, host_gib=host_gib)
    if json_out:
        typer.echo(json.dumps(res))
    else:
        render(console, experiment, res)
    if not res["fits"]:
        raise typer.Exit(1)


def _gib(b: int) -> str:
    return f"{b / 2**30:.1f}"


def render(console, experiment: str, res: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"tsrl plan: {escape(experiment)}", title_justify="left")
    for col in ("process", "device", "peak GiB", "device total GiB", "capacity GiB", "fits"):
        t.add_column(col, justify="right" if "GiB" in col else "left")
    sources: dict = {}  # where each capacity comes from, once per source (a long phrase would wrap every row)
    for p in res["processes"]:
        t.add_row(p["name"], p["device"], _gib(p["peak_bytes"]), _gib(p["device_bytes"]), _gib(p["capacity_bytes"]),
                  "[green]yes[/green]" if p["fits"] else "[red]NO[/red]")
        sources.setdefault(p["capacity"], []).append(p["device"])
    console.print(t)
    for source, devices in sources.items():
        console.print(f"  capacity of {escape(', '.join(dict.fromkeys(devices)))}: {escape(source)}", highlight=False,
                      soft_wrap=True)
    shown: dict = {}
    for p in res["processes"]:  # ranks and replicas alike: their parts once
        key = (p["how"], tuple(p["parts"].items()), tuple(p["counts"].items()))
        shown.setdefault(key, []).append(p["name"])
    for (how, parts, counts), names in shown.items():
        text = ", ".join([f"{k} {_gib(v)} GiB" for k, v in parts if v] + [f"{k} {v:,}" for k, v in counts])
        console.print(f"  {escape(', '.join(names))}: {escape(how)}\n    {escape(text)}", highlight=False,
                      soft_wrap=True)
    console.print("Every process fits." if res["fits"] else "[red]Not every process fits[/red] (NO above).")
    for w in dict.fromkeys(w for p in res["processes"] for w in p.get("warnings", [])):
        console.print(f"[yellow]warning[/yellow] {escape(w)}", highlight=False, soft_wrap=True)
