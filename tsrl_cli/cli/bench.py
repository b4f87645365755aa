"""`tsrl bench speedup`: one workload under sync, stream and async; step time, speedup, idle, memory."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import JsonOpt, SetOpt
from tsrl_cli.config import OBJECTIVES, SCHEDULES
from tsrl_cli.errors import UsageError

bench_app = typer.Typer(name="bench", help="Benchmarks of the round engine.", no_args_is_help=True,
                        add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})

# The default workload: builtin:echo tasks, the builtin:toy policy, injected tool latency with a wide
# spread, so rollout time and learner time are of the same order on a 2-core CPU.
BENCH_SETS = [
    "name=bench_speedup", "model.policy=builtin:toy:h128:l4", "model.teacher=builtin:toy:h128:l4:teacher",
    "data.train=[builtin:echo]", "rounds=6", "rollout.prompts_per_round=4", "rollout.group_size=8",
    "rollout.max_turns=4", "rollout.max_turn_tokens=32", "rollout.max_trajectory_tokens=512",
    "rollout.tool_latency_median_s=0.5", "rollout.tool_latency_sigma=1.0", "optim.lr=1e-4",
]


BALANCE_NOTE = "3-round stream calibration runs, their first round left out"


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


@bench_app.command(
    "speedup",
    epilog="Examples:  tsrl bench speedup  ·  tsrl bench speedup --tool-latency 1.0 --spread 1.5 --rounds 8  ·  "
           "tsrl bench speedup --balance auto --schedules sync,stream --rounds 8  ·  "
           "tsrl bench speedup experiments/bench_speedup.yaml --schedules sync,stream --json",
)
def speedup(
    experiment: Annotated[str | None, typer.Argument(help="Experiment YAML (default: the builtin "
                                                          "toy workload).")] = None,
    *,
    schedules: Annotated[str, typer.Option(help="Comma-separated schedules, run in this order each repeat; "
                                           "stream-group: "
                                           "stream with learner.granularity group.")] = "sync,stream,async",
    rounds: Annotated[int | None, typer.Option(help="Rounds per run (default 6 on the toy workload).")] = None,
    warmup: Annotated[int, typer.Option(help="Rounds left out of the medians at the start of each run.")] = 1,
    repeats: Annotated[int, typer.Option(help="Cycles through the schedules (alternating runs).")] = 1,
    tool_latency: Annotated[float | None, typer.Option(help="Median injected tool latency, "
                                                            "seconds (rollout side of the balance).")] = None,
    spread: Annotated[float | None, typer.Option(help="Lognormal sigma of the injected latency "
                                                      "(duration spread).")] = None,
    hidden: Annotated[int | None, typer.Option(help="Toy policy width (learner side of the balance).")] = None,
    layers: Annotated[int | None, typer.Option(help="Toy policy depth.")] = None,
    objective: Annotated[str | None, typer.Option(help=f"{' | '.join(OBJECTIVES)}.")] = None,
    sync_batching: Annotated[str | None, typer.Option(help="How sync computes its gradient: padded (one padded batch, "
                                                           "default) | per_item (stream's own per-item "
                                                           "backwards after the last arrival: the same learner work, "
                                                           "so the speedup is overlap alone).")] = None,
    balance: Annotated[str, typer.Option(help="auto: two short calibration runs first, then the median tool latency "
                                               "at which rollout and learner work are equal on this machine "
                                               "(replaces --tool-latency) | off.")] = "off",
    seed: Annotated[int | None, typer.Option(help="Seed of every run.")] = None,
    out: Annotated[str | None, typer.Option(help="Folder for the runs (default results/bench/<name>-<time>).")] = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Run one workload under each schedule and print step time, speedup over sync, idle and memory."""
    from tsrl_cli.cli.train import TrainDisplay
    from tsrl_cli.console import console

    with cli_errors():
        from tsrl_cli.config import load_config
        from tsrl_cli.rl.bench import bench_speedup
        chosen = tuple(s.strip() for s in schedules.split(",") if s.strip())
        from tsrl_cli.rl.bench import STREAM_GROUP

        bad = [s for s in chosen if s not in (*SCHEDULES, STREAM_GROUP)]
        if bad or not chosen:
            raise UsageError(f"--schedules: {', '.join(bad) or 'none given'}: use {', '.join(SCHEDULES)} or "
                             f"{STREAM_GROUP} (stream per group; comma-separated)")
        if balance not in ("auto", "off"):
            raise UsageError(f"--balance {balance!r}: use auto or off")
        if repeats < 1 or warmup < 0:
            raise UsageError("--repeats must be >= 1 and --warmup >= 0")
        flags = {"rounds": rounds, "rollout.tool_latency_median_s": tool_latency, "rollout.tool_latency_sigma": spread,
                 "objective": objective, "seed": seed, "sync_batching": sync_batching}
        base = load_config(experiment, ([] if experiment else BENCH_SETS) + (set_ or []), flags)
        if hidden is not None or layers is not None:
            from tsrl_cli.rl.toy import TOY_PREFIX, parse_toy_spec

            if not base.model.policy.startswith(TOY_PREFIX):
                raise UsageError("--hidden/--layers size the builtin:toy policy; this experiment uses "
                                 f"{base.model.policy}")
            h, n, _ = parse_toy_spec(base.model.policy)
            h, n = hidden or h, layers or n
            base = load_config(experiment, ([] if experiment else BENCH_SETS) + (set_ or [])
                               + [f"model.policy=builtin:toy:h{h}:l{n}",
                                  f"model.teacher=builtin:toy:h{h}:l{n}:teacher"],
                               flags)
        out_root = out or f"results/bench/{base.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        display = TrainDisplay(enabled=not json_out)
        try:
            res = bench_speedup(base, out_root, schedules=chosen, repeats=repeats, warmup=warmup, progress=display,
                                balance_auto=balance == "auto")
        finally:
            display.stop()
    if json_out:
        typer.echo(json.dumps(res))
        return
    render(console, base, res)


