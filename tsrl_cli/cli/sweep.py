"""`tsrl sweep`: experiments x seeds x schedules, run one after another with resume (tsrl_cli.sweep)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt, SetOpt

SWEEP_EPILOG = (
    "Config precedence per run: defaults < EXPERIMENT.yaml < --set key=value < --rounds, then the sweep sets "
    "schedule, seed and run.out. Examples:  tsrl sweep experiments/smoke/tiny_cpu.yaml --rounds 6 --dry-run  ·  "
    "tsrl sweep experiments/spread_grpo_sigma*.yaml --schedules sync,stream --out results/spread_grpo  ·  "
    "tsrl sweep experiments/budget_stream_vs_async.yaml --schedules stream,async --seeds 42,43 --json"
)


def sweep(
    experiments: Annotated[list[str], typer.Argument(help="Experiment YAML file(s); each file's `name` is its folder "
                                                          "under --out.")],
    *,
    schedules: Annotated[str, typer.Option(help="Comma-separated schedules: "
                                                "sync, stream, async.")] = "sync,stream,async",
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds, the same list for every schedule.")] = "42,43,44",
    rounds: Annotated[int | None, typer.Option(help="Rounds per run. "
                                                    "Default: each experiment file's `rounds`.")] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up rounds left out of averages (recorded in OUT/sweep.json for tsrl "
                                             "report; training ignores it).")] = 4,
    set_: SetOpt = None,
    out: Annotated[str, typer.Option(help="Results directory: "
                                          "runs go to OUT/<experiment>/<schedule>/seed<k>/.")] = "results",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and run nothing.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run experiments over schedules and seeds with resume: runs with DONE are skipped.

    Prints the plan first, then runs it through the same trainer as `tsrl train`.
    Exit codes: 0 every run done, 1 a run failed (the others still ran), 2 bad input or config.
    """
    from tsrl_cli.cli.train import TrainDisplay
    from tsrl_cli.console import console
    from tsrl_cli.rundir import sweep_path

    with cli_errors():
        from tsrl_cli.sweep import parse_schedules, parse_seeds, plan_sweep

        plan = plan_sweep(experiments, schedules=parse_schedules(schedules), seeds=parse_seeds(seeds),
                          rounds=rounds, warmup=warmup, sets=set_ or [], out=out)
    if not json_out:
        render_plan(console, plan, dry_run)
    outcomes = None
    if not dry_run:
        from tsrl_cli.sweep import run_sweep

        display = SweepDisplay(TrainDisplay(enabled=not json_out))
        try:
            with cli_errors():
                outcomes = run_sweep(plan, progress=display)
        finally:
            display.stop()
    failed = [o for o in outcomes or [] if o["outcome"] == "failed"]
    if json_out:
        typer.echo(json.dumps({**plan.as_dict(), "dry_run": dry_run, "outcomes": outcomes,
                               "sweep_file": None if dry_run else str(sweep_path(plan.out))}))
    elif outcomes is not None:
        render_outcomes(console, plan, outcomes)
    if failed:
        raise typer.Exit(1)


class SweepDisplay:
    """One line per run on stderr ("run 3/12: ..."), then the run's own progress (TrainDisplay)."""

    def __init__(self, train_display):
        self.train = train_display

    def __call__(self, ev: dict) -> None:
        if not self.train.enabled:
            return
        kind = ev["event"]
        if kind == "sweep_run":
            self.train.stop()
            self.train.console.print(f"[bold]run {ev['index']}/{ev['total']}[/bold]: {ev['experiment']} · "
                                     f"{ev['schedule']} · seed {ev['seed']} ({ev['action']}) -> {ev['run_dir']}",
                                     highlight=False, soft_wrap=True)
        elif kind == "sweep_run_end":
            self.train.stop()
            if ev["outcome"] == "failed":
                self.train.console.print(f"[red]run {ev['index']}/{ev['total']} failed:[/red] {ev['error']}",
                                         highlight=False, soft_wrap=True)
        else:
            self.train(ev)

    def stop(self) -> None:
        self.train.stop()


def render_plan(console, plan, dry_run: bool) -> None:
    from rich.table import Table

    n_todo = sum(r.action != "skip" for r in plan.runs)
    t = Table(title=f"tsrl sweep plan: {len(plan.experiments)} experiment(s) x seeds "
                    f"{','.join(map(str, plan.seeds))} x {','.join(plan.schedules)}; {n_todo} of {len(plan.runs)} "
                    f"runs to do; warm-up {plan.warmup} rounds" + (" (dry run: nothing runs)" if dry_run else ""),
              title_justify="left")
    for col in ("#", "experiment", "schedule", "seed", "rounds", "run dir", "status", "action"):
        t.add_column(col, justify="right" if col in ("#", "seed", "rounds") else "left",
                     overflow="fold" if col == "run dir" else "ellipsis")
    for i, r in enumerate(plan.runs, 1):
        action = f"resume after round {r.checkpoint}" if r.action == "resume" else r.action
        status = r.status if r.status != "partial" else f"partial ({r.rounds_done} rounds)"
        t.add_row(str(i), r.experiment, r.schedule, str(r.seed), str(r.cfg.rounds), str(r.run_dir), status, action)
    console.print(t)


def render_outcomes(console, plan, outcomes: list[dict]) -> None:
    from rich.table import Table

    from tsrl_cli.rundir import sweep_path

    t = Table(title=f"tsrl sweep: outcomes (step time: mean of rounds {plan.warmup + 1}+ per run)",
              title_justify="left")
    for col in ("experiment", "schedule", "seed", "outcome", "rounds", "step s", "wall s"):
        t.add_column(col, justify="left" if col in ("experiment", "schedule", "outcome") else "right")
    for o in outcomes:
        step = "n/a" if o["step_time_mean_s"] is None else f"{o['step_time_mean_s']:.2f}"
        wall = f"{o['sweep_wall_s']:.0f}" if "sweep_wall_s" in o else "-"
        t.add_row(o["experiment"], o["schedule"], str(o["seed"]),
                  o["outcome"] if o["outcome"] != "failed" else f"[red]failed[/red]: {o['error']}",
                  str(o["rounds_on_disk"]), step, wall)
    console.print(t)
    console.print(f"results in {plan.out} (warm-up recorded in {sweep_path(plan.out)}); next: "
                  f"tsrl report {plan.out} --warmup {plan.warmup}", highlight=False, soft_wrap=True)
