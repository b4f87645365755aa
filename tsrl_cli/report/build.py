"""`tsrl report`: tables (CSV + Markdown), figures (PNG + the CSV behind each) and REPORT.md, from
whatever runs exist under a results tree, each measured number beside the paper's.

    tsrl report results --out results/report
    out/REPORT.md · out/tables/<name>.{csv,md} · out/figures/<name>.{png,csv}

Every file is written atomically (temporary file, then rename). Inputs that are missing are skipped
with a note in REPORT.md; nothing is filled in that was not measured.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.files import write_atomic
from tsrl_cli.report import bias, plots, tables
from tsrl_cli.report.aggregate import LAST_ROUND, WARMUP_ROUNDS
from tsrl_cli.report.load import Results, Run, load_results, numeric
from tsrl_cli.report.tables import Table, records, to_csv
from tsrl_cli.rundir import read_sweep

# the ThunderSyncRL technical report (2026-10-05), as this project digested it: verbatim numbers, none of
# them measured by this project.
PAPER_SETUP = "one node of 8 B200 GPUs, Qwen-3.8-27B, SWE-smith / SETA-Env tasks"
PAPER = {
    "idle": "49.5 % of step time idle (sync)",
    "step": "1313 s -> 687 s (1.9x)",
    "spread_grpo": "1.58x -> 1.95x as spread grows",
    "spread_opd": "1.73x -> 1.94x (per turn)",
    "balance": "-> 2x at exact balance; 1.64x rollout-dominated (GLM-4.7-Flash); 1.63x / 1.67x on H200 "
               "(rollout tied to learning)",
    "target": "SWE-bench Verified target in 121.3 GPU-hours instead of 233.5 (1.9x)",
    "budget": "at 128 GPU-hours, ahead of async by 1.27 to 2.47 benchmark points (4 of 4 comparisons)",
    "memory": "per-GPU peak 117.0 GB -> 122.8 GB at most",
    "predicted": "1.6 % mean error over 588 paired rows",
    "staleness": "zero staleness (every rollout bound to the round's snapshot)",
    "terminal": "Terminal Bench 4.0: 1.8x and 1.9x",
    "efficiency": "trainer efficiency leads every row, up to 45.9 % (metric not defined in the article)",
}


@dataclass(frozen=True)
class ReportOptions:
    results_dir: str = "results"
    out_dir: str | None = None  # default: <results_dir>/report
    warmup: int | None = WARMUP_ROUNDS  # None: RESULTS_DIR/sweep.json's warm-up (tsrl sweep), else WARMUP_ROUNDS
    last_round: int = LAST_ROUND
    spread_key: str = "rollout.tool_latency_sigma"  # dotted key in each run's config.yaml: the x of the spread figure
    target_reward: float | None = None
    budget_device_s: float | None = None  # device-seconds (wall seconds x devices held)
    reward_key: str = "reward_mean"
    include_partial: bool = False


def sweep_warmup(root: Path) -> int:
    """The warm-up `tsrl sweep` planned with (RESULTS_DIR/sweep.json), else the paper's 4 rounds."""
    w = read_sweep(root).get("warmup")
    return w if isinstance(w, int) and w >= 0 else WARMUP_ROUNDS


