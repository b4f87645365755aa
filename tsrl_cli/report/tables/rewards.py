"""Reward against compute: device-hours to a target reward, reward at a fixed device-second budget (its arms
and workload groups), and the reward curves' data. Rewards are rolling means over the last rounds.
"""

from __future__ import annotations

import pandas as pd

from tsrl_cli.report.aggregate import CELL, over_seeds
from tsrl_cli.report.load import RUN, Results, Run, flat_config, numeric
from tsrl_cli.report.tables.table import (
    SCHEDULE_ORDER,
    Table,
    cell_label,
    cells,
    fmt,
    join_cells,
    of_sync,
    pm,
    ratio,
    run_frame,
    stat_columns,
)

ROLLING_ROUNDS = 5  # the reward used for targets and budgets: mean of the last 5 rounds' reward


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
    return runs.groupby(CELL, sort=False).agg(device_kind=("device_kind", join),
                                              devices=("devices", join)).reset_index()


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
    t = join_cells(base, reached, _device_columns(runs),
                   stat_columns(over_seeds(hits, "device_s", prefix="device_s"), "device_s"),
                   stat_columns(over_seeds(hits, "wall_s", prefix="wall_s"), "wall_s"))
    t["reached"] = t["reached"].fillna(0).astype(int)
    t["device_speedup_vs_sync"] = ratio(of_sync(t, "device_s_mean"), t["device_s_mean"])
    hours = _device_hours_header(t)
    md = [("experiment · schedule", cell_label), ("target", lambda r: fmt(r["target_reward"])),
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
    runs["arm"] = [arms[k] for k in zip(runs["experiment"], runs["schedule"], runs["seed"], strict=True)]
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
    t = join_cells(base, _device_columns(runs), stat_columns(over_seeds(at, "rolling", prefix="reward"), "reward"),
              rounds_at, stat_columns(over_seeds(pairs, "gap_points", prefix="gap_points"), "gap_points"))
    md = [("experiment · schedule", cell_label), ("arm (config.yaml)", lambda r: r["arm"]),
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


def reward_curve_rows(res: Results, reward_key: str = "reward_mean") -> pd.DataFrame:
    """Per experiment, schedule and round (warm-up included, it is part of the curve): mean, std over seeds."""
    order = {(e, s): i for i, (e, s) in enumerate(cells(run_frame(res))[CELL].itertuples(index=False))}
    r = res.rounds[[*CELL, "round"]].assign(value=numeric(res.rounds, reward_key))
    r = r.assign(_cell=[order[k] for k in zip(r["experiment"], r["schedule"], strict=True)])
    r = r.sort_values(["_cell", "round"])
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
    order = {k: i for i, k in enumerate(zip(b["experiment"], b["schedule"], strict=True))}
    out["_o"] = [order[k] for k in zip(out["experiment"], out["schedule"], strict=True)]
    out = out.sort_values(["_o", "what", "seed", "round"], kind="stable", na_position="first")
    return out[[*cols, "what", "seed", "round", "device_s", "reward", "reward_std", "budget_device_s",
                "reward_key"]].reset_index(drop=True)
