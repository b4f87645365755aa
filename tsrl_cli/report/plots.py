"""One function per figure: (rows, axes) -> None, drawing exactly the rows written to its CSV.

No pyplot: build.py makes a matplotlib Figure (Agg canvas) and saves it; nothing here shows a window.
"""

from __future__ import annotations

import statistics

SCHEDULE_COLOR = {"sync": "tab:gray", "stream": "tab:blue", "async": "tab:orange"}
ARM_COLORS = {"sync": ["tab:gray"], "stream": ["tab:blue", "tab:cyan"],
              "async": ["tab:orange", "tab:red", "tab:brown"]}  # per schedule, one colour per arm
# the paper's speedup against spread (ThunderSyncRL technical report; 8 B200, Qwen-3.8-27B): only the two
# ends are stated, not the spread values, so the figure draws them at the ends of our spread axis
PAPER_SPREAD = {"grpo": (1.58, 1.95), "opd": (1.73, 1.94)}
OBJECTIVE_MARKER = {"grpo": "o", "opd": "s"}
BAR_COLOR = {"rollout": "tab:green", "backward": "tab:blue", "batch_backward": "tab:blue", "step": "tab:purple",
             "weight_sync": "tab:red", "idle": "none"}


def speedup_vs_spread(rows: list[dict], ax) -> None:
    """Measured speedup over sync (mean, 95 % interval over seeds) per objective, schedule and sync baseline
    (padded lazy batch or per-item), the model's prediction from the stream traces (dashed), and the 2x
    overlap ceiling."""
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        series.setdefault((r["objective"], r["schedule"], r.get("sync_baseline")), []).append(r)
    several = len({k[2] for k in series}) > 1
    for (obj, sched, base), rs in series.items():
        rs = sorted(rs, key=lambda r: r["spread"])
        x = [r["spread"] for r in rs]
        y = [r["speedup_mean"] for r in rs]
        err = [[(r["speedup_mean"] - r["speedup_ci_low"]) if r["speedup_ci_low"] is not None else 0 for r in rs],
               [(r["speedup_ci_high"] - r["speedup_mean"]) if r["speedup_ci_high"] is not None else 0 for r in rs]]
        color = SCHEDULE_COLOR.get(sched)
        per_item = base is not None and base.startswith("per-item")
        name = f"{obj or '?'} {sched}" + (f" over the {base} sync" if several and base else "")
        ax.errorbar(x, y, yerr=err, marker="D" if per_item else "o", capsize=3, color=color,
                    mfc="white" if per_item else color, label=f"{name} (measured)")
        pred = [(r["spread"], r["predicted_speedup"]) for r in rs if r.get("predicted_speedup") is not None]
        if pred:
            ax.plot(*zip(*pred, strict=False), ls="--", marker="x", color=color, alpha=0.7, label=f"{name} (model)")
    xs = [r["spread"] for r in rows]
    for obj in dict.fromkeys(r["objective"] for r in rows if r["objective"] in PAPER_SPREAD):
        lo, hi = PAPER_SPREAD[obj]
        ax.plot([min(xs), max(xs)], [lo, hi], ls="-.", color="black", marker=OBJECTIVE_MARKER[obj], alpha=0.5,
                label=f"paper {obj}: {lo}x -> {hi}x (8 B200, 27B; its spread values not stated)")
    # 2x bounds the overlap when sync and stream do the same learner work; against a padded sync batch
    # (sync_batching padded) stream also saves the padding, and measured speedups can pass 2
    ax.axhline(2.0, color="black", ls=":", lw=1, label="2x overlap ceiling (equal learner work)")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_xlabel(rows[0]["spread_key"] if rows else "spread")
    ax.set_ylabel("speedup over sync (step time)")
    ax.legend(fontsize=7)


def predicted_vs_measured(rows: list[dict], ax) -> None:
    """Scatter of predicted against measured step time per round, coloured by schedule, with y = x."""
    pts = [r for r in rows if r.get("measured_s") is not None and r.get("predicted_s") is not None]
    for sched in dict.fromkeys(r["schedule"] for r in pts):
        rs = [r for r in pts if r["schedule"] == sched]
        ax.scatter([r["measured_s"] for r in rs], [r["predicted_s"] for r in rs], s=10,
                   color=SCHEDULE_COLOR.get(sched), label=sched)
    if pts:
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in pts)
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in pts)
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, ls="--", label="y = x")
        mape = statistics.fmean(abs(r["error_pct"]) for r in pts if r["error_pct"] is not None)
        ax.set_title(f"mean |error| {mape:.2f} % over {len(pts)} rounds", fontsize=9)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.legend(fontsize=7)