def render(console, base, res: dict) -> None:
    from rich.table import Table

    ro = base.rollout
    latency = res.get("tool_latency_median_s", ro.tool_latency_median_s)  # --balance auto sets its own
    t = Table(title=f"tsrl bench speedup: {base.objective}, {base.model.policy}, "
                    f"{ro.prompts_per_round}x{ro.group_size} "
                    f"trajectories/round, tool latency {latency:.3g} s "
                    f"(sigma {ro.tool_latency_sigma}), "
                    f"sync batching {base.sync_batching}; "
                    f"medians of rounds {res['warmup'] + 1}-{res['rounds']}, {res['repeats']} run(s) each",
              title_justify="left")
    for col in ("schedule", "step s", "vs sync", "predicted", "idle", "busy s", "makespan s", "stale", "learner MiB",
                "acc. MiB"):
        t.add_column(col, justify="right")
    for s, d in res["schedules"].items():
        pred = d.get("predicted")
        ptxt = "n/a" if not pred or pred.get("speedup") is None else f"{pred['speedup']:.2f}x"
        if d.get("predicted_speedup_both_traces") is not None:
            ptxt = f"{d['predicted_speedup_both_traces']:.2f}x ({ptxt})"
        sp = d["speedup_vs_sync"]
        t.add_row(s, f"{d['step_time_median_s']:.2f}", "n/a" if sp is None else f"{sp:.2f}x",
                  ptxt if s == "stream" else "", f"{100 * d['learner_idle_frac']:.0f}%",
                  f"{d['learner_busy_median_s']:.2f}", f"{d['rollout_makespan_median_s']:.2f}", str(d["staleness_max"]),
                  _mib(d["peak_mem_learner_bytes"]), _mib(d["accumulator_peak_bytes"]))
    console.print(t)
    bal = res.get("balance")
    if bal:
        console.print(f"--balance auto: learner work {bal['learner_work_s']:.2f} s a round, generation "
                      f"{bal['generation_s']:.2f} s + {bal['makespan_per_latency_s']:.2f} x the median tool latency: "
                      "latency set to "
                      f"{bal['tool_latency_median_s']:.3f} s (two {BALANCE_NOTE}).", highlight=False)
    st = res["schedules"].get("stream", {})
    if "memory_overhead_bytes" in st:
        console.print(f"stream minus sync, learner peak RSS: {_mib(st['memory_overhead_bytes'])} MiB (stream's "
                      f"accumulator buffers: {_mib(st['accumulator_peak_bytes'])} MiB); learner busy time stream/sync "
                      f"{st['learner_compute_ratio']:.2f}x.", highlight=False)
        console.print("Predicted = the event model's sync time on the sync run's trace over its stream time on the "
                      "stream run's trace (in brackets: both from stream's trace alone, which prices sync's padded "
                      "batch at the per-item costs)"
                      + (f"; measured/predicted {100 * st['measured_over_predicted']:.0f} %."
                         if st.get("measured_over_predicted") else "."), highlight=False)
    pred = st.get("predicted") or {}
    if pred.get("speedup_group") is not None:
        icc = pred.get("arrival_icc")
        console.print(f"Granularity: per trajectory (stream) {pred['speedup']:.2f}x, per group "
                      f"{pred['speedup_group']:.2f}x predicted from stream's trace"
                      + (f"; within-group arrival ICC {icc:.2f}" if icc is not None else "")
                      + (" (stream-group above: measured)." if "stream-group" in res["schedules"] else "."),
                      highlight=False)
    console.print(f"runs in {res['out']}", highlight=False)
