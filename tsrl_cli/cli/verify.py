"""`tsrl verify`: prove on your model that streaming gives the lazy gradient.

The loss options are made from config.LossConfig (`loss_options`): one option per field, with the
field's default and its comment in config.py (and its choices) as help, so a new loss setting is a
`tsrl verify` option (and `tsrl train`'s loss.* key) with no edit here.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from dataclasses import MISSING, fields
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt
from tsrl_cli.config import OBJECTIVES, LossConfig, choices, field_help

LOSS_PANEL = "Loss (tsrl train's loss.* keys)"
# what verify adds to a loss field's own comment
LOSS_NOTES = {"kl_coef": "Reference: ref_logprobs in the rollouts file, else the model with seeded weight noise",
              "buffer_dtype": "bfloat16 is judged at bfloat16's tolerance: "
                              "the difference printed is its measured error"}


def loss_options(command):
    """`command` with its parameter `loss` replaced by one option per field of LossConfig (kebab-case,
    LossConfig's default, the field's comments and choices as help); the values reach `command` as one
    `loss=LossConfig(...)`. Typer reads the signature set here (public inspect, no click)."""
    hints, helps = typing.get_type_hints(LossConfig), field_help(LossConfig)  # hints: a choice's str, no Literal
    names = [f.name for f in fields(LossConfig)]
    for name in names:  # a choice the comment does not describe one by one: the names, from its Literal
        allowed = choices(LossConfig, name)
        if not all(c in helps.get(name, "") for c in allowed):
            helps[name] = ". ".join(h for h in (helps.get(name, ""), f"One of: {', '.join(allowed)}") if h)
    own = inspect.signature(command, eval_str=True)
    clash = set(names) & set(own.parameters)
    if clash:
        raise TypeError(f"{command.__name__}: options {sorted(clash)} are also LossConfig fields")
    generated = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                          default=f.default_factory() if f.default is MISSING else f.default, annotation=Annotated[
            hints[f.name], typer.Option(help=". ".join(h for h in (helps.get(f.name, ""), LOSS_NOTES.get(f.name, ""))
                                                       if h),
                                        rich_help_panel=LOSS_PANEL)])
        for f in fields(LossConfig)]
    params = []
    for p in own.parameters.values():
        params += generated if p.name == "loss" else [p]

    @functools.wraps(command)
    def with_loss(**kw):
        return command(loss=LossConfig(**{n: kw.pop(n) for n in names}), **kw)

    with_loss.__signature__ = own.replace(parameters=params)
    return with_loss


@loss_options
def verify(
    *,
    model: Annotated[str, typer.Option(help="Model: a local HuggingFace directory (save_pretrained), a hub id, "
                                            "or builtin:tiny.")] = "builtin:tiny",
    rollouts: Annotated[str | None, typer.Option(help="Rollouts JSONL, one trajectory per line (default: "
                                                      "random multi-turn rollouts).")] = None,
    objective: Annotated[str, typer.Option(help=f"{' or '.join(OBJECTIVES)}.")] = "grpo",
    teacher: Annotated[str | None, typer.Option(help="OPD teacher model (default: teacher_logprobs in the file, "
                                                     "else builtin:tiny-teacher).")] = None,
    loss: LossConfig,  # one option per field (loss_options)
    dtype: Annotated[str, typer.Option(help="float64 (tolerance 1e-10) | float32 (1e-4) | "
                                            "bfloat16 (5e-2).")] = "float64",
    order: Annotated[str, typer.Option(help="Arrival order of trajectories (GRPO) or turns (OPD): "
                                            "random | given | reverse.")] = "random",
    seed: Annotated[int, typer.Option(help="Seed for the built-in model, random rollouts and the random order.")] = 0,
    groups: Annotated[int, typer.Option(help="Random rollouts: number of groups.")] = 4,
    group_size: Annotated[int, typer.Option(help="Random rollouts: samples per group.")] = 8,
    queued: Annotated[int, typer.Option(help="Arrivals queued before the learner runs: 1 = a backward per arrival; "
                                             "K > 1 = what is queued is micro-batched (one backward per "
                                             "fold target).")] = 1,
    max_microbatch_tokens: Annotated[int | None, typer.Option(help="Cap on one backward's padded token positions (rows "
                                                                   "x longest row); default no cap.")] = None,
    learner_devices: Annotated[str, typer.Option(help="The streaming learner's devices: "
                                                      "cpu (one process, default), or a sharded group: "
                                                      "cpu:N (N CPU ranks), 0-3, 0,1 (CUDA).")] = "cpu",
    save_grads: Annotated[str | None, typer.Option(help="Directory to write lazy.safetensors and stream.safetensors "
                                                        "(parameter name -> gradient).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="A learner.* key of tsrl train, for the streamed "
                                                                 "side: --set learner.activation_checkpointing=true "
                                                                 "--set learner.logits_chunk_tokens=512 "
                                                                 "(repeatable).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Compute one round's gradient lazily and by streaming, and print how far apart they are.

    Exit 0 when the max relative difference is within the dtype's tolerance, 1 when not, 2 on bad input.
    """
    from tsrl_cli.console import console, progress_printer

    with cli_errors():
        from tsrl_cli.verify import VerifyOptions, learner_settings, run_verify

        opts = VerifyOptions(model=model, rollouts=rollouts, objective=objective, teacher=teacher, loss=loss,
                             dtype=dtype, order=order, seed=seed, groups=groups, group_size=group_size,
                             queued=queued, max_microbatch_tokens=max_microbatch_tokens, learners=learner_devices,
                             save_grads=save_grads, learner=learner_settings(set_ or []))
        res = run_verify(opts, progress=progress_printer(not json_out))
    if json_out:
        typer.echo(json.dumps(res))
    else:
        _render(console, res)
    raise typer.Exit(0 if res["ok"] else 1)


