"""`tsrl predict`: the event model of one round (sync, stream, async) from a trace, with what-if knobs."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt


def predict(
    *,
    trace: Annotated[str, typer.Option(help="A run directory, an events.jsonl, or a minimal trace: "
                                            "CSV/JSONL rows with finished_at_s, learner_cost_s[, round].")],
    step_s: Annotated[float | None, typer.Option(help="Optimizer step seconds per round (default: "
                                                      "the trace's step events, else 0).")] = None,
    sync_s: Annotated[float | None, typer.Option(help="Weight sync seconds per round (default: "
                                                      "the trace's weight_sync events, else 0).")] = None,
    learners: Annotated[int | None, typer.Option(help="What if: learner devices (default: "
                                                      "the trace's round_end.learners, else 1).")] = None,
    learner_speed: Annotated[float, typer.Option(help="What if: learners X times faster (item costs / X).")] = 1.0,
    tool_speed: Annotated[float, typer.Option(help="What if: rollouts X times faster (arrival times / X).")] = 1.0,
    spread: Annotated[float, typer.Option(help="What if: arrival deviations from the median arrival times X "
                                               "(clipped at 0).")] = 1.0,
    warmup: Annotated[int, typer.Option(help="Rounds 1..N are warm-up: left out of the summary when later "
                                             "rounds exist.")] = 4,
    calibration: Annotated[str | None, typer.Option(help="A calibration.json from `tsrl calibrate`: "
                                                         "predict stream from a sync run's trace with this machine's "
                                                         "fitted terms.")] = None,
    opd_unit: Annotated[str | None, typer.Option(help="OPD: stream's unit of a backward, turn or trajectory "
                                                      "(learner.opd_unit; default: the run's, turn where the "
                                                      "trace has no config.yaml). Another than the run's is a what-if, "
                                                      "priced per token position from the trace.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Predict step time under sync, stream and async, the speedup (sync / stream) and its ceiling.

    Model: sync = last arrival + work / learners + step + sync; stream = when the FIFO queue drains
    (each item on the first free learner) + step + sync; async = max(last arrival, work / learners +
    step) + sync. From a run, it also compares with the measured step time (mean abs % error).
    OPD traces: both learner.opd_unit values priced per token position (stream step time, positions).
    """
    from tsrl_cli.console import console

    with cli_errors():
        from tsrl_cli.predict import predict_trace
        from tsrl_cli.traces import load_trace

        tr = load_trace(trace)
        cal = None
        if calibration is not None:
            from tsrl_cli.report.calibrate import load_calibration

            opd = any(i.trajectory for r in tr.rounds for i in r.items)
            cal = load_calibration(calibration, "opd" if opd else "grpo")
        res = predict_trace(tr, step_s=step_s, sync_s=sync_s, learners=learners, learner_speed=learner_speed,
                            tool_speed=tool_speed, spread=spread, warmup=warmup, calibration=cal, opd_unit=opd_unit)
    if json_out:
        typer.echo(json.dumps(res))
    else:
        _render(console, res)


