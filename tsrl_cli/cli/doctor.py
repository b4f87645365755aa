"""`tsrl doctor [EXPERIMENT.yaml]`: what this machine offers, and what an experiment needs (tsrl_cli.doctor).

Exit codes: 0 everything the experiment needs is here (or no experiment given), 1 something is
missing (each listed with its fix), 2 bad input (missing file, bad YAML, unknown key).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt, SetOpt
from tsrl_cli.errors import UsageError

DOCTOR_EPILOG = ("Examples:  tsrl doctor  ·  tsrl doctor experiments/node8/grpo_full.yaml  ·  "
                 "tsrl doctor experiments/smoke/tiny_cpu.yaml --set devices.learner=cpu:4 --json")


def doctor(
    experiment: Annotated[str | None, typer.Argument(help="Experiment YAML to check against this machine (default: "
                                                          "none; the machine alone).")] = None,
    *,
    set_: SetOpt = None,
    out: Annotated[str | None, typer.Option("--out", help="Folder whose free disk space is reported, "
                                                          "where runs are written (default: the experiment's run.out, "
                                                          "else the current directory).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Show what this machine offers for training, and what an experiment needs from it."""
    from tsrl_cli.console import console

    with cli_errors():
        from tsrl_cli.config import load_config

        if set_ and experiment is None:
            raise UsageError("--set overrides an experiment's keys: give EXPERIMENT.yaml too")
        cfg = load_config(experiment, set_ or []) if experiment is not None else None
        from tsrl_cli.doctor import machine_facts, plan_checks, plan_notes

        facts = machine_facts(out or (cfg.run.out if cfg is not None and cfg.run.out else "."))
        checks = plan_checks(cfg, facts) if cfg is not None else []
        notes = plan_notes(cfg, facts) if cfg is not None else []
    ok = all(c.ok for c in checks)
    if json_out:
        typer.echo(json.dumps({"machine": asdict(facts), "experiment": experiment,
                               "checks": [asdict(c) for c in checks], "notes": notes, "ok": ok}))
    else:
        render(console, facts, experiment, checks, notes)
    if not ok:
        raise typer.Exit(1)


def _gib(b: int | None) -> str:
    return "unknown" if b is None else f"{b / 2**30:.1f} GiB"


def _installed(v: str | None) -> str:
    return v if v else "not installed"


def render(console, facts, experiment: str | None, checks: list, notes: list[str] = ()) -> None:
    from rich.markup import escape

    from tsrl_cli.hostcheck import numa_text

    v = facts.versions
    gpus = ", ".join(f"{g.index}: {g.name} {_gib(g.memory_bytes)}" for g in facts.gpus)
    rows = [
        ("CPU", f"{facts.cpu_cores} cores ({facts.cpu_usable} usable by this process)"),
        ("memory", _gib(facts.memory_bytes)),
        ("GPUs", f"{len(facts.gpus)} ({gpus})" if facts.gpus else "0 (torch sees no CUDA device)"),
        ("NCCL", "available" if facts.nccl else "not available"),
        ("gloo", "available" if facts.gloo else "not available"),
        ("python", v["python"]),
        ("torch", f"{v['torch']} (CUDA {v['torch_cuda']})" if v["torch_cuda"] else f"{v['torch']} (no CUDA)"),
        ("transformers", _installed(v["transformers"])),
        ("peft", _installed(v["peft"])),
        ("vllm", _installed(v["vllm"])),
        ("docker SDK", _installed(v["docker"])),
        ("Docker daemon", ("answers: " if facts.docker_daemon else "does not answer: ") + facts.docker_detail),
        ("disk free", f"{_gib(facts.disk_free_bytes)} at {facts.disk_path}"),
        ("/dev/shm", _gib(facts.shm_bytes) if facts.shm_bytes is not None else "none"),
        ("open files", "ulimit -n " + " / ".join(str(v or "unlimited") for v in facts.open_files) + " (soft / hard)"),
        ("CUDA devices", f"CUDA_VISIBLE_DEVICES={facts.cuda_visible_devices}" if facts.cuda_visible_devices is not None
         else "CUDA_VISIBLE_DEVICES unset (cuda:k is GPU k)"),
        ("GPU NUMA", ", ".join(f"{g.index}: {numa_text(g.numa_node)}" for g in facts.gpus) or "unknown (no GPU)"),
    ]
    console.print("[bold]This machine[/bold]")
    for k, val in rows:
        console.print(f"  {k:<14}{escape(val)}", highlight=False, soft_wrap=True)
    if experiment is None:
        return
    console.print(f"\n[bold]What {escape(experiment)} needs[/bold]", highlight=False)
    for c in checks:
        mark = "[green]ok[/green]     " if c.ok else "[red]MISSING[/red]"
        fix = f"; fix: {c.fix}" if c.fix else ""
        console.print(f"  {mark}  {escape(c.what)}: {escape(c.detail + fix)}", highlight=False, soft_wrap=True)
    for note in notes:
        console.print(f"  note     {escape(note)}", highlight=False, soft_wrap=True)
    missing = [c for c in checks if not c.ok]
    if missing:
        console.print(f"\n{len(missing)} of {len(checks)} needs missing (each with its fix above).", highlight=False)
    else:
        console.print(f"\nAll {len(checks)} needs are met on this machine.", highlight=False)
