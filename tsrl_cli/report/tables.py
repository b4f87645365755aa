"""Runs -> tables: pandas frames, one row per experiment x schedule unless said otherwise.

Every number over seeds goes through report.aggregate (warm-up dropped, per-seed reduce, mean ±
std and 95 % t-interval over seeds). Each Table carries the markdown columns it renders; its CSV
is every column of its frame. Rows come sync, stream, async within an experiment.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from tsrl_cli.errors import UsageError
from tsrl_cli.predict import predict_rounds
from tsrl_cli.report.aggregate import CELL, LAST_ROUND, STATS, WARMUP_ROUNDS, aggregate, over_seeds, per_seed
from tsrl_cli.report.load import RUN, Results, Run, config_value, flat_config, numeric
from tsrl_cli.rundir import EVENTS, SKIP
from tsrl_cli.traces import load_trace

SCHEDULE_ORDER = {"sync": 0, "stream": 1, "async": 2}
ROLLING_ROUNDS = 5  # the reward used for targets and budgets: mean of the last 5 rounds' reward
MEMORY_KEYS = ("peak_mem_learner_bytes", "peak_mem_rollout_bytes", "accumulator_peak_bytes")
PRED_COLUMNS = ["experiment", "schedule", "seed", "round", "measured_s", "predicted_s", "error_pct", "sync_s",
                "stream_s", "async_s", "predicted_speedup", "ceiling", "makespan_s", "work_s", "learners"]


@dataclass
class Table:
    name: str
    title: str
    frame: pd.DataFrame
    md: list[tuple[str, Callable[[dict], str]]]
    note: str = ""  # definitions the reader needs (target, budget, window)
    extra: dict = field(default_factory=dict)  # summary numbers for REPORT.md

    def records(self) -> list[dict]:
        return records(self.frame)

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.frame.empty:
            return "\n".join(lines + ["No runs with these measurements.", ""])
        shown = pd.DataFrame([[f(r) for _, f in self.md] for r in self.records()], columns=[h for h, _ in self.md])
        lines.append(shown.to_markdown(index=False, disable_numparse=True))  # cells are already formatted
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines) + "\n"


def records(frame: pd.DataFrame) -> list[dict]:
    """Rows as dicts of Python values, NaN as None (what fmt and pm print as '–')."""
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
            for r in frame.to_dict("records")]


def to_csv(frame: pd.DataFrame) -> str:
    return frame.to_csv(index=False, lineterminator="\n")


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


def _ratio(a: pd.Series, b: pd.Series) -> pd.Series:
    """a / b, NaN where b is 0 or missing (a ratio to nothing is not measured)."""
    return a / b.where(b != 0)


# ---------------------------------------------------------------------------- grouping


def run_frame(res: Results) -> pd.DataFrame:
    """One row per run in table order (experiment, sync-stream-async, seed): its objective (metrics,
    else config) and device kind."""
    obj = res.rounds.groupby(RUN)["objective"].first() if "objective" in res.rounds else pd.Series(dtype=object)

    def objective(r: Run):
        v = obj.get((r.experiment, r.schedule, r.seed))
        return v if isinstance(v, str) else r.config.get("objective")

    rows = [{"experiment": r.experiment, "schedule": r.schedule, "seed": r.seed, "objective": objective(r),
             "device_kind": r.setup.device_kind, "devices": r.setup.devices,
             "_order": (r.experiment, SCHEDULE_ORDER.get(r.schedule, 9), r.schedule, r.seed)} for r in res.runs]
    if not rows:
        return pd.DataFrame(columns=[*RUN, "objective", "device_kind", "devices"])
    return pd.DataFrame(rows).sort_values("_order", kind="stable").drop(columns="_order").reset_index(drop=True)


def cells(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (experiment, schedule) in table order: objective, seeds ('42 43 44'), n_seeds (runs)."""
    return runs.groupby(CELL, sort=False).agg(
        objective=("objective", "first"), seeds=("seed", lambda s: " ".join(map(str, s))),
        n_seeds=("seed", "size")).reset_index()


def _join(base: pd.DataFrame, *parts: pd.DataFrame) -> pd.DataFrame:
    for p in parts:
        base = base.merge(p, on=[c for c in CELL if c in p], how="left")
    return base


def _stats(frame: pd.DataFrame, prefix: str) -> pd.DataFrame:
    return frame[CELL + [f"{prefix}_{s}" for s in STATS]]