def build_report(opts: ReportOptions, progress: Callable[[str], None] = lambda m: None) -> dict:
    """Write the report; return what was written and the notes (also in REPORT.md)."""
    root = Path(opts.results_dir)
    if not root.is_dir():
        raise UsageError(f"{root}: results directory not found (expected <experiment>/<schedule>/seed<k>/ runs)")
    if opts.warmup is None:
        opts = replace(opts, warmup=sweep_warmup(root))
    if opts.warmup < 0 or opts.last_round <= opts.warmup:
        raise UsageError(f"--warmup {opts.warmup} / --last-round {opts.last_round}: need 0 <= warmup < last round")
    if opts.budget_device_s is not None and not opts.budget_device_s > 0:
        raise UsageError(f"--budget-device-s {opts.budget_device_s}: a budget is device-seconds > 0 (or leave it out "
                         "for the smallest total among each experiment's runs)")
    out = Path(opts.out_dir) if opts.out_dir else root / "report"
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file; name a directory for REPORT.md, tables/ and figures/")
    res = load_results(root, opts.include_partial)
    runs, notes = res.runs, res.notes
    progress(f"{len(runs)} runs under {root}")
    _check_discipline(runs, notes)

    have = int(res.rounds["round"].max()) if len(res.rounds) else opts.last_round
    if have < opts.last_round:  # the window [warmup+1, last_round] as the data fill it, for the notes
        notes.append(f"runs have at most {have} rounds: rounds {opts.warmup + 1}-{have} are averaged "
                     f"(the window runs to {opts.last_round})")
        opts = replace(opts, last_round=max(have, opts.warmup + 1))
    w, last = opts.warmup, opts.last_round
    progress("predicting every run's rounds from its events")
    pred, pred_notes = tables.prediction_rows(runs, w, last)
    notes += pred_notes
    paired = tables.paired_speedup_rows(pred)
    t = {tb.name: tb for tb in (
        tables.step_time_table(res, w, last), tables.idle_table(res, w, last), tables.memory_table(res, last),
        tables.target_table(res, opts.target_reward, opts.reward_key),
        tables.budget_table(res, opts.budget_device_s, opts.reward_key), tables.prediction_table(pred, paired))}
    if tables.certified(res):  # runs with run.verify_every: the exactness certificate's table
        t["certificate"] = tables.certificate_table(res, last)
    progress("what each schedule trains on")
    t["trained_vs_sampled"], bias_tasks, bias_fig = bias.bias_table(res, last)
    written = {"tables": [], "figures": []}
    for tb in t.values():
        write_atomic(out / "tables" / f"{tb.name}.csv", to_csv(tb.frame))
        write_atomic(out / "tables" / f"{tb.name}.md", tb.markdown())
        written["tables"].append(str(out / "tables" / f"{tb.name}.csv"))
    write_atomic(out / "tables" / "predicted_vs_measured_rows.csv", to_csv(pred))
    write_atomic(out / "tables" / "predicted_speedup_rows.csv", to_csv(paired))
    write_atomic(out / "tables" / "trained_vs_sampled_tasks.csv", to_csv(bias_tasks))

    spread, spread_note = tables.spread_rows(runs, t["step_time"], pred, opts.spread_key)
    gantt, gantt_what = tables.gantt_rows(runs, w)
    figures = [
        ("speedup_vs_spread", spread, plots.speedup_vs_spread, 1, spread_note),
        ("predicted_vs_measured", pred[pred["measured_s"].notna()], plots.predicted_vs_measured, 1,
         "no run has events.jsonl with measured step times"),
        ("gantt_round", gantt, plots.gantt, 2, gantt_what),
        ("reward_curves", tables.reward_curve_rows(res, opts.reward_key), plots.reward_curves, 1,
         f"no run has `{opts.reward_key}`"),
        ("reward_vs_device_s", tables.budget_curve_rows(res, t["reward_at_budget"], opts.reward_key),
         plots.reward_vs_device_s, 1, f"no budget group of two arms or more with `{opts.reward_key}` and devices"),
        ("memory", t["memory"].frame, plots.memory_bars, 1, "no run has peak_mem_learner_bytes"),
        ("trained_vs_sampled", bias_fig, plots.trained_vs_sampled, (bias_fig["schedule"].nunique(), 3),
         "no run has learner rows or a sampled tally in events.jsonl"),
    ]
    fig_md = []
    for name, frame, draw, n_axes, why in figures:
        drawable = frame if name != "memory" else frame[frame["peak_mem_learner_bytes_mean"].notna()]
        if drawable.empty:
            notes.append(f"figure {name} skipped: {why}")
            continue
        progress(f"figure {name}")
        _figure(out / "figures", name, frame, draw, n_axes)
        written["figures"].append(str(out / "figures" / f"{name}.png"))
        caption = f"{name}: {gantt_what}" if name == "gantt_round" else name
        fig_md.append(f"![{caption}](figures/{name}.png)  \n*{caption}* · data: "
                      f"[figures/{name}.csv](figures/{name}.csv)")
        if name == "speedup_vs_spread" and why:
            notes.append(why)

    report = _report_md(opts, res, t, spread, fig_md, notes)
    write_atomic(out / "REPORT.md", report)
    return {"out": str(out), "report": str(out / "REPORT.md"), "runs": len(runs),
            "experiments": sorted({r.experiment for r in runs}), **written,
            "predicted_rows": t["predicted_vs_measured"].extra["step_rows"],
            "predicted_mean_abs_error_pct": t["predicted_vs_measured"].extra["step_mape"],
            "paired_rows": t["predicted_vs_measured"].extra["paired_rows"],
            "paired_mean_abs_error_pct": t["predicted_vs_measured"].extra["paired_mape"],
            "paired_mean_abs_error_pct_sync_trace": t["predicted_vs_measured"].extra["paired_mape_sync_trace"],
            "paired_mean_abs_error_pct_stream_trace": t["predicted_vs_measured"].extra["paired_mape_stream_trace"],
            "notes": notes}