def _render(console, res: dict) -> None:
    from rich.table import Table

    title = f"tsrl verify: {res['objective']} · {res['loss_agg']} · {res['dtype']} · order {res['order']}"
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{res['model']} ({res['params']:,} parameters)")
    t.add_row("rollouts", f"{res['rollouts']}: {res['num_trajectories']} trajectories, {res['num_groups']} groups, "
              f"{res['num_loss_tokens']} loss tokens")
    where = f" on {res['learner_ranks']} ranks" if res["learner_ranks"] > 1 else ""
    t.add_row("stream", f"{res['num_items']} arrivals, {res['microbatches']} micro-batch(es), "
              f"{res['stream_backwards']} backward(s){where}; buffers {res['buffer_dtype']} on {res['buffer_device']}")
    learner = [k for k, on in (("activation checkpointing", res["activation_checkpointing"]),
                               (f"logits in chunks of {res['logits_chunk_tokens']}", res["logits_chunk_tokens"])) if on]
    if learner:
        t.add_row("stream learner", ", ".join(learner) + " (the lazy side: plain)")
    t.add_row("max |lazy - stream|", f"{res['max_abs_diff']:.3e}  (max |grad| {res['max_abs_grad']:.3e})")
    t.add_row("relative difference", f"{res['max_rel_diff']:.3e}  (tolerance {res['tolerance']:.0e})")
    t.add_row("worst parameter", f"{res['worst_param']}: relative {res['worst_param_rel_diff']:.3e}, "
              f"absolute {res['worst_param_abs_diff']:.3e}")
    t.add_row("open-group buffers", f"peak {res['peak_open_buffer_bytes'] / 2**20:.2f} MiB "
              f"({res['buffer_bytes_per_set'] / 2**20:.2f} MiB per parameter-sized buffer)")
    if res.get("saved_grads"):
        t.add_row("gradients saved", res["saved_grads"])
    console.print(t)
    verdict = "[green]EXACT[/green]: streaming equals the lazy gradient" if res["ok"] else \
        "[red]MISMATCH[/red]: difference above tolerance"
    console.print(verdict)