def _of_sync(t: pd.DataFrame, col: str) -> pd.Series:
    """Per row of t, `col` of its experiment's sync row (NaN when the experiment has none)."""
    sync = t.loc[t["schedule"] == "sync", ["experiment", col]]
    return t[["experiment"]].merge(sync, how="left")[col]


# ---------------------------------------------------------------------------- the tables


# how an experiment's sync computed its lazy gradient (config `sync_batching`), as the tables name it
SYNC_BASELINES = {"padded": "padded lazy batch", "per_item": "per-item (stream's own work)"}


def sync_baseline(runs: list[Run]) -> dict[str, str]:
    """Per experiment, what its speedups are over: the sync runs' `sync_batching` (TrainConfig's default,
    padded, where a config does not name it); 'mixed' when its sync runs disagree, '–' without sync runs."""
    kinds: dict[str, set] = {}
    for r in runs:
        kinds.setdefault(r.experiment, set())
        if r.schedule == "sync":
            kinds[r.experiment].add(config_value(r.config, "sync_batching") or "padded")
    return {e: "–" if not k else SYNC_BASELINES.get(next(iter(k)), next(iter(k))) if len(k) == 1 else "mixed"
            for e, k in kinds.items()}


def step_time_table(res: Results, warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND) -> Table:
    """Step time, speedup over sync (per seed: mean sync step / mean step, then over seeds), the sync it is
    over (padded lazy batch or per-item), learner idle beside that sync's, balance."""
    runs, rounds = run_frame(res), res.rounds
    st = aggregate(rounds, "step_time_s", warmup, last_round)
    seeds = per_seed(rounds, "step_time_s", warmup, last_round)
    sync = seeds.loc[seeds["schedule"] == "sync", ["experiment", "seed", "value"]]
    pairs = seeds.merge(sync, on=["experiment", "seed"], suffixes=("", "_sync"))  # the same seed's sync run
    speed = over_seeds(pairs.assign(speedup=_ratio(pairs["value_sync"], pairs["value"])), "speedup", prefix="speedup")
    busy = aggregate(rounds, "learner_busy_s", warmup, last_round)[CELL + ["learner_busy_s_mean"]]
    mk = aggregate(rounds, "rollout_makespan_s", warmup, last_round)[CELL + ["rollout_makespan_s_mean"]]
    t = _join(cells(runs), st.assign(rounds_per_seed=st["n_rounds"])[CELL + ["rounds_per_seed"]],
              _stats(st, "step_time_s"), _stats(speed, "speedup"), busy, mk)
    t["rounds_per_seed"] = t["rounds_per_seed"].fillna(0).astype(int)
    t["balance_busy_over_makespan"] = _ratio(t["learner_busy_s_mean"], t["rollout_makespan_s_mean"])
    t["sync_baseline"] = t["experiment"].map(sync_baseline(res.runs))
    idle = aggregate(rounds, "learner_idle_frac", warmup, last_round)[CELL + ["learner_idle_frac_mean"]]
    t = _join(t, idle)
    t["sync_learner_idle_frac_mean"] = _of_sync(t, "learner_idle_frac_mean")
    md = [("experiment · schedule", _key), ("seeds", lambda r: r["seeds"]),
          ("rounds/seed", lambda r: str(r["rounds_per_seed"])),
          ("step time s", lambda r: pm(r, "step_time_s")),
          ("speedup vs sync", lambda r: pm(r, "speedup")),
          ("sync baseline", lambda r: r["sync_baseline"]),
          ("learner idle % (its sync's)", _idle_beside_sync),
          ("learner busy / rollout makespan", lambda r: fmt(r["balance_busy_over_makespan"]))]
    return Table("step_time", "Step time and speedup", t, md,
                 note=f"Rounds {warmup + 1}-{last_round} averaged per seed, then mean ± std [95 % t-interval] "
                      "over seeds. Speedup per seed = mean sync step time / mean step time, same seed. The sync "
                      "baseline is how that experiment's sync computed its gradient (config `sync_batching`): the "
                      "padded lazy batch computes the padding stream never computes, so a speedup over it counts "
                      "the padding saved as well as the waiting removed; over the per-item sync (the same learner "
                      "work as stream) it is the overlap alone. Learner idle is 1 - learner busy / step time, "
                      "mean over rounds and seeds, with the same experiment's sync in parentheses.")


def _idle_beside_sync(r: dict) -> str:
    mine, sync = r["learner_idle_frac_mean"], r["sync_learner_idle_frac_mean"]
    if mine is None:
        return "–"
    if r["schedule"] == "sync" or sync is None:
        return fmt(100 * mine)
    return f"{fmt(100 * mine)} ({fmt(100 * sync)})"


