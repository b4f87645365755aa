"""`tsrl verify`: prove on your model that streaming gives the lazy gradient."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt


def verify(
    *,
    model: Annotated[str, typer.Option(help="Model: a local HuggingFace directory (save_pretrained), a hub id, or builtin:tiny.")] = "builtin:tiny",
    rollouts: Annotated[str | None, typer.Option(help="Rollouts JSONL, one trajectory per line (default: random multi-turn rollouts).")] = None,
    objective: Annotated[str, typer.Option(help="grpo or opd.")] = "grpo",
    teacher: Annotated[str | None, typer.Option(help="OPD teacher model (default: teacher_logprobs in the file, else builtin:tiny-teacher).")] = None,
    loss_agg: Annotated[str, typer.Option(help="token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm | token-sum.")] = "token-mean",
    adv_norm: Annotated[str, typer.Option(help="GRPO advantage: group = (r-mean)/(std+1e-6); center = r-mean (Dr. GRPO).")] = "group",
    kl_coef: Annotated[float, typer.Option(help="KL-to-reference loss coefficient; 0 = off. Reference: ref_logprobs in the file, else the model with seeded noise.")] = 0.0,
    kl_type: Annotated[str, typer.Option(help="KL estimator: k1 | k2 | k3 (= low_var_kl) | abs.")] = "low_var_kl",
    entropy_coef: Annotated[float, typer.Option(help="Entropy bonus coefficient; 0 = off.")] = 0.0,
    opd_form: Annotated[str, typer.Option(help="OPD loss: pg (advantage -(logp_s - logp_t), tinker/SkyRL) or k3 (direct loss, verl).")] = "pg",
    norm_constant: Annotated[float | None, typer.Option(help="Constant C for seq-mean-token-sum-norm (e.g. max response tokens).")] = None,
    global_batch_size: Annotated[int | None, typer.Option(help="B of the seq-mean-* modes (default: the round's non-empty sequences).")] = None,
    opd_coef: Annotated[float, typer.Option(help="OPD: coefficient of the per-token distillation term.")] = 1.0,
    adv_eps: Annotated[float, typer.Option(help="GRPO: epsilon added to the group's std (verl 1e-6).")] = 1e-6,
    dtype: Annotated[str, typer.Option(help="float64 (tolerance 1e-10) | float32 (1e-4) | bfloat16 (5e-2).")] = "float64",
    order: Annotated[str, typer.Option(help="Arrival order of trajectories (GRPO) or turns (OPD): random | given | reverse.")] = "random",
    seed: Annotated[int, typer.Option(help="Seed for the built-in model, random rollouts and the random order.")] = 0,
    groups: Annotated[int, typer.Option(help="Random rollouts: number of groups.")] = 4,
    group_size: Annotated[int, typer.Option(help="Random rollouts: samples per group.")] = 8,
    max_open_groups: Annotated[int | None, typer.Option(help="Cap on groups holding buffers at once; later groups are computed at their close (still exact).")] = None,
    queued: Annotated[int, typer.Option(help="Arrivals queued before the learner runs: 1 = a backward per arrival; K > 1 = what is queued is micro-batched (one backward per fold target).")] = 1,
    max_microbatch_tokens: Annotated[int | None, typer.Option(help="Cap on one backward's padded token positions (rows x longest row); default no cap.")] = None,
    buffer_dtype: Annotated[str, typer.Option(help="Streaming buffers: float32 (float64 for a float64 model) | bfloat16 (opt-in, not exact: the difference printed is its measured error).")] = "float32",
    buffer_device: Annotated[str, typer.Option(help="Streaming buffers: device (beside the parameters) | cpu (host memory).")] = "device",
    learner_devices: Annotated[str, typer.Option(help="The streaming learner's devices: cpu (one process, default), or a sharded group: cpu:N (N CPU ranks), 0-3, 0,1 (CUDA).")] = "cpu",
    save_grads: Annotated[str | None, typer.Option(help="Directory to write lazy.safetensors and stream.safetensors (parameter name -> gradient).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Compute one round's gradient lazily and by streaming, and print how far apart they are.

    Exit 0 when the max relative difference is within the dtype's tolerance, 1 when not, 2 on bad input.
    """
    from tsrl_cli.console import console, progress_printer

    with cli_errors():
        from tsrl_cli.config import LossConfig
        from tsrl_cli.verify import VerifyOptions, run_verify

        loss = LossConfig(loss_agg=loss_agg, adv_norm=adv_norm, adv_eps=adv_eps, kl_coef=kl_coef, kl_type=kl_type,
                          entropy_coef=entropy_coef, opd_form=opd_form, opd_coef=opd_coef, norm_constant=norm_constant,
                          global_batch_size=global_batch_size, max_open_groups=max_open_groups,
                          buffer_dtype=buffer_dtype, buffer_device=buffer_device)
        opts = VerifyOptions(model=model, rollouts=rollouts, objective=objective, teacher=teacher, loss=loss,
                             dtype=dtype, order=order, seed=seed, groups=groups, group_size=group_size,
                             queued=queued, max_microbatch_tokens=max_microbatch_tokens, learners=learner_devices,
                             save_grads=save_grads)
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