def gantt(rows: list[dict], axes) -> None:
    """One panel per schedule: learner lane on top (idle gaps hatched), one arrival bar per item."""
    for ax, sched in zip(axes, ("sync", "stream"), strict=False):
        rs = [r for r in rows if r["schedule"] == sched]
        lanes = list(dict.fromkeys(["learner"] + [r["lane"] for r in rs]))
        for r in rs:
            y = lanes.index(r["lane"])
            idle = r["kind"] == "idle"
            ax.barh(y, r["end_s"] - r["start_s"], left=r["start_s"], height=0.7,
                    color=BAR_COLOR.get(r["kind"], "tab:gray"), edgecolor="tab:red" if idle else "none",
                    hatch="//" if idle else None, lw=0.5)
        ax.set_yticks(range(len(lanes)), labels=lanes, fontsize=6)
        ax.invert_yaxis()
        ax.set_ylabel(sched)
    axes[-1].set_xlabel("seconds since round start")
    from matplotlib.patches import Patch

    handles = [Patch(color=BAR_COLOR[k], label=k) for k in ("rollout", "backward", "step", "weight_sync")]
    handles.append(Patch(facecolor="none", edgecolor="tab:red", hatch="//", label="learner idle"))
    axes[0].legend(handles=handles, fontsize=6, loc="lower right")