def idle_table(res: Results, warmup: int = WARMUP_ROUNDS, last_round: int = LAST_ROUND) -> Table:
    idle = aggregate(res.rounds, "learner_idle_frac", warmup, last_round)
    md = [("experiment · schedule", _key), ("seeds", lambda r: r["seeds"]),
          ("learner idle % of step time", lambda r: pm(r, "learner_idle_frac", scale=100))]
    return Table("learner_idle", "Learner idle fraction", _join(cells(run_frame(res)), _stats(idle, "learner_idle_frac")),
                 md, note="1 - learner busy / step time, per round; rounds after the warm-up.")


def memory_table(res: Results, last_round: int = LAST_ROUND) -> Table:
    """Peak bytes: the max over every round of a run (warm-up included: a peak is a peak), then over seeds."""
    peaks = {k: aggregate(res.rounds, k, 0, last_round, how="max") for k in MEMORY_KEYS}
    t = _join(cells(run_frame(res)), *(_stats(p, k) for k, p in peaks.items()))
    t["learner_peak_vs_sync"] = _ratio(t["peak_mem_learner_bytes_mean"], _of_sync(t, "peak_mem_learner_bytes_mean"))
    md = [("experiment · schedule", _key), ("seeds", lambda r: r["seeds"]),
          ("learner peak GB", lambda r: pm(r, "peak_mem_learner_bytes", 1e-9)),
          ("rollout peak GB", lambda r: pm(r, "peak_mem_rollout_bytes", 1e-9)),
          ("accumulator peak MB", lambda r: pm(r, "accumulator_peak_bytes", 1e-6)),
          ("learner peak / sync", lambda r: fmt(r["learner_peak_vs_sync"]))]
    return Table("memory", "Peak memory", t, md, note="Peak over all rounds of a run (GB = 1e9 bytes), then "
                 "mean ± std [95 % t-interval] over seeds.")


def certified(res: Results) -> bool:
    """Whether any run recorded the exactness certificate (run.verify_every): its table is written then."""
    return bool(numeric(res.rounds, "verify_rel_diff").notna().any())


def certificate_table(res: Results, last_round: int = LAST_ROUND) -> Table:
    """The exactness certificate per cell: rounds certified, the largest verify_rel_diff over every certified
    round and seed (warm-up included: a wrong gradient is wrong in any round), and the recomputation's cost
    as a share of learner busy time (per seed: sum verify_s / sum learner_busy_s over its certified rounds)."""
    rounds = res.rounds
    rel = numeric(rounds, "verify_rel_diff").where(rounds["round"].between(1, last_round))
    seeds = rounds[RUN].assign(rel=rel, vs=numeric(rounds, "verify_s").where(rel.notna()),
                               busy=numeric(rounds, "learner_busy_s").where(rel.notna()))
    seeds = seeds.groupby(RUN, sort=False).agg(certified=("rel", "count"), rel_max=("rel", "max"), vs=("vs", "sum"),
                                               busy=("busy", "sum")).reset_index()
    seeds = seeds[seeds["certified"] > 0].assign(share=lambda f: _ratio(f["vs"], f["busy"]))
    per_cell = seeds.groupby(CELL, sort=False).agg(rounds_certified=("certified", "sum"),
                                                   verify_rel_diff_max=("rel_max", "max")).reset_index()
    t = _join(cells(run_frame(res)), per_cell, _stats(over_seeds(seeds, "share", prefix="verify_share"), "verify_share"))
    t = t[t["rounds_certified"].notna()].reset_index(drop=True)
    t["rounds_certified"] = t["rounds_certified"].astype(int)
    md = [("experiment · schedule", _key), ("seeds", lambda r: r["seeds"]),
          ("rounds certified", lambda r: str(r["rounds_certified"])),
          ("max verify_rel_diff", lambda r: fmt(r["verify_rel_diff_max"])),
          ("verify_s % of learner busy", lambda r: pm(r, "verify_share", scale=100))]
    return Table("certificate", "Exactness certificate", t, md,
                 note="verify_rel_diff = max |lazy - other| / max |lazy| over the whole gradient of a round, the "
                      "step's gradient against its recomputation by the other decomposition (docs/streaming.md, "
                      "'The exactness certificate'); the maximum over every certified round and seed. Cost per "
                      "seed: sum of verify_s / sum of learner_busy_s over the certified rounds (busy time includes "
                      "the recomputation), then mean ± std [95 % t-interval] over seeds.")


