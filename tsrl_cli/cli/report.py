"""`tsrl report`: tables, figures and REPORT.md from the runs under a results directory."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt


def report(
    results_dir: Annotated[str, typer.Argument(help="Results tree: <experiment>/<schedule>/seed<k>/ run "
                                                    "directories.")] = "results",
    *,
    out: Annotated[str | None, typer.Option(help="Output directory (default: RESULTS_DIR/report).")] = None,
    warmup: Annotated[int | None, typer.Option(help="Warm-up rounds excluded from every average (default: "
                                                    "the `warmup` in RESULTS_DIR/sweep.json written by tsrl "
                                                    "sweep, else 4).")] = None,
    last_round: Annotated[int, typer.Option(help="Last round averaged.")] = 40,
    spread_key: Annotated[str, typer.Option(help="Dotted config.yaml key whose value is an experiment's spread (x of "
                                                 "the speedup-vs-spread figure).")] = "rollout.tool_latency_sigma",
    target_reward: Annotated[float | None, typer.Option(help="Reward target for compute-to-target (default: "
                                                             "per experiment, the highest rolling reward every "
                                                             "run reaches).")] = None,
    budget_device_s: Annotated[float | None, typer.Option(help="Budget in device-seconds (wall seconds x the devices a "
                                                               "run held, from its config) for reward-at-budget "
                                                               "(default: per budget group, the experiments of one "
                                                               "workload, the smallest total of its runs).")] = None,
    reward_key: Annotated[str, typer.Option(help="metrics.jsonl key used as the reward (e.g. "
                                                 "eval/<dataset>/success).")] = "reward_mean",
    include_partial: Annotated[bool, typer.Option("--include-partial",
                                                  help="Count runs without DONE (marked partial) instead of skipping "
                                                       "them.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Write tables (CSV + Markdown), figures (PNG + CSV) and REPORT.md, each number beside the paper's."""
    from tsrl_cli.console import console, progress_printer

    with cli_errors():
        from tsrl_cli.report.build import ReportOptions, build_report

        opts = ReportOptions(results_dir=results_dir, out_dir=out, warmup=warmup, last_round=last_round,
                             spread_key=spread_key, target_reward=target_reward, budget_device_s=budget_device_s,
                             reward_key=reward_key, include_partial=include_partial)
        res = build_report(opts, progress=progress_printer(not json_out))
    if json_out:
        typer.echo(json.dumps(res))
        return
    console.print(f"[bold]tsrl report[/bold]: {res['runs']} runs, "
                  f"{len(res['experiments'])} experiments -> {res['report']}",
                  highlight=False, soft_wrap=True)
    console.print(f"{len(res['tables'])} tables, {len(res['figures'])} figures", highlight=False)
    if res["predicted_rows"]:
        console.print(f"predicted vs measured step time: {res['predicted_mean_abs_error_pct']:.2f} % "
                      f"mean abs error over {res['predicted_rows']} rounds", highlight=False)
    for n in res["notes"]:
        console.print(f"[dim]note: {n}[/dim]", highlight=False, soft_wrap=True)
