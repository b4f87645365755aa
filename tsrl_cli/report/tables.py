"""Runs -> tables (lists of row dicts, one per experiment x schedule unless said otherwise).

Every number over seeds goes through report.aggregate (warm-up dropped, per-seed reduce, mean ±
std and 95 % t-interval over seeds). Each Table carries the markdown columns it renders; its CSV is
every key of its rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from tsrl_cli.errors import UsageError
from tsrl_cli.predict import load_trace, predict_rounds
from tsrl_cli.report.aggregate import LAST_ROUND, WARMUP_ROUNDS, aggregate, over_seeds, seed_value
from tsrl_cli.report.load import Run, config_value, flat_config, read_jsonl

SCHEDULE_ORDER = {"sync": 0, "stream": 1, "async": 2}
ROLLING_ROUNDS = 5  # the reward used for targets and budgets: mean of the last 5 rounds' reward


@dataclass
class Table:
    name: str
    title: str
    rows: list[dict]
    md: list[tuple[str, Callable[[dict], str]]]
    note: str = ""  # definitions the reader needs (target, budget, window)
    extra: dict = field(default_factory=dict)  # summary numbers for REPORT.md


# ---------------------------------------------------------------------------- formatting


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return str(x)


def pm(row: dict, prefix: str, scale: float = 1.0, digits: int = 3) -> str:
    """'mean ± std [ci_low, ci_high]' (scaled), '–' when not measured."""
    m = row.get(f"{prefix}_mean")
    if m is None:
        return "–"
    s, lo, hi = (row.get(f"{prefix}_{k}") for k in ("std", "ci_low", "ci_high"))
    out = fmt(m * scale, digits)
    if s is not None:
        out += f" ± {fmt(s * scale, 2)}"
    if lo is not None:
        out += f" [{fmt(lo * scale, digits)}, {fmt(hi * scale, digits)}]"
    return out


def _key(row: dict) -> str:
    return f"{row['experiment']} · {row['schedule']}"


# ---------------------------------------------------------------------------- grouping


def cells(runs: list[Run]) -> dict[tuple[str, str], list[Run]]:
    """(experiment, schedule) -> runs (one per seed), sync first."""
    out: dict[tuple[str, str], list[Run]] = {}
    for r in sorted(runs, key=lambda r: (r.experiment, SCHEDULE_ORDER.get(r.schedule, 9), r.schedule, r.seed)):
        out.setdefault((r.experiment, r.schedule), []).append(r)
    return out


def _base(exp: str, sched: str, rs: list[Run]) -> dict:
    return {"experiment": exp, "schedule": sched, "objective": rs[0].objective,
            "seeds": " ".join(str(r.seed) for r in rs), "n_seeds": len(rs)}


def _agg(rs: list[Run], key: str, warmup: int, last_round: int, **kw):
    return aggregate({r.seed: r.series(key) for r in rs}, warmup, last_round, **kw)


# ---------------------------------------------------------------------------- the tables


def step_time_table(runs: list[Run], warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND) -> Table:
    """Step time, speedup over sync (per seed: mean sync step / mean step, then over seeds), balance."""
    groups = cells(runs)
    rows = []
    for (exp, sched), rs in groups.items():
        st = _agg(rs, "step_time_s", warmup, last_round)
        sync_by_seed = {r.seed: r for r in groups.get((exp, "sync"), [])}
        ratios = []
        for r in rs:
            if r.seed in sync_by_seed:
                a, _ = seed_value(sync_by_seed[r.seed].series("step_time_s"), warmup, last_round)
                b, _ = seed_value(r.series("step_time_s"), warmup, last_round)
                ratios.append(a / b if a is not None and b else None)
        busy = _agg(rs, "learner_busy_s", warmup, last_round).mean
        mk = _agg(rs, "rollout_makespan_s", warmup, last_round).mean
        rows.append({**_base(exp, sched, rs), "rounds_per_seed": st.n_rounds, **st.as_row("step_time_s"),
                     **over_seeds(ratios).as_row("speedup"),
                     "learner_busy_s_mean": busy, "rollout_makespan_s_mean": mk,
                     "balance_busy_over_makespan": busy / mk if busy is not None and mk else None})
    md = [("experiment · schedule", _key), ("seeds", lambda r: r["seeds"]),
          ("rounds/seed", lambda r: str(r["rounds_per_seed"])),
          ("step time s", lambda r: pm(r, "step_time_s")),
          ("speedup vs sync", lambda r: pm(r, "speedup")),
          ("learner busy / rollout makespan", lambda r: fmt(r["balance_busy_over_makespan"]))]
    return Table("step_time", "Step time and speedup", rows, md,
                 note=f"Rounds {warmup + 1}-{last_round} averaged per seed, then mean ± std [95 % t-interval] "
                      "over seeds. Speedup per seed = mean sync step time / mean step time, same seed.")


def idle_table(runs: list[Run], warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND) -> Table:
    rows = [{**_base(e, s, rs), **_agg(rs, "learner_idle_frac", warmup, last_round).as_row("learner_idle_frac")}
            for (e, s), rs in cells(runs).items()]
    md = [("experiment · schedule", _key), ("seeds", lambda r: r["seeds"]),
          ("learner idle % of step time", lambda r: pm(r, "learner_idle_frac", scale=100))]
    return Table("learner_idle", "Learner idle fraction", rows, md,
                 note="1 - learner busy / step time, per round; rounds after the warm-up.")


MEMORY_KEYS = ("peak_mem_learner_bytes", "peak_mem_rollout_bytes", "accumulator_peak_bytes")


def memory_table(runs: list[Run], last_round: int = LAST_ROUND) -> Table:
    """Peak bytes: the max over every round of a run (warm-up included: a peak is a peak), then over seeds."""
    groups = cells(runs)
    rows = []
    for (exp, sched), rs in groups.items():
        row = _base(exp, sched, rs)
        for k in MEMORY_KEYS:
            row.update(_agg(rs, k, 0, last_round, reduce=max).as_row(k))
        sync = groups.get((exp, "sync"))
        base = _agg(sync, "peak_mem_learner_bytes", 0, last_round, reduce=max).mean if sync else None
        m = row["peak_mem_learner_bytes_mean"]
        row["learner_peak_vs_sync"] = m / base if m is not None and base else None
        rows.append(row)
    md = [("experiment · schedule", _key), ("seeds", lambda r: r["seeds"]),
          ("learner peak GB", lambda r: pm(r, "peak_mem_learner_bytes", 1e-9)),
          ("rollout peak GB", lambda r: pm(r, "peak_mem_rollout_bytes", 1e-9)),
          ("accumulator peak MB", lambda r: pm(r, "accumulator_peak_bytes", 1e-6)),
          ("learner peak / sync", lambda r: fmt(r["learner_peak_vs_sync"]))]
    return Table("memory", "Peak memory", rows, md, note="Peak over all rounds of a run (GB = 1e9 bytes), then "
                 "mean ± std [95 % t-interval] over seeds.")


def rolling(series: dict[int, float | None], window: int = ROLLING_ROUNDS) -> dict[int, float]:
    """round -> mean of the last `window` measured values up to that round (full windows only)."""
    pts = [(r, v) for r, v in sorted(series.items()) if v is not None]
    return {pts[i][0]: statistics.fmean(v for _, v in pts[i - window + 1:i + 1])
            for i in range(window - 1, len(pts))}


def target_table(runs: list[Run], target: float | None = None, reward_key: str = "reward_mean",
                 window: int = ROLLING_ROUNDS) -> Table:
    """Core-seconds (and wall seconds) until the rolling reward first reaches the target.

    Default target, per experiment: the highest rolling reward that every run reaches (the smallest
    of the runs' best), so every run has a time; it is stated in each row.
    """
    rows = []
    groups = cells(runs)
    for exp in dict.fromkeys(e for e, _ in groups):
        exp_runs = [r for (e, _), rs in groups.items() if e == exp for r in rs]
        roll = {id(r): rolling(r.series(reward_key), window) for r in exp_runs}
        t = target
        if t is None:
            bests = [max(v.values()) for v in roll.values() if v]
            t = min(bests) if bests else None
        for (e, sched), rs in groups.items():
            if e != exp:
                continue
            core, wall, reached = [], [], 0
            for r in rs:
                hit = next((k for k, v in sorted(roll[id(r)].items()) if t is not None and v >= t), None)
                reached += hit is not None
                core.append(r.rounds[hit].get("core_s") if hit is not None else None)
                wall.append(r.rounds[hit].get("wall_s") if hit is not None else None)
            rows.append({**_base(exp, sched, rs), "target_reward": t, "reward_key": reward_key,
                         "reached": reached, **over_seeds(core).as_row("core_s"), **over_seeds(wall).as_row("wall_s")})
    by = {(r["experiment"], r["schedule"]): r for r in rows}
    for r in rows:
        s = by.get((r["experiment"], "sync"), {}).get("core_s_mean")
        r["core_speedup_vs_sync"] = s / r["core_s_mean"] if s and r["core_s_mean"] else None
    md = [("experiment · schedule", _key), ("target", lambda r: fmt(r["target_reward"])),
          ("reached", lambda r: f"{r['reached']}/{r['n_seeds']}"),
          ("core-hours", lambda r: pm(r, "core_s", 1 / 3600)), ("wall s", lambda r: pm(r, "wall_s")),
          ("core-hours saved vs sync (x)", lambda r: fmt(r["core_speedup_vs_sync"]))]
    how = f"the given target {target}" if target is not None else \
        "per experiment, the highest rolling reward every run reaches"
    return Table("core_hours_to_target", "Core-hours to a target reward", rows, md,
                 note=f"First round where the mean of the last {window} rounds' `{reward_key}` reaches the target "
                      f"({how}); `core_s` there (process-seconds, the CPU analogue of GPU-seconds). "
                      "Over seeds that reached it.")


def budget_table(runs: list[Run], budget_core_s: float | None = None, reward_key: str = "reward_mean",
                 window: int = ROLLING_ROUNDS) -> Table:
    """Rolling reward at the last round whose cumulative core_s is within the budget.

    Default budget, per experiment: the smallest final core_s over its runs (every run spent it).
    """
    rows = []
    groups = cells(runs)
    for exp in dict.fromkeys(e for e, _ in groups):
        exp_runs = [r for (e, _), rs in groups.items() if e == exp for r in rs]
        b = budget_core_s
        if b is None:
            finals = [max(v for v in r.series("core_s").values() if v is not None)
                      for r in exp_runs if any(v is not None for v in r.series("core_s").values())]
            b = min(finals) if finals else None
        for (e, sched), rs in groups.items():
            if e != exp:
                continue
            vals = []
            for r in rs:
                roll, core = rolling(r.series(reward_key), window), r.series("core_s")
                within = [k for k in roll if b is not None and core.get(k) is not None and core[k] <= b]
                vals.append(roll[max(within)] if within else None)
            rows.append({**_base(exp, sched, rs), "budget_core_s": b, "reward_key": reward_key,
                         **over_seeds(vals).as_row("reward")})
    md = [("experiment · schedule", _key), ("budget core-hours", lambda r: fmt(r["budget_core_s"] / 3600
                                                                              if r["budget_core_s"] else None)),
          ("reward at budget", lambda r: pm(r, "reward"))]
    how = f"{budget_core_s} core-s" if budget_core_s is not None else \
        "per experiment, the smallest total core_s of its runs"
    return Table("reward_at_budget", "Reward at a fixed compute budget", rows, md,
                 note=f"Mean of the last {window} rounds' `{reward_key}` at the last round within the budget "
                      f"({how}).")


# ---------------------------------------------------------------------------- predicted against measured


def prediction_rows(runs: list[Run], warmup: int = WARMUP_ROUNDS,
                    last_round: int = LAST_ROUND) -> tuple[list[dict], list[str]]:
    """One row per run and counted round: the event model on the run's own events against its step time."""
    rows, notes = [], []
    for run in runs:
        if not run.events_path.is_file():
            notes.append(f"{run.experiment}/{run.schedule}/seed{run.seed}: no events.jsonl, no prediction")
            continue
        try:
            trace = load_trace(run.path)
        except UsageError as e:
            notes.append(f"{run.experiment}/{run.schedule}/seed{run.seed}: events unusable ({e})")
            continue
        for p in predict_rounds(trace):
            if not warmup < p["round"] <= last_round:
                continue
            rows.append({"experiment": run.experiment, "schedule": run.schedule, "seed": run.seed,
                         "round": p["round"], "measured_s": p.get("measured_s"), "predicted_s": p.get("predicted_s"),
                         "error_pct": p.get("error_pct"), "sync_s": p["sync_s"], "stream_s": p["stream_s"],
                         "async_s": p["async_s"], "predicted_speedup": p["speedup"], "ceiling": p["ceiling"],
                         "makespan_s": p["makespan_s"], "work_s": p["work_s"], "learners": p["learners"]})
    return rows, notes


def paired_speedup_rows(pred: list[dict]) -> list[dict]:
    """Same experiment, seed and round under sync and stream: measured sync/stream step time against
    the predicted speedup, two ways:

    - `predicted_speedup` (both traces): the model's sync time from the sync run's trace (its batch
      backward shared out by tokens) over its stream time from the stream run's trace (per-item
      costs). Each schedule is priced with the learner costs it actually pays.
      With each run's own measured costs this is close to an accounting check.
    - `predicted_speedup_stream_trace`: sync/stream both from the stream run's trace alone: the
      sync baseline's padded batch priced as the per-item work times the padding factor
      B * T_max / sum(T_i) (tsrl_cli.predict).
    - `predicted_speedup_sync_trace`: both from the sync run's trace alone (each item's own cost is
      the batch's seconds times T_i / (B * T_max)): what a user of a synchronous trainer would
      predict before trying streaming. The same rounds hold the same trajectories under both schedules (exact
      streaming, same seed), so the comparison is like for like.
    """
    idx = {(r["experiment"], r["schedule"], r["seed"], r["round"]): r for r in pred}
    out = []
    for (exp, sched, seed, rnd), r in idx.items():
        s = idx.get((exp, "sync", seed, rnd))
        if sched != "stream" or s is None or not s.get("measured_s") or not r.get("measured_s"):
            continue
        measured = s["measured_s"] / r["measured_s"]
        both = s["sync_s"] / r["stream_s"] if r.get("stream_s") else None
        single, from_sync = r["predicted_speedup"], s["predicted_speedup"]

        def err(x):
            return 100 * (x - measured) / measured if x is not None else None

        out.append({"experiment": exp, "seed": seed, "round": rnd, "measured_speedup": measured,
                    "predicted_speedup": both, "error_pct": err(both),
                    "predicted_speedup_stream_trace": single, "error_pct_stream_trace": err(single),
                    "predicted_speedup_sync_trace": from_sync, "error_pct_sync_trace": err(from_sync)})
    return out


def prediction_table(pred: list[dict], paired: list[dict]) -> Table:
    """Summary per experiment · schedule (every row is in the CSVs): rows, mean |error|, mean error."""
    rows = []
    groups: dict[tuple[str, str], list[float]] = {}
    for r in pred:
        if r["error_pct"] is not None:
            groups.setdefault((r["experiment"], r["schedule"]), []).append(r["error_pct"])
    for r in paired:
        if r["error_pct"] is not None:
            groups.setdefault((r["experiment"], "speedup sync/stream"), []).append(r["error_pct"])
    for (exp, what), errs in groups.items():
        rows.append({"experiment": exp, "schedule": what, "rows": len(errs),
                     "mean_abs_error_pct": statistics.fmean(abs(e) for e in errs),
                     "mean_error_pct": statistics.fmean(errs)})
    step_errs = [abs(r["error_pct"]) for r in pred if r["error_pct"] is not None]
    pair_errs = [abs(r["error_pct"]) for r in paired if r["error_pct"] is not None]
    single_errs = [abs(r["error_pct_stream_trace"]) for r in paired if r.get("error_pct_stream_trace") is not None]
    sync_errs = [abs(r["error_pct_sync_trace"]) for r in paired if r.get("error_pct_sync_trace") is not None]
    extra = {"step_rows": len(step_errs), "step_mape": statistics.fmean(step_errs) if step_errs else None,
             "paired_rows": len(pair_errs), "paired_mape": statistics.fmean(pair_errs) if pair_errs else None,
             "paired_mape_stream_trace": statistics.fmean(single_errs) if single_errs else None,
             "paired_mape_sync_trace": statistics.fmean(sync_errs) if sync_errs else None}
    md = [("experiment · what", _key), ("rows", lambda r: str(r["rows"])),
          ("mean abs error %", lambda r: fmt(r["mean_abs_error_pct"])),
          ("mean error % (bias)", lambda r: fmt(r["mean_error_pct"]))]
    return Table("predicted_vs_measured", "Predicted against measured", rows, md, extra=extra,
                 note=f"Step time: the event model (tsrl_cli.predict) on each run's events, under the run's own "
                      f"schedule, against its measured step_time_s: {extra['step_rows']} rows, mean abs error "
                      f"{fmt(extra['step_mape'])} %. Speedup: measured sync/stream step time of the same experiment, "
                      f"seed and round, against the model's sync time from the sync run's trace over its stream "
                      f"time from the stream run's trace: {extra['paired_rows']} paired rows, mean abs error "
                      f"{fmt(extra['paired_mape'])} %, close to an accounting check since each schedule is priced "
                      f"with its own measured costs. From one trace only (the padded batch priced "
                      f"from token counts): the stream trace {fmt(extra['paired_mape_stream_trace'])} %; the sync "
                      f"trace, the prediction a sync user can make before trying streaming, "
                      f"{fmt(extra['paired_mape_sync_trace'])} %. Warm-up rounds excluded.")


# ---------------------------------------------------------------------------- figure data


def spread_rows(runs: list[Run], steps: Table, pred: list[dict], key: str) -> tuple[list[dict], str | None]:
    """Speedup against the experiment's spread value (config key, dotted); a note when unusable."""
    xs: dict[str, set] = {}
    for r in runs:
        xs.setdefault(r.experiment, set()).add(_hashable(config_value(r.config, key)))
    usable = {e: next(iter(v)) for e, v in xs.items() if len(v) == 1 and isinstance(next(iter(v)), (int, float))
              and not isinstance(next(iter(v)), bool)}
    mixed = [e for e, v in xs.items() if len(v) > 1]
    if not usable:
        varying = sorted({k for k in _varying_keys([flat_config(r.config) for r in runs])})
        hint = f" Config keys that differ between runs: {', '.join(varying[:12])}." if varying else ""
        return [], f"no experiment has a numeric `{key}` in its config.yaml (pass --spread-key).{hint}"
    by_pred: dict[str, list[dict]] = {}
    for p in pred:
        if p["schedule"] == "stream":
            by_pred.setdefault(p["experiment"], []).append(p)
    rows = []
    for s in steps.rows:
        if s["experiment"] not in usable or s["schedule"] == "sync" or s["speedup_mean"] is None:
            continue
        ps = by_pred.get(s["experiment"], []) if s["schedule"] == "stream" else []
        rows.append({"experiment": s["experiment"], "objective": s["objective"], "schedule": s["schedule"],
                     "spread_key": key, "spread": usable[s["experiment"]], "n_seeds": s["n_seeds"],
                     **{k: s[k] for k in ("speedup_mean", "speedup_std", "speedup_ci_low", "speedup_ci_high")},
                     "predicted_speedup": statistics.fmean(p["sync_s"] for p in ps) / statistics.fmean(
                         p["stream_s"] for p in ps) if ps else None,
                     "ceiling_mean": statistics.fmean(p["ceiling"] for p in ps if p["ceiling"]) if ps else None})
    rows.sort(key=lambda r: (r["objective"] or "", r["schedule"], r["spread"]))
    if not rows:
        return [], f"no experiment with a `{key}` value has sync runs of the same seeds to measure a speedup against"
    note = f"experiments with several values of `{key}` left out: {', '.join(mixed)}" if mixed else None
    return rows, note


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def _varying_keys(flats: list[dict]) -> set[str]:
    keys = set().union(*flats) if flats else set()
    return {k for k in keys if len({repr(f.get(k)) for f in flats}) > 1 and not k.startswith("seed")}


def reward_curve_rows(runs: list[Run], reward_key: str = "reward_mean") -> list[dict]:
    """Per experiment, schedule and round (warm-up included, it is part of the curve): mean, std over seeds."""
    rows = []
    for (exp, sched), rs in cells(runs).items():
        rounds = sorted({k for r in rs for k in r.rounds})
        for k in rounds:
            s = over_seeds([r.series(reward_key).get(k) for r in rs])
            if s.n_seeds:
                rows.append({"experiment": exp, "schedule": sched, "round": k, "reward_key": reward_key,
                             "mean": s.mean, "std": s.std, "n_seeds": s.n_seeds})
    return rows


def gantt_rows(runs: list[Run], warmup: int = WARMUP_ROUNDS) -> tuple[list[dict], str]:
    """One round of one seed under sync and under stream, from events.jsonl: arrival bars (round start
    to each item's arrival), learner bars (backward, step, weight sync) and the idle gaps between them.

    Picks the first experiment with sync and stream runs of a common seed, that seed's first round
    after the warm-up (else the last round both have). Returns the rows and a one-line description
    (or why there is no figure).
    """
    groups = cells(runs)
    for exp in dict.fromkeys(e for e, _ in groups):
        sync = {r.seed: r for r in groups.get((exp, "sync"), []) if r.events_path.is_file()}
        stream = {r.seed: r for r in groups.get((exp, "stream"), []) if r.events_path.is_file()}
        for seed in sorted(set(sync) & set(stream)):
            events = {s: read_jsonl(run.events_path)[0] for s, run in (("sync", sync[seed]), ("stream", stream[seed]))}
            common = set.intersection(*({int(e["round"]) for e in ev if e.get("event") == "item"}
                                        for ev in events.values()))
            if not common:
                continue
            after = sorted(k for k in common if k > warmup)
            rnd = after[0] if after else max(common)
            rows = [row for s, ev in events.items() for row in _round_bars(s, [e for e in ev if e.get("round") == rnd])]
            return rows, f"{exp}, seed {seed}, round {rnd}"
    return [], "no experiment has sync and stream runs of a common seed with events.jsonl"


def _round_bars(schedule: str, ev: list[dict]) -> list[dict]:
    rows = []
    items = sorted((e for e in ev if e.get("event") == "item"), key=lambda e: e.get("finished_at_s") or 0.0)
    for i, e in enumerate(items):
        rows.append({"schedule": schedule, "lane": f"item {i + 1}", "kind": "rollout", "start_s": 0.0,
                     "end_s": e.get("finished_at_s")})
    busy = []
    for e in ev:
        kind = e.get("event")
        if kind == "item" and e.get("backward_start_s") is not None and e.get("backward_end_s") is not None:
            busy.append(("backward", e["backward_start_s"], e["backward_end_s"]))
        elif kind in ("batch_backward", "step", "weight_sync") and e.get("start_s") is not None:
            busy.append((kind, e["start_s"], e["end_s"]))
    busy.sort(key=lambda b: b[1])
    end = next((e.get("at_s") for e in ev if e.get("event") == "round_end" and e.get("at_s") is not None),
               max((b[2] for b in busy), default=0.0))
    t = 0.0
    for kind, a, b in busy:
        if a > t:
            rows.append({"schedule": schedule, "lane": "learner", "kind": "idle", "start_s": t, "end_s": a})
        rows.append({"schedule": schedule, "lane": "learner", "kind": kind, "start_s": a, "end_s": b})
        t = max(t, b)
    if end > t:
        rows.append({"schedule": schedule, "lane": "learner", "kind": "idle", "start_s": t, "end_s": end})
    return rows
