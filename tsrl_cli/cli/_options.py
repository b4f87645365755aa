"""Options shared by several commands (Annotated aliases), so that one flag means one thing everywhere."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout (nothing else).")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a config key: --set rollout.max_turns=4 "
                                                                "(repeatable).")]
TempOpt = Annotated[float, typer.Option(help="Sampling temperature; 0 = greedy.")]
SeedsOpt = Annotated[list[int] | None, typer.Option("--seed", help="Sampling seed (repeatable: the summary then has "
                                                                   "one row per seed). Default 0.")]
OutOpt = Annotated[str | None, typer.Option("--out", help="Output folder (default under results/, named after the "
                                                          "model); a re-run with the same settings resumes it.")]
LimitOpt = Annotated[int | None, typer.Option(help="First N tasks of each dataset (default: all).")]
ChatTemplateOpt = Annotated[str, typer.Option("--chat-template", help="The chat format the agent speaks: auto (the "
                                                                      "tokenizer's own template when it declares "
                                                                      "tools, as Qwen3's does; else ChatML) or chatml. "
                                                                      "Use the training run's model.chat_template.")]
ThinkingOpt = Annotated[bool, typer.Option("--thinking/--no-thinking",
                                           help="The template's enable_thinking (with --chat-template auto on a "
                                                "template that has it). Use the training run's rollout.thinking.")]
DeviceOpt = Annotated[str | None, typer.Option(help="Where the policy's engine runs: cpu, cuda:N or a CUDA index N. "
                                                    "Default: the first GPU when there is one, else cpu. "
                                                    "Printed on stderr at the start.")]


def announce_device(spec: str | None) -> str:
    """The engine's device (devices.engine_device: checked, or the default), printed on stderr before
    anything runs; never on stdout, so --json stays one document."""
    from tsrl_cli.console import err_console
    from tsrl_cli.devices import engine_device

    device = engine_device(spec)
    err_console.print(f"[dim]· engine device: {device}[/dim]", highlight=False)
    return device


def split_list(values: list[str] | None) -> list[str] | None:
    """Repeatable options that also take comma-separated lists."""
    return [v.strip() for x in values for v in x.split(",") if v.strip()] if values else None
