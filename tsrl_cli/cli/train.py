"""`tsrl train`: RL with rollouts and learning in separate processes, one optimizer step per round."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt, SetOpt
from tsrl_cli.config import DTYPES, OBJECTIVES, LossConfig, OptimConfig, choices

TRAIN_EPILOG = (
    "Config precedence: defaults < EXPERIMENT.yaml < --set key=value < flags. "
    "Examples:  tsrl train  ·  tsrl train experiments/smoke/tiny_cpu.yaml --schedule sync --rounds 3  ·  "
    "tsrl train --objective opd --set rollout.group_size=4 --json  ·  tsrl train --resume --out results/x/stream/seed0"
)


def resolve_train_config(experiment: str | None, sets: list[str], flags: dict, resume: bool):
    """defaults < YAML < --set < flags; on --resume without a YAML, the run's own config.yaml is the YAML."""
    from tsrl_cli.config import load_config
    from tsrl_cli.rundir import RunDir

    cfg = load_config(experiment, sets, flags)
    if resume and experiment is None and (run := RunDir(cfg.run_dir())).started():
        cfg = load_config(run.config_path, sets, flags)
    return cfg


def train(
    experiment: Annotated[str | None, typer.Argument(help="Experiment YAML (overrides only; see experiments/). "
                                                          "Default: the embedded default.")] = None,
    *,
    objective: Annotated[str | None, typer.Option(help=f"{' | '.join(OBJECTIVES)}. Default grpo.")] = None,
    schedule: Annotated[str | None, typer.Option(help="sync (lazy baseline) | stream (gradient streaming) | "
                                                      "async (off-policy baseline). Default stream.")] = None,
    sync_batching: Annotated[str | None, typer.Option(help="sync only: padded (one padded batch, verl's lazy loss; "
                                                           "default) | per_item (stream's per-item backwards after the "
                                                           "last arrival).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed: prompts per round and every sampling seed derive from it. "
                                                  "Default 0.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Rounds (one optimizer step each). Default 10.")] = None,
    prompts_per_round: Annotated[int | None, typer.Option(help="Prompts (groups) per round. Default 4.")] = None,
    group_size: Annotated[int | None, typer.Option(help="Samples per prompt. Default 8.")] = None,
    dtype: Annotated[str | None, typer.Option(help=f"{' | '.join(DTYPES)} (learner, engine, teacher). "
                                                   "Default float32.")] = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate. Default 1e-4.")] = None,
    optimizer: Annotated[str | None, typer.Option(help=f"{' | '.join(choices(OptimConfig, 'optimizer'))}. "
                                                       "Default adamw.")] = None,
    grad_clip: Annotated[float | None, typer.Option(help="Max global gradient norm; 0 turns clipping off. "
                                                         "Default 1.0.")] = None,
    loss_agg: Annotated[str | None, typer.Option(help=f"{' | '.join(choices(LossConfig, 'loss_agg'))}.")] = None,
    adv_norm: Annotated[str | None, typer.Option(help="GRPO advantage: group (r-mean)/(std+1e-6) | "
                                                      "center (Dr. GRPO).")] = None,
    kl_coef: Annotated[float | None, typer.Option(help="KL-to-initial-policy loss coefficient; 0 = off.")] = None,
    max_staleness: Annotated[int | None, typer.Option(help="async: how many versions rollouts may lag the learner "
                                                           "(>= 1). Default 1.")] = None,
    tis_cap: Annotated[float | None, typer.Option(help="async: truncated importance sampling cap (e.g. 2.0); "
                                                       "default off.")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="LoRA adapter rank (PEFT); 0 = full fine-tuning (default). "
                                                       "Streaming buffers, optimizer state and weight sync then cover "
                                                       "the adapters only.")] = None,
    rollout_devices: Annotated[str | None, typer.Option(help="Device of the rollout process (policy engine): "
                                                             "cpu (default), a CUDA index like 0, or cuda:N. One "
                                                             "device (engine replicas are not implemented).")] = None,
    learner_devices: Annotated[str | None, typer.Option(help="Learner devices, one rank each: cpu (default), a CUDA "
                                                             "index (4), a range (4-7) or list (4,5,6,7) for a sharded "
                                                             "learner group on GPUs, cpu:N for N CPU ranks.")] = None,
    out: Annotated[str | None, typer.Option(help="Run directory. "
                                                 "Default results/<name>/<schedule>/seed<seed>.")] = None,
    save_every: Annotated[int | None, typer.Option(help="Checkpoint every K rounds (and round-0), for --resume. "
                                                        "Default 0: only at the end.")] = None,
    save_rollouts: Annotated[bool | None, typer.Option("--save-rollouts/--no-save-rollouts",
                                                       help="Write rollouts.jsonl.")] = None,
    base_image: Annotated[list[str] | None, typer.Option("--base-image",
                                                         help="rollout.executor docker: FROM_IMAGE=LOCAL_IMAGE, build "
                                                              "a task Dockerfile's FROM from a local image "
                                                              "(repeatable; config docker.base_images). Printed, and "
                                                              "kept in config.yaml.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in the run directory from its "
                                                          "last checkpoint.")] = False,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Train a policy with RL: rollout, teacher and learner processes, one optimizer step per round.

    Writes the run directory (docs/run-directory.md). Exit codes: 0 done, 1 the run failed, 2 bad config or missing
    data.
    """
    from tsrl_cli.console import console

    flags = {"objective": objective, "schedule": schedule, "sync_batching": sync_batching, "seed": seed,
             "rounds": rounds, "rollout.prompts_per_round": prompts_per_round, "rollout.group_size": group_size,
             "model.dtype": dtype,
             "optim.lr": lr, "optim.optimizer": optimizer, "optim.grad_clip": grad_clip, "loss.loss_agg": loss_agg,
             "loss.adv_norm": adv_norm, "loss.kl_coef": kl_coef, "offpolicy.max_staleness": max_staleness,
             "offpolicy.tis_cap": tis_cap, "lora.rank": lora_rank, "devices.rollout": rollout_devices,
             "devices.learner": learner_devices, "run.out": out, "run.save_every": save_every,
             "run.save_rollouts": save_rollouts, "docker.base_images": tuple(base_image) if base_image else None}
    with cli_errors():
        from tsrl_cli.rl.train import train as run_train

        cfg = resolve_train_config(experiment, set_ or [], flags, resume)
        display = TrainDisplay(enabled=not json_out)
        try:
            summary = run_train(cfg, resume=resume, progress=display)
        finally:
            display.stop()
    if summary is None:  # a learner rank under torchrun: global rank 0 reports the run
        return
    if json_out:
        typer.echo(json.dumps(summary))
        return
    render_summary(console, cfg, summary)


class TrainDisplay:
    """Progress on stderr: a live bar on a TTY (round, trajectories done / in flight, learner busy %),
    one plain line per round otherwise; with --json only the workers' and the preparation's `log` lines."""

    def __init__(self, enabled: bool):
        from tsrl_cli.console import err_console

        self.enabled, self.console = enabled, err_console
        self.tty = enabled and err_console.is_terminal
        self._progress = None
        self._rounds = self._trajs = None
        self.total_rounds = 0
        self._busy = 0.0
        self._round_t0 = None

    def __call__(self, ev: dict) -> None:
        kind = ev["event"]
        if not self.enabled:
            # lines for the user (FROM mapping, image builds, a dead server) reach stderr under --json too
            if kind == "log":
                self.console.print(f"· {ev['who']}: {ev['line']}", highlight=False, markup=False, soft_wrap=True)
            return
        if kind in ("start", "round"):
            self._round_t0 = time.monotonic()
        if kind == "start":
            self.total_rounds = ev["rounds"]
            self.console.print(f"[dim]· run directory {ev['run_dir']} (rounds {ev['first_round']}-{ev['rounds']}, "
                               f"{ev['trajectories_per_round']} trajectories per round)[/dim]", highlight=False)
            if self.tty:
                self._start_bars(ev)
        elif kind == "round":
            r = ev["row"]
            line = (f"round {r['round']}/{self.total_rounds}: step {r['step_time_s']:.2f} s, makespan "
                    f"{r['rollout_makespan_s']:.2f} s, learner idle {100 * r['learner_idle_frac']:.0f} %, "
                    f"reward {r['reward_mean']:.3f}, staleness {r['staleness_max']}"
                    + (f", verify_rel_diff {r['verify_rel_diff']:.1e}" if r.get("verify_rel_diff") is not None else "")
                    + (f", [yellow]environment errors {r['env_errors']}[/yellow]" if r.get("env_errors") else ""))
            if self._progress is not None:
                self._progress.console.print(f"[dim]· {line}[/dim]", highlight=False)
                self._progress.update(self._rounds, completed=r["round"])
            else:
                self.console.print(f"[dim]· {line}[/dim]", highlight=False)
        elif kind == "rollout" and self._progress is not None:
            self._progress.update(self._trajs, completed=ev["done"], total=ev["total"],
                                  description=f"round {ev['round']} trajectories ({ev['in_flight']} in flight)")
        elif kind == "learner" and self._progress is not None:
            elapsed = time.monotonic() - self._round_t0  # display clock: since the previous round ended
            busy = f"{100 * min(1.0, ev['busy_s'] / elapsed):.0f} %" if elapsed > 0 else "-"
            self._progress.update(self._rounds, description=f"rounds (learner busy {busy})")
        elif kind == "eval":
            vals = ", ".join(f"{k.split('/')[1]} {100 * v:.1f} %" for k, v in ev["metrics"].items()
                             if k.endswith("/success"))
            self.console.print(f"[dim]· held-out eval after round {ev['round']}: {vals}[/dim]", highlight=False)
        elif kind == "log":  # a worker's line for the user (a remote rollout server marked dead, ...)
            print_line = self._progress.console.print if self._progress is not None else self.console.print
            print_line(f"[yellow]· {ev['who']}: {ev['line']}[/yellow]", highlight=False, markup=True)
        elif kind == "run":
            self.console.print(f"[dim]· bench: {ev['schedule']} (repeat {ev['repeat']}) -> {ev['run_dir']}[/dim]",
                               highlight=False)

    def _start_bars(self, ev: dict) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.stop()
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=self.console, transient=True)
        self._progress.start()
        self._rounds = self._progress.add_task("rounds", total=ev["rounds"], completed=ev["first_round"] - 1)
        self._trajs = self._progress.add_task("trajectories", total=ev["trajectories_per_round"])

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _fmt(v, spec: str = ".3f", unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def render_summary(console, cfg, s: dict) -> None:
    from rich.table import Table

    from tsrl_cli.rundir import METRICS, RunDir

    rows = RunDir(s["run_dir"]).rows(METRICS)
    t = Table(title=f"tsrl train: {s['objective']} · {s['schedule']} · seed {s['seed']}"
                    + ("" if s["exact"] else " · off-policy (not exact)"), title_justify="left")
    for col in ("round", "step s", "makespan s", "learner busy s", "idle %", "staleness", "reward", "reward std"):
        t.add_column(col, justify="right")
    shown = rows if len(rows) <= 20 else rows[:5] + rows[-5:]
    for i, r in enumerate(shown):
        if len(rows) > 20 and i == 5:
            t.add_row("...", *[""] * 7)
        t.add_row(str(r["round"]), _fmt(r["step_time_s"], ".2f"), _fmt(r["rollout_makespan_s"], ".2f"),
                  _fmt(r["learner_busy_s"], ".2f"), _fmt(r["learner_idle_frac"] * 100, ".0f"),
                  str(r["staleness_max"]), _fmt(r["reward_mean"]), _fmt(r["reward_std"]))
    console.print(t)
    m = Table(show_header=False, title="summary (rounds after the first)", title_justify="left")
    m.add_column(style="bold")
    m.add_column()
    m.add_row("step time", f"median {_fmt(s['step_time_median_s'], '.2f', ' s')}, "
                           f"mean {_fmt(s['step_time_mean_s'], '.2f', ' s')}")
    idle = s["learner_idle_frac_mean"]
    m.add_row("learner idle", _fmt(None if idle is None else 100 * idle, ".0f", " %"))
    for k, v in streaming_lines(s.get("streaming")):
        m.add_row(k, v)
    m.add_row("reward", f"{_fmt(s['reward_first'])} (round 1) -> {_fmt(s['reward_last'])} (round {s['rounds']})")
    m.add_row("staleness max", str(s["staleness_max"]))
    if s.get("verify_rounds"):  # run.verify_every: every round here, not only those after the first
        share = s["verify_share_of_learner"]
        cost = _fmt(None if share is None else 100 * share, ".1f", " %")
        m.add_row("exactness certificate", f"{s['verify_rounds']} rounds, max verify_rel_diff "
                                           f"{s['verify_rel_diff_max']:.2e}, recomputation {cost} of learner busy time")
    m.add_row("wall / core seconds", f"{_fmt(s['wall_s'], '.1f')} / {_fmt(s['core_s'], '.1f')}")
    m.add_row("checkpoint", str(s["checkpoint"]))
    m.add_row("run directory", s["run_dir"])
    console.print(m)


def streaming_lines(g: dict | None) -> list[tuple[str, str]]:
    """The summary's rows on what streaming bought (tsrl_cli.predict.streaming_gain's dict)."""
    if not g:
        return []
    if g["status"] != "ok":
        what = "not compared" if g["status"] == "not_applicable" else "n/a"
        return [("streaming speedup", f"{what}: {g['reason']}")]
    own, other = g["schedule"], "sync" if g["schedule"] == "stream" else "stream"
    pred, own_pred = _fmt(g[f"predicted_{other}_step_s"], ".2f", " s"), _fmt(g[f"predicted_{own}_step_s"], ".2f", " s")
    err = "" if g["model_error_pct"] is None else f", {g['model_error_pct']:+.1f} % vs measured"
    speedup, ceiling = _fmt(g["speedup"], ".2f", "x"), _fmt(g["ceiling"], ".2f", "x")
    how = ("bought: predicted sync / measured mean step" if own == "stream"
           else "it would give: measured mean step / predicted stream")
    balance = (f"{_fmt(g['balance'], '.2f')} learner work / rollout makespan; "
               "with sync's padding the model caps the speedup")
    rows = [(f"{other} step, predicted", f"{pred} mean, event model on this run's trace (its {own}: {own_pred}{err})"),
            ("streaming speedup", f"{speedup} {how}"),
            ("balance", f"{balance} at {ceiling}")]
    if g.get("note"):
        rows.append(("note", g["note"]))
    return rows