# ---------------------------------------------------------------------------- writing


def _figure(folder: Path, name: str, frame, draw, n_axes: int | tuple[int, int]) -> None:
    from matplotlib.figure import Figure  # no pyplot: an Agg canvas, no display, no global state

    if isinstance(n_axes, tuple):  # a grid (rows, columns), e.g. one row of panels per schedule
        fig = Figure(figsize=(7.0, 1.0 + 2.2 * n_axes[0]), dpi=110, layout="constrained")
        axes = fig.subplots(*n_axes, squeeze=False)
    else:
        height = 4.0 if n_axes == 1 else min(12.0, 2.0 + 0.18 * len(frame))
        fig = Figure(figsize=(7.0, height), dpi=110, layout="constrained")
        axes = fig.subplots(n_axes, 1, sharex=True) if n_axes > 1 else fig.subplots()
    draw(records(frame), axes)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(folder / f"{name}.png", buf.getvalue())
    write_atomic(folder / f"{name}.csv", to_csv(frame))


# ---------------------------------------------------------------------------- REPORT.md


def _check_discipline(runs: list[Run], notes: list[str]) -> None:
    """The paper's rule: every row of an experiment uses the same seed list."""
    seeds: dict[str, dict[str, set]] = {}
    for r in runs:
        seeds.setdefault(r.experiment, {}).setdefault(r.schedule, set()).add(r.seed)
    for exp, by in seeds.items():
        if len({frozenset(v) for v in by.values()}) > 1:
            notes.append(f"{exp}: schedules have different seed lists "
                         f"({'; '.join(f'{s}: {sorted(v)}' for s, v in by.items())}); speedups pair common seeds only")


def _rows(tb: Table, sched: str) -> dict[str, dict]:
    return {r["experiment"]: r for r in tb.records() if r["schedule"] == sched}