def _render(console, res: dict) -> None:
    from rich.table import Table

    def f(x, unit=""):
        return "–" if x is None else f"{x:.4g}{unit}"

    head = (f"tsrl predict: {res['source']} ({res['kind']}"
            + (f", recorded under {res['schedule']}" if res["schedule"] else "") + ")")
    console.print(f"[bold]{head}[/bold]", highlight=False, soft_wrap=True)
    if res.get("calibration"):
        console.print("calibrated: " + ", ".join(f"{k}={v:.4g}" for k, v in res["calibration"].items()),
                      highlight=False)
    if res["what_if"]:
        console.print("what if: " + ", ".join(f"{k}={v}" for k, v in res["what_if"].items()), highlight=False)
    rounds = res.get("rounds", [])
    if 1 < len(rounds) <= 50:
        # with what-if knobs the predictions are the what-if's; the error is always the as-traced model's
        err = "error % (as traced)" if res["what_if"] else "error %"
        t = Table(title_justify="left")
        for c in ("round", "items", "sync s", "stream s", "async s", "speedup", "measured s", err):
            t.add_column(c, justify="right")
        for r in rounds:
            t.add_row(str(r["round"]), str(r["items"]), f(r["sync_s"]), f(r["stream_s"]), f(r["async_s"]),
                      f(r["speedup"]), f(r.get("measured_s")), f(r.get("error_pct")))
        console.print(t)
    counted = res["rounds_counted"]
    what = (f"round {counted[0]}" if len(counted) == 1
            else f"mean over rounds {counted[0]}-{counted[-1]} ({len(counted)})")
    t = Table(title=what, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("rollout makespan", f(res["makespan_s"], " s"))
    t.add_row("learner work", f"{f(res['work_s'], ' s')} over {res['learners']} learner(s)")
    t.add_row("step + weight sync", f"{f(res['optimizer_step_s'], ' s')} + {f(res['weight_sync_s'], ' s')}")
    t.add_row("sync (lazy)", f(res["sync_s"], " s"))
    t.add_row("stream", f(res["stream_s"], " s"))
    t.add_row("async (1-step off-policy)", f(res["async_s"], " s"))
    t.add_row("speedup sync/stream", f"{f(res['speedup'], 'x')}  (ceiling {f(res['ceiling'], 'x')})")
    if res.get("stream_group_s") is not None:  # learner.granularity group: a group's backwards wait for its last
        t.add_row("stream, per group", f"{f(res['stream_group_s'], ' s')}  (speedup {f(res['speedup_group'], 'x')})")
    if res.get("arrival_icc") is not None:
        t.add_row("within-group arrival ICC", f"{res['arrival_icc']:.2f}  (1: a group's members finish together)")
    if res.get("opd_unit"):
        t.add_row("OPD unit", res["opd_unit"] + (f" (the run's: {res['opd_unit_recorded']})"
                                                  if res.get("opd_unit_recorded") else ""))
    teacher = res.get("teacher")
    if teacher:  # OPD: the teacher's busy time against the rollout's (`teacher` events)
        bound = f"; teacher-bound in {len(teacher['bound_rounds'])} of {len(counted)} rounds" \
            if teacher["rollout_s"] is not None else ""
        t.add_row("teacher busy", f"{f(teacher['busy_s'], ' s')} against the rollout's {f(teacher['rollout_s'], ' s')}"
                  f"{bound}; {f(teacher['positions_per_token'])} positions per trajectory token")
    if "mean_abs_error_pct" in res:
        t.add_row("measured vs predicted", f"mean abs error {res['mean_abs_error_pct']:.2f} % over "
                                           f"{res['error_rows']} rounds "
                  f"({res['measured_from']}; the model as traced, without what-if knobs)")
    console.print(t)
    units = res.get("opd_units")
    if units:
        u = Table(title=f"OPD units, priced at {units['per_position_s'] * 1e6:.3g} µs per position; lazy batch "
                        f"{units['lazy_positions']:.0f} positions, sum T_i {units['trajectory_tokens']:.0f}",
                  title_justify="left")
        for c in ("learner.opd_unit", "stream s", "positions", "/ lazy batch", "speedup"):
            u.add_column(c, justify="right")
        for name in ("trajectory", "turn"):
            x = units[name]
            u.add_row(name + (" (best)" if units["best"] == name else ""), f(x["stream_s"]), f"{x['positions']:.0f}",
                      f(x["positions_over_lazy"], "x"),
                      f(res["sync_s"] / x["stream_s"] if x["stream_s"] else None, "x"))
        console.print(u)
    elif res.get("opd_unit"):
        console.print("[dim]OPD units not priced: the trace has no learner_work positions[/dim]", highlight=False)
    if res.get("note"):
        console.print(f"[dim]{res['note']}[/dim]", highlight=False)


def calibrate(
    runs: Annotated[list[str], typer.Argument(help="Results trees of <experiment>/<schedule>/seed<k>/ runs with sync "
                                                   "and stream runs of the same experiments and seeds.")],
    *,
    out: Annotated[str, typer.Option(help="Folder for calibration.json (and the held-out evaluation).")],
    heldout_by: Annotated[str, typer.Option(help="Judge out of sample, leaving one group out: "
                                                 "seed, experiment, or none.")] = "seed",
    warmup: Annotated[int, typer.Option(help="Rounds 1..N are warm-up: not paired.")] = 4,
    spread_key: Annotated[str, typer.Option(help="Config key plotted as the spread in "
                                                 "residuals.png.")] = "rollout.tool_latency_sigma",
    json_out: JsonOpt = False,
) -> None:
    """Fit what a sync trace cannot show about stream on this machine (cost per position of a stream
    backward, a fixed cost per backward, the rollout's slowdown while the learner computes), per objective,
    on paired sync/stream rounds; with --heldout-by, report the error of predictions from the sync trace
    alone on rounds the fit did not see."""
    from tsrl_cli.console import console

    with cli_errors():
        from tsrl_cli.report.calibrate import calibrate as run

        res = run(runs, out, warmup=warmup, heldout_by=None if heldout_by == "none" else heldout_by,
                  spread_key=spread_key,
                  progress=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False) if not json_out else None)
    if json_out:
        typer.echo(json.dumps(res))
        return
    for obj, c in res["calibration"]["objectives"].items():
        console.print(f"{obj}: {c['rows']} paired rounds; cost_scale {c['cost_scale']:.3g}, per_backward_s "
                      f"{c['per_backward_s']:.3g}, rollout_slowdown {c['rollout_slowdown']:.3g}; in-sample mean abs "
                      f"error {c['fit_mean_abs_error_pct']:.2f} %", highlight=False)
    if res["heldout"]:
        for obj, h in res["heldout"]["summary"].items():
            console.print(f"held out by {res['heldout']['by']}, {obj}: "
                          f"mean abs error {h['mean_abs_error_pct']:.2f} % over "
                          f"{h['rows']} rounds (uncalibrated {h['identity_mean_abs_error_pct']:.2f} %)",
                          highlight=False)
    console.print(f"wrote {res['out']}/calibration.json", highlight=False)