def rolling_reward(rounds: pd.DataFrame, reward_key: str, window: int = ROLLING_ROUNDS) -> pd.DataFrame:
    """Per run and round: the mean of the last `window` measured rewards up to that round (full windows
    only), beside that round's wall_s and device_s."""
    r = rounds[[*RUN, "round"]].assign(value=numeric(rounds, reward_key), wall_s=numeric(rounds, "wall_s"),
                                       device_s=rounds["device_s"])
    r = r.dropna(subset=["value"]).sort_values([*RUN, "round"])
    r["rolling"] = r.groupby(RUN, sort=False)["value"].transform(lambda s: s.rolling(window).mean())
    return r.dropna(subset=["rolling"])


def _device_columns(runs: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the device kind(s) and count(s) its device-seconds are in ('cpu', '2')."""
    def join(s):
        return ", ".join(dict.fromkeys(str(int(v)) if isinstance(v, float) else str(v) for v in s.dropna())) or None
    return runs.groupby(CELL, sort=False).agg(device_kind=("device_kind", join), devices=("devices", join)).reset_index()


def _device_hours_header(t: pd.DataFrame) -> str:
    kinds = sorted({k for v in t["device_kind"].dropna() for k in v.split(", ")})
    return f"device-hours ({', '.join(kinds) or 'devices unknown'})"


def target_table(res: Results, target: float | None = None, reward_key: str = "reward_mean",
                 window: int = ROLLING_ROUNDS) -> Table:
    """Device-seconds (and wall seconds) until the rolling reward first reaches the target.

    Default target, per experiment: the highest rolling reward that every run reaches (the smallest
    of the runs' best), so every run has a time; it is stated in each row.
    """
    runs = run_frame(res)
    roll = rolling_reward(res.rounds, reward_key, window)
    base = cells(runs)
    if target is None:
        best = roll.groupby(RUN, sort=False)["rolling"].max().groupby("experiment").min()
        base["target_reward"] = base["experiment"].map(best)
    else:
        base["target_reward"] = float(target)
    reach = roll.merge(base[["experiment", "target_reward"]].drop_duplicates(), on="experiment")
    hits = reach[reach["rolling"] >= reach["target_reward"]].groupby(RUN, sort=False).head(1)  # rows in round order
    base["reward_key"] = reward_key
    reached = hits.groupby(CELL, sort=False).size().reset_index(name="reached")
    t = _join(base, reached, _device_columns(runs), _stats(over_seeds(hits, "device_s", prefix="device_s"), "device_s"),
              _stats(over_seeds(hits, "wall_s", prefix="wall_s"), "wall_s"))
    t["reached"] = t["reached"].fillna(0).astype(int)
    t["device_speedup_vs_sync"] = _ratio(_of_sync(t, "device_s_mean"), t["device_s_mean"])
    hours = _device_hours_header(t)
    md = [("experiment · schedule", _key), ("target", lambda r: fmt(r["target_reward"])),
          ("reached", lambda r: f"{r['reached']}/{r['n_seeds']}"),
          (hours, lambda r: pm(r, "device_s", 1 / 3600)), ("wall s", lambda r: pm(r, "wall_s")),
          (f"{hours} saved vs sync (x)", lambda r: fmt(r["device_speedup_vs_sync"]))]
    how = f"the given target {target}" if target is not None else \
        "per experiment, the highest rolling reward every run reaches"
    return Table("device_hours_to_target", "Device-hours to a target reward", t, md,
                 note=f"First round where the mean of the last {window} rounds' `{reward_key}` reaches the target "
                      f"({how}); device-seconds there: the run's wall seconds times the devices its processes held "
                      "(its config.yaml `devices`; on cpu one per process). Over seeds that reached it.")


# what may differ between the arms of one fixed-budget comparison; every other config key is the workload
BUDGET_FREE_KEYS = ("name", "schedule", "seed", "rounds", "run", "offpolicy")


def arm_label(schedule: str, config: dict) -> str:
    """A run's arm as its config.yaml names it: the schedule, and for async the TIS cap
    ('async, TIS cap 2.0' | 'async, no TIS'); TIS applies to async only (rl/schedules.py)."""
    if schedule != "async":
        return schedule
    off = config.get("offpolicy")
    if not isinstance(off, dict) or "tis_cap" not in off:
        return "async, TIS not in config.yaml"
    return "async, no TIS" if off["tis_cap"] is None else f"async, TIS cap {off['tis_cap']}"


def budget_groups(runs: list[Run]) -> tuple[dict[str, str], list[str]]:
    """experiment -> its budget group, and notes. Experiments run the same workload, and share one budget,
    when their config.yaml agree on every key outside BUDGET_FREE_KEYS that both have. A key only one side
    has is a field added to the config between the runs (its default then): not compared, and named in a
    note. A group is named by its experiments ('a + b')."""
    work: dict[str, dict] = {}
    for r in runs:
        flat = flat_config({k: v for k, v in r.config.items() if k not in BUDGET_FREE_KEYS})
        work.setdefault(r.experiment, {}).update({k: repr(v) for k, v in flat.items()})
    groups: list[list[str]] = []
    for exp, keys in work.items():
        same = next((g for g in groups if all(all(work[o][k] == v for k, v in keys.items() if k in work[o])
                                               for o in g)), None)
        (same.append(exp) if same is not None else groups.append([exp]))
    notes = []
    for g in (g for g in groups if len(g) > 1):
        one_side = sorted(set().union(*(work[e].keys() for e in g)) - set.intersection(*(set(work[e]) for e in g)))
        if one_side:
            notes.append(f"budget group {' + '.join(g)}: keys not in every experiment's config.yaml, not compared: "
                         f"{', '.join(one_side)}")
    return {e: " + ".join(g) for g in groups for e in g}, notes


def budget_table(res: Results, budget_device_s: float | None = None, reward_key: str = "reward_mean",
                 window: int = ROLLING_ROUNDS) -> Table:
    """Rolling reward at the last round whose cumulative device-seconds are within the budget, one row per
    experiment x schedule, labelled with its arm (arm_label), grouped by workload (budget_groups).

    Default budget, per group: the smallest final device_s over its runs (every run spent it). Gap: the
    same seed's stream reward minus the row's, x 100 ("points" of a 0-100 reward), then over seeds; the
    stream row is the row's own experiment's, else the group's only one.
    """
    runs = run_frame(res)
    group, group_notes = budget_groups(res.runs)
    arms = {(r.experiment, r.schedule, r.seed): arm_label(r.schedule, r.config) for r in res.runs}
    runs["arm"] = [arms[k] for k in zip(runs["experiment"], runs["schedule"], runs["seed"])]
    base = cells(runs).merge(runs.groupby(CELL, sort=False)["arm"].agg(lambda s: " / ".join(dict.fromkeys(s)))
                             .reset_index(), on=CELL)
    base.insert(2, "budget_group", base["experiment"].map(group))
    first = {g: i for i, g in enumerate(dict.fromkeys(base["budget_group"]))}  # groups in table order
    base = base.assign(_o=base["budget_group"].map(first), _s=base["schedule"].map(SCHEDULE_ORDER).fillna(9))
    base = base.sort_values(["_o", "_s"], kind="stable").drop(columns=["_o", "_s"]).reset_index(drop=True)
    if budget_device_s is None:
        final = res.rounds.groupby(RUN, sort=False)["device_s"].max().dropna().reset_index()
        base["budget_device_s"] = base["budget_group"].map(
            final.groupby(final["experiment"].map(group))["device_s"].min())
    else:
        base["budget_device_s"] = float(budget_device_s)
    roll = rolling_reward(res.rounds, reward_key, window).merge(base[[*CELL, "budget_device_s"]], on=CELL)
    at = roll[roll["device_s"] <= roll["budget_device_s"]].groupby(RUN, sort=False).tail(1)  # the last such round
    rounds_at = runs[RUN].merge(at[[*RUN, "round"]], on=RUN, how="left").groupby(CELL, sort=False)["round"].agg(
        lambda s: " ".join("–" if pd.isna(k) else str(int(k)) for k in s)).reset_index(name="rounds_at_budget")
    streams = base[base["schedule"] == "stream"].groupby("budget_group")["experiment"].agg(list)

    def vs_stream(r) -> str | None:
        """The experiment whose stream row this row is compared with: its own, else the group's only one."""
        cand = streams.get(r["budget_group"], [])
        if r["schedule"] == "stream" or not cand:
            return None
        if r["experiment"] in cand:
            return r["experiment"]
        return cand[0] if len(cand) == 1 else None

    base["vs_stream_experiment"] = base.apply(vs_stream, axis=1) if len(base) else None
    st = at[at["schedule"] == "stream"]  # each stream run's reward at the budget, keyed by what rows compare to
    ref = pd.DataFrame({"vs_stream_experiment": st["experiment"], "seed": st["seed"], "stream_rolling": st["rolling"]})
    pairs = at.merge(base[[*CELL, "vs_stream_experiment"]], on=CELL).merge(ref, on=["vs_stream_experiment", "seed"])
    pairs["gap_points"] = 100 * (pairs["stream_rolling"] - pairs["rolling"])
    base["reward_key"] = reward_key
    t = _join(base, _device_columns(runs), _stats(over_seeds(at, "rolling", prefix="reward"), "reward"),
              rounds_at, _stats(over_seeds(pairs, "gap_points", prefix="gap_points"), "gap_points"))
    md = [("experiment · schedule", _key), ("arm (config.yaml)", lambda r: r["arm"]),
          (f"budget {_device_hours_header(t)}", lambda r: fmt(r["budget_device_s"] / 3600
                                                               if r["budget_device_s"] else None)),
          ("rounds within budget", lambda r: r["rounds_at_budget"] or "–"),
          ("reward at budget", lambda r: pm(r, "reward")),
          ("stream − arm, points", lambda r: pm(r, "gap_points"))]
    how = f"{budget_device_s} device-s" if budget_device_s is not None else \
        "per budget group, the smallest total device_s of its runs"
    return Table("reward_at_budget", "Reward at a fixed compute budget", t, md,
                 note=f"Mean of the last {window} rounds' `{reward_key}` at the last round within the budget "
                      f"({how}), per seed (rounds within budget: that round for each seed, – where no {window}-round "
                      "window fits), then mean ± std [95 % t-interval] over seeds. A budget group is the experiments "
                      "whose runs' config.yaml agree outside "
                      f"{', '.join(k + ('.*' if k in ('run', 'offpolicy') else '') for k in BUDGET_FREE_KEYS)}: "
                      "the same workload. The arm is each run's schedule and, for async, its `offpolicy.tis_cap`. "
                      "stream − arm: the same seed's stream reward minus this row's, in points (reward x 100), "
                      "then over seeds." + "".join(f" Note: {n}." for n in group_notes))


# ---------------------------------------------------------------------------- predicted against measured


def prediction_rows(runs: list[Run], warmup: int = WARMUP_ROUNDS,
                    last_round: int = LAST_ROUND) -> tuple[pd.DataFrame, list[str]]:
    """One row per run and counted round: the event model on the run's own events against its step time."""
    rows, notes = [], []
    for run in runs:
        if not run.events_path.is_file():
            notes.append(f"{run.name}: no events.jsonl, no prediction")
            continue
        try:
            trace = load_trace(run.path)
        except UsageError as e:
            notes.append(f"{run.name}: events unusable ({e})")
            continue
        for p in predict_rounds(trace):
            if not warmup < p["round"] <= last_round:
                continue
            rows.append({"experiment": run.experiment, "schedule": run.schedule, "seed": run.seed,
                         "round": p["round"], "measured_s": p.get("measured_s"), "predicted_s": p.get("predicted_s"),
                         "error_pct": p.get("error_pct"), "sync_s": p["sync_s"], "stream_s": p["stream_s"],
                         "async_s": p["async_s"], "predicted_speedup": p["speedup"], "ceiling": p["ceiling"],
                         "makespan_s": p["makespan_s"], "work_s": p["work_s"], "learners": p["learners"]})
    return pd.DataFrame(rows, columns=PRED_COLUMNS), notes


def paired_speedup_rows(pred: pd.DataFrame) -> pd.DataFrame:
    """Same experiment, seed and round under sync and stream: measured sync/stream step time against
    the predicted speedup, three ways:

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
    on = ["experiment", "seed", "round"]
    m = pred[pred["schedule"] == "stream"].merge(pred[pred["schedule"] == "sync"], on=on, suffixes=("", "_sync"))
    m = m[m["measured_s"].fillna(0).ne(0) & m["measured_s_sync"].fillna(0).ne(0)]
    measured = m["measured_s_sync"] / m["measured_s"]

    def err(x):
        return 100 * (x - measured) / measured

    both = _ratio(m["sync_s_sync"], m["stream_s"])
    single, from_sync = m["predicted_speedup"], m["predicted_speedup_sync"]
    return pd.DataFrame({"experiment": m["experiment"], "seed": m["seed"], "round": m["round"],
                         "measured_speedup": measured, "predicted_speedup": both, "error_pct": err(both),
                         "predicted_speedup_stream_trace": single, "error_pct_stream_trace": err(single),
                         "predicted_speedup_sync_trace": from_sync, "error_pct_sync_trace": err(from_sync)}
                        ).reset_index(drop=True)


def _mape(errors: pd.Series) -> float | None:
    e = errors.dropna().abs()
    return float(e.mean()) if len(e) else None


def prediction_table(pred: pd.DataFrame, paired: pd.DataFrame) -> Table:
    """Summary per experiment · schedule (every row is in the CSVs): rows, mean |error|, mean error."""
    def summary(frame: pd.DataFrame) -> pd.DataFrame:
        f = frame.dropna(subset=["error_pct"]).assign(abs_error=lambda d: d["error_pct"].abs())
        return f.groupby(CELL, sort=False).agg(rows=("error_pct", "size"), mean_abs_error_pct=("abs_error", "mean"),
                                                mean_error_pct=("error_pct", "mean")).reset_index()

    t = pd.concat([summary(pred), summary(paired.assign(schedule="speedup sync/stream"))], ignore_index=True)
    extra = {"step_rows": int(pred["error_pct"].notna().sum()), "step_mape": _mape(pred["error_pct"]),
             "paired_rows": int(paired["error_pct"].notna().sum()), "paired_mape": _mape(paired["error_pct"]),
             "paired_mape_stream_trace": _mape(paired["error_pct_stream_trace"]),
             "paired_mape_sync_trace": _mape(paired["error_pct_sync_trace"])}
    md = [("experiment · what", _key), ("rows", lambda r: str(r["rows"])),
          ("mean abs error %", lambda r: fmt(r["mean_abs_error_pct"])),
          ("mean error % (bias)", lambda r: fmt(r["mean_error_pct"]))]
    return Table("predicted_vs_measured", "Predicted against measured", t, md, extra=extra,
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


def spread_rows(runs: list[Run], steps: Table, pred: pd.DataFrame, key: str) -> tuple[pd.DataFrame, str | None]:
    """Speedup against the experiment's spread value (config key, dotted); a note when unusable."""
    xs: dict[str, set] = {}
    for r in runs:
        v = config_value(r.config, key)
        xs.setdefault(r.experiment, set()).add(tuple(v) if isinstance(v, list) else v)
    usable = {e: next(iter(v)) for e, v in xs.items() if len(v) == 1 and isinstance(next(iter(v)), (int, float))
              and not isinstance(next(iter(v)), bool)}
    mixed = [e for e, v in xs.items() if len(v) > 1]
    if not usable:
        varying = sorted(_varying_keys([flat_config(r.config) for r in runs]))
        hint = f" Config keys that differ between runs: {', '.join(varying[:12])}." if varying else ""
        return pd.DataFrame(), f"no experiment has a numeric `{key}` in its config.yaml (pass --spread-key).{hint}"
    s = steps.frame
    s = s[s["experiment"].isin(usable) & (s["schedule"] != "sync") & s["speedup_mean"].notna()]
    stream = pred[pred["schedule"] == "stream"].assign(ceiling=lambda d: d["ceiling"].where(d["ceiling"] != 0))
    model = stream.groupby("experiment").agg(sync_s=("sync_s", "mean"), stream_s=("stream_s", "mean"),
                                             ceiling_mean=("ceiling", "mean"))
    model["predicted_speedup"] = model["sync_s"] / model["stream_s"]
    rows = s[["experiment", "objective", "schedule", "sync_baseline"]].assign(
        spread_key=key, spread=s["experiment"].map(usable), n_seeds=s["n_seeds"])
    rows = pd.concat([rows, s[[f"speedup_{k}" for k in STATS]]], axis=1)
    on_stream = rows["schedule"] == "stream"  # the model predicts stream against sync only
    for c in ("predicted_speedup", "ceiling_mean"):
        rows[c] = rows["experiment"].map(model[c]).where(on_stream)
    rows = rows.assign(_obj=rows["objective"].fillna("")).sort_values(["_obj", "schedule", "sync_baseline", "spread"],
                                                                      kind="stable")
    rows = rows.drop(columns="_obj").reset_index(drop=True)
    if rows.empty:
        return rows, f"no experiment with a `{key}` value has sync runs of the same seeds to measure a speedup against"
    note = f"experiments with several values of `{key}` left out: {', '.join(mixed)}" if mixed else None
    return rows, note


def _varying_keys(flats: list[dict]) -> set[str]:
    keys = set().union(*flats) if flats else set()
    return {k for k in keys if len({repr(f.get(k)) for f in flats}) > 1 and not k.startswith("seed")}


def reward_curve_rows(res: Results, reward_key: str = "reward_mean") -> pd.DataFrame:
    """Per experiment, schedule and round (warm-up included, it is part of the curve): mean, std over seeds."""
    order = {(e, s): i for i, (e, s) in enumerate(cells(run_frame(res))[CELL].itertuples(index=False))}
    r = res.rounds[[*CELL, "round"]].assign(value=numeric(res.rounds, reward_key))
    r = r.assign(_cell=[order[k] for k in zip(r["experiment"], r["schedule"])]).sort_values(["_cell", "round"])
    out = r.groupby([*CELL, "round"], sort=False)["value"].agg(mean="mean", std="std", n_seeds="count").reset_index()
    out.insert(3, "reward_key", reward_key)
    return out[out["n_seeds"] > 0].reset_index(drop=True)


def budget_curve_rows(res: Results, budget: Table, reward_key: str = "reward_mean",
                      window: int = ROLLING_ROUNDS) -> pd.DataFrame:
    """The reward-at-budget figure's data, for budget groups of two arms or more: per arm, each seed's
    rolling reward against its cumulative device-seconds (`seed` rows), the mean over seeds per round of
    both (`mean` rows, rounds every seed has), and the table's value at the budget (`at budget`)."""
    b = budget.frame
    b = b[b.groupby("budget_group")["experiment"].transform("size") > 1]
    cols = ["budget_group", *CELL, "arm", "device_kind"]
    roll = rolling_reward(res.rounds, reward_key, window).merge(b[[*cols, "n_seeds"]], on=CELL)
    if roll.empty:
        return pd.DataFrame()
    seeds = roll.assign(what="seed", reward=roll["rolling"])
    mean = roll.groupby([*cols, "round"], sort=False).agg(
        device_s=("device_s", "mean"), reward=("rolling", "mean"), reward_std=("rolling", "std"),
        seeds=("seed", "size"), n_seeds=("n_seeds", "first")).reset_index()
    mean = mean[mean["seeds"] == mean["n_seeds"]].assign(what="mean")
    at = b.assign(what="at budget", device_s=b["budget_device_s"], reward=b["reward_mean"],
                  reward_std=b["reward_std"])[[*cols, "what", "device_s", "reward", "reward_std"]]
    out = pd.concat([seeds, mean, at[at["reward"].notna()]], ignore_index=True)
    out = out.merge(b[[*CELL, "budget_device_s"]], on=CELL).assign(reward_key=reward_key)
    out[["seed", "round"]] = out[["seed", "round"]].astype("Int64")  # empty on mean and at-budget rows
    order = {k: i for i, k in enumerate(zip(b["experiment"], b["schedule"]))}
    out["_o"] = [order[k] for k in zip(out["experiment"], out["schedule"])]
    out = out.sort_values(["_o", "what", "seed", "round"], kind="stable", na_position="first")
    return out[[*cols, "what", "seed", "round", "device_s", "reward", "reward_std", "budget_device_s",
                "reward_key"]].reset_index(drop=True)


def gantt_rows(runs: list[Run], warmup: int = WARMUP_ROUNDS) -> tuple[pd.DataFrame, str]:
    """One round of one seed under sync and under stream, from events.jsonl: arrival bars (round start
    to each item's arrival), learner bars (backward, step, weight sync) and the idle gaps between them.

    Picks the first experiment with sync and stream runs of a common seed, that seed's first round
    after the warm-up (else the last round both have). Returns the rows and a one-line description
    (or why there is no figure).
    """
    for exp in dict.fromkeys(r.experiment for r in runs):
        sync = {r.seed: r for r in runs if (r.experiment, r.schedule) == (exp, "sync") and r.events_path.is_file()}
        stream = {r.seed: r for r in runs if (r.experiment, r.schedule) == (exp, "stream") and r.events_path.is_file()}
        for seed in sorted(set(sync) & set(stream)):
            events = {s: run.dir.rows(EVENTS, SKIP) for s, run in (("sync", sync[seed]), ("stream", stream[seed]))}
            common = set.intersection(*({int(e["round"]) for e in ev if e.get("event") == "item"}
                                        for ev in events.values()))
            if not common:
                continue
            after = sorted(k for k in common if k > warmup)
            rnd = after[0] if after else max(common)
            rows = [row for s, ev in events.items() for row in _round_bars(s, [e for e in ev if e.get("round") == rnd])]
            return pd.DataFrame(rows), f"{exp}, seed {seed}, round {rnd}"
    return pd.DataFrame(), "no experiment has sync and stream runs of a common seed with events.jsonl"


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