def _ours(t: dict[str, Table], spread: list[dict], res: Results) -> dict[str, str]:
    f, pm = tables.fmt, tables.pm
    sync, stream = _rows(t["step_time"], "sync"), _rows(t["step_time"], "stream")
    both = [e for e in sync if e in stream]
    o = {}
    o["idle"] = "; ".join(f"{e}: {pm(r, 'learner_idle_frac', 100)} %"
                          for e, r in _rows(t["learner_idle"], "sync").items()
                          if r["learner_idle_frac_mean"] is not None)
    def idle(r):  # percent, or '–'
        return f(100 * r["learner_idle_frac_mean"]) if r["learner_idle_frac_mean"] is not None else "–"

    o["step"] = "; ".join(f"{e}: {f(sync[e]['step_time_s_mean'])} s -> {f(stream[e]['step_time_s_mean'])} s "
                          f"({pm(stream[e], 'speedup')}x over the {stream[e]['sync_baseline']}, learner idle "
                          f"{idle(sync[e])} % -> {idle(stream[e])} %)"
                          for e in both if stream[e]["speedup_mean"] is not None)
    for obj in ("grpo", "opd"):
        pts = [r for r in spread if r["objective"] == obj and r["schedule"] == "stream" and r["speedup_mean"]]
        if pts:
            a, b = pts[0], pts[-1]
            o[f"spread_{obj}"] = (f"{a['spread_key']}={f(a['spread'])}: {f(a['speedup_mean'])}x -> "
                                  f"{f(b['spread'])}: {f(b['speedup_mean'])}x ({len(pts)} spreads)")
    o["balance"] = "; ".join(f"{e} (learner busy / makespan {f(stream[e]['balance_busy_over_makespan'])}): "
                             f"{f(stream[e]['speedup_mean'])}x over the {stream[e]['sync_baseline']}"
                             for e in both if stream[e]["speedup_mean"] is not None)
    tt_sync, tt_stream = _rows(t["device_hours_to_target"], "sync"), _rows(t["device_hours_to_target"], "stream")
    o["target"] = "; ".join(
        f"{e}: {f(tt_sync[e]['device_s_mean'] / 3600)} -> {f(tt_stream[e]['device_s_mean'] / 3600)} device-hours "
        f"({tt_stream[e]['device_kind']}; {f(tt_stream[e]['device_speedup_vs_sync'])}x), target "
        f"{f(tt_sync[e]['target_reward'])} {tt_sync[e]['reward_key']}" for e in tt_sync
        if e in tt_stream and tt_sync[e]["device_s_mean"] and tt_stream[e]["device_s_mean"])
    o["budget"] = _budget_claim(t["reward_at_budget"])
    m_sync, m_stream = _rows(t["memory"], "sync"), _rows(t["memory"], "stream")
    o["memory"] = "; ".join(
        f"{e}: {f(m_sync[e]['peak_mem_learner_bytes_mean'] / 1e9)} GB -> "
        f"{f(m_stream[e]['peak_mem_learner_bytes_mean'] / 1e9)} GB ({f(m_stream[e]['learner_peak_vs_sync'])}x)"
        for e in m_sync if e in m_stream and m_sync[e]["peak_mem_learner_bytes_mean"]
        and m_stream[e]["peak_mem_learner_bytes_mean"] is not None)
    x = t["predicted_vs_measured"].extra
    parts = []
    if x["paired_rows"]:
        parts.append(f"speedup from the sync trace alone: {f(x.get('paired_mape_sync_trace'))} %, from the stream "
                     f"trace alone: {f(x.get('paired_mape_stream_trace'))} %, from both traces: "
                     f"{f(x['paired_mape'])} %, over {x['paired_rows']} paired rows")
    if x["step_rows"]:
        parts.append(f"step time: {f(x['step_mape'])} % over {x['step_rows']} rounds")
    o["predicted"] = "; ".join(parts)
    rounds = res.rounds
    stale = numeric(rounds, "staleness_max")[rounds["schedule"] == "stream"].dropna()
    o["staleness"] = f"max staleness over {len(stale)} stream rounds: {f(float(stale.max()))}" if len(stale) else ""
    o["terminal"] = "not measured here: no Terminal Bench evaluation among these runs"
    o["efficiency"] = "not reproduced: the article does not define the metric"
    return o


def _budget_claim(tb: Table) -> str:
    """Per stream row: its reward at the budget against every async arm compared with it (gap in points)."""
    f, rows = tables.fmt, tb.records()
    parts = []
    for s in (r for r in rows if r["schedule"] == "stream" and r["reward_mean"] is not None):
        vs = [r for r in rows if r["schedule"] == "async" and r["vs_stream_experiment"] == s["experiment"]
              and r["budget_group"] == s["budget_group"] and r["gap_points_mean"] is not None]
        if vs:
            budget = f(s["budget_device_s"] / 3600) if s["budget_device_s"] else "–"
            parts.append(f"{s['budget_group']}: stream {f(s['reward_mean'])} vs " + ", ".join(
                f"{r['arm']} {f(r['reward_mean'])} ({r['gap_points_mean']:+.3g} percentage points of reward)"
                for r in vs)
                + f" at {budget} device-hours ({s['device_kind']})")
    return "; ".join(parts)