def reward_curves(rows: list[dict], ax) -> None:
    """Mean reward per round over seeds, with a ± std band."""
    for exp, sched in dict.fromkeys((r["experiment"], r["schedule"]) for r in rows):
        rs = [r for r in rows if r["experiment"] == exp and r["schedule"] == sched]
        x = [r["round"] for r in rs]
        m = [r["mean"] for r in rs]
        sd = [r["std"] or 0.0 for r in rs]
        line, = ax.plot(x, m, label=f"{exp} · {sched}", lw=1)
        ax.fill_between(x, [a - b for a, b in zip(m, sd, strict=False)], [a + b for a, b in zip(m, sd, strict=False)],
                        color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel(rows[0]["reward_key"] if rows else "reward")
    ax.legend(fontsize=6)


def reward_vs_device_s(rows: list[dict], ax) -> None:
    """Rolling reward against cumulative device-seconds per arm (budget_curve_rows): each seed thin, the
    mean over seeds per round thick (x: the seeds' mean device-seconds at that round, so it need not pass
    through the point), the table's reward at the budget (mean ± std over seeds) as a point, and the
    budget as a dotted line. Budget groups differ by line style."""
    groups = list(dict.fromkeys(r["budget_group"] for r in rows))
    arms = list(dict.fromkeys((r["budget_group"], r["experiment"], r["schedule"], r["arm"]) for r in rows))
    extra = {}  # further arms of one schedule in one group (async with and without TIS) get the next colour
    for g, exp, sched, arm in arms:
        k = extra[g, sched] = extra.get((g, sched), -1) + 1
        palette = ARM_COLORS.get(sched, ["tab:gray"])
        color = palette[k % len(palette)]
        ls = ("-", "--", "-.", ":")[groups.index(g) % 4]
        rs = [r for r in rows if (r["experiment"], r["schedule"]) == (exp, sched)]
        for seed in dict.fromkeys(r["seed"] for r in rs if r["what"] == "seed"):
            pts = [r for r in rs if r["what"] == "seed" and r["seed"] == seed]
            ax.plot([r["device_s"] for r in pts], [r["reward"] for r in pts], color=color, ls=ls, lw=0.5, alpha=0.35)
        mean = [r for r in rs if r["what"] == "mean"]
        label = arm if len(groups) == 1 else f"{g}: {arm}"
        ax.plot([r["device_s"] for r in mean], [r["reward"] for r in mean], color=color, ls=ls, lw=1.8,
                label=f"{label} (mean over seeds; thin: each seed)")
        n = sum(a[0] == g for a in arms)
        dodge = (arms.index((g, exp, sched, arm)) - arms.index(next(a for a in arms if a[0] == g)) - (n - 1) / 2)
        for r in (r for r in rs if r["what"] == "at budget"):  # dodged sideways by 1.5 % per arm, to stay apart
            ax.errorbar(r["device_s"] * (1 + 0.015 * dodge), r["reward"], yerr=r["reward_std"] or 0.0, fmt="o",
                        color=color, capsize=3)
    for g in groups:
        budget = next(r["budget_device_s"] for r in rows if r["budget_group"] == g)
        ax.axvline(budget, color="black", ls=":", lw=1, label="budget" if len(groups) == 1 else f"budget, {g}")
    kinds = sorted({r["device_kind"] for r in rows if r.get("device_kind")})
    ax.set_xlabel(f"cumulative device-seconds ({', '.join(kinds) or 'devices unknown'})")
    ax.set_ylabel(f"{rows[0]['reward_key'] if rows else 'reward'}, mean of the last 5 rounds")
    ax.legend(fontsize=6)


def memory_bars(rows: list[dict], ax) -> None:
    """Learner peak memory (GB) per experiment and schedule, mean with std over seeds."""
    rs = [r for r in rows if r.get("peak_mem_learner_bytes_mean") is not None]
    x = range(len(rs))
    ax.bar(x, [r["peak_mem_learner_bytes_mean"] / 1e9 for r in rs],
           yerr=[(r["peak_mem_learner_bytes_std"] or 0) / 1e9 for r in rs], capsize=3,
           color=[SCHEDULE_COLOR.get(r["schedule"], "tab:gray") for r in rs])
    ax.set_xticks(list(x), labels=[f"{r['experiment']}\n{r['schedule']}" for r in rs], fontsize=6, rotation=30)
    ax.set_ylabel("learner peak memory (GB)")


def prediction_residuals(rows: list[dict], axes, spread_key: str) -> None:
    """Held-out prediction error per round against the sync round's balance (W/M) and the spread."""
    colors = {"grpo": "tab:blue", "opd": "tab:orange"}
    for ax, key, label in ((axes[0], "balance", "balance: sync learner work / makespan (W/M)"),
                           (axes[1], "spread", spread_key)):
        for obj in dict.fromkeys(r["objective"] for r in rows):
            rs = [r for r in rows if r["objective"] == obj and r.get(key) is not None]
            ax.scatter([r[key] for r in rs], [r["error_pct"] for r in rs], s=6, alpha=0.5,
                       color=colors.get(obj), label=f"{obj} ({len(rs)} rounds)")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xlabel(label)
    axes[0].set_ylabel("predicted - measured stream step (% of measured)")
    axes[0].legend(fontsize=7)


def trained_vs_sampled(rows: list[dict], axes) -> None:
    """One row of panels per schedule (report/bias.py figure_rows): tokens per trajectory, model turns per
    trajectory and staleness, as the share of trajectories in each bin (turns and staleness: one bar per
    value); trained filled in the schedule's colour, sampled as a black outline (absent where the runs did
    not record its distribution), the means as vertical lines (sampled dashed, trained dotted)."""
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    for ax_row, sched in zip(axes, schedules, strict=False):
        color = SCHEDULE_COLOR.get(sched, "tab:gray")
        for ax, q in zip(ax_row, ("tokens", "turns", "staleness"), strict=False):
            rs = [r for r in rows if r["schedule"] == sched and r["quantity"] == q]
            trained = [r for r in rs if r["set"] == "trained" and r["kind"] == "bin"]
            sampled = [r for r in rs if r["set"] == "sampled" and r["kind"] == "bin"]
            whole = q != "tokens"  # whole numbers: bars centred on each value
            if trained:
                ax.bar([r["low"] for r in trained], [r["share"] for r in trained],
                       width=[0.8 if whole else r["high"] - r["low"] for r in trained],
                       align="center" if whole else "edge", color=color, alpha=0.6, label="trained")
            if sampled and whole:
                ax.bar([r["low"] for r in sampled], [r["share"] for r in sampled], width=0.8, fill=False,
                       edgecolor="black", lw=1, label="sampled")
            elif sampled:
                ax.stairs([r["share"] for r in sampled], [sampled[0]["low"]] + [r["high"] for r in sampled],
                          color="black", lw=1, label="sampled")
            for r in (r for r in rs if r["kind"] == "mean"):
                ax.axvline(r["value"], color="black" if r["set"] == "sampled" else color,
                           ls="--" if r["set"] == "sampled" else ":", lw=1.2, label=f"{r['set']} mean {r['value']:.3g}")
            missing = [w for w, got in (("trained", trained), ("sampled", sampled)) if not got
                       and not (w == "sampled" and q == "staleness")]  # staleness is the trained rows' own
            if missing:
                ax.set_title(f"{' and '.join(missing)}: distribution not recorded", fontsize=7)
            ax.set_xlabel({"tokens": "tokens per trajectory", "turns": "model turns per trajectory",
                           "staleness": "staleness (versions)"}[q], fontsize=7)
            if whole and (trained or sampled):
                ax.set_xticks(sorted({r["low"] for r in trained + sampled}))
            ax.tick_params(labelsize=6)
            if rs:
                ax.legend(fontsize=5)
        ax_row[0].set_ylabel(f"{sched}\nshare of trajectories", fontsize=7)