CLAIMS = [("idle", "Learner idle share of step time, sync"), ("step", "Step time, sync -> stream"),
          ("spread_grpo", "Speedup against duration spread, GRPO"), ("spread_opd", "Speedup against spread, OPD"),
          ("balance", "Speedup against rollout/learning balance"), ("target", "Compute to a target reward"),
          ("budget", "Reward at a fixed budget, stream vs async"), ("memory", "Peak learner memory, sync -> stream"),
          ("predicted", "Event model, predicted against measured"), ("staleness", "Staleness under stream"),
          ("terminal", "Terminal Bench speedups"), ("efficiency", "Trainer efficiency")]


def setups(runs: list[Run]) -> list[tuple[str, int]]:
    """Each distinct setup (devices, model, tasks, from the runs' own config.yaml) and how many runs had it."""
    return Counter(r.setup.label for r in runs).most_common()


def _report_md(opts: ReportOptions, res: Results, t: dict[str, Table], spread, fig_md: list[str],
               notes: list[str]) -> str:
    runs = res.runs
    ours = _ours(t, records(spread), res) if runs else {}
    seeds = sorted({r.seed for r in runs})
    ours_setups = setups(runs)
    if len(ours_setups) == 1:
        ours_label = ours_setups[0][0]
        ours_lines = [f"- **ours** (every run's config.yaml): {ours_label}."]
    else:
        ours_label = f"{len(ours_setups)} setups, listed above" if ours_setups else "no runs"
        ours_lines = ["- **ours** (each run's config.yaml):"] + [f"  - {n} run(s): {s}" for s, n in ours_setups]
    lines = [
        "# tsrl report", "",
        f"From `{opts.results_dir}`: {len(runs)} runs, {len({r.experiment for r in runs})} experiments, "
        f"schedules {', '.join(sorted({r.schedule for r in runs})) or '–'}, seeds {', '.join(map(str, seeds)) or '–'}"
        + (" (partial runs included)" if opts.include_partial else " (runs without DONE skipped)") + ".", "",
        (f"- **paper**: {PAPER_SETUP}; 40 rounds, seeds 42, 43, 44 (numbers from the ThunderSyncRL technical "
         "report, 2026-10-05; not measured here)."),
        *ours_lines,
        ("- The two columns are different hardware, models and tasks: compare shapes and ratios, not seconds. "
         "Device-hours are wall hours times the devices a run's processes held (its config's `devices`), in the "
         "kind named (cpu or cuda); the paper's are GPU-hours."),
        (f"- Rounds 1-{opts.warmup} are warm-up and excluded; rounds {opts.warmup + 1}-{opts.last_round} are "
         "averaged per seed, then mean ± std [95 % t-interval] over seeds."), "",
        "## Claims beside the paper", "",
        f"| claim | paper ({PAPER_SETUP}) | ours ({ours_label}) |", "|---|---|---|",
    ]
    for key, claim in CLAIMS:
        lines.append(f"| {claim} | {PAPER[key]} | {ours.get(key) or 'not measured: no runs with these inputs'} |")
    lines += ["", "## Tables", "", ("Each table's CSV (every column) is in `tables/`; the predicted-against-measured "
                                     "rows are in `tables/predicted_vs_measured_rows.csv` and "
                                     "`tables/predicted_speedup_rows.csv`."), ""]
    lines += [tb.markdown() for tb in t.values()]
    lines += ["## Figures", "", f"Spread axis: config key `{opts.spread_key}` (`--spread-key`).", ""]
    lines += [m + "\n" for m in fig_md] or ["No figure could be drawn.", ""]
    lines += ["## Notes", ""] + ([f"- {n}" for n in notes] or ["- none"]) + [""]
    return "\n".join(lines)
