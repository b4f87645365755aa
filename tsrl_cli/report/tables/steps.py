"""What a step costs, per experiment x schedule: step time and speedup over sync, learner idle, peak memory,
the exactness certificate; and one round's timeline under sync and stream (the Gantt figure's data).
"""

from __future__ import annotations

import pandas as pd

from tsrl_cli.report.aggregate import CELL, LAST_ROUND, WARMUP_ROUNDS, aggregate, over_seeds, per_seed
from tsrl_cli.report.load import RUN, Results, Run, config_value, numeric
from tsrl_cli.report.tables.table import (
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
from tsrl_cli.rundir import EVENTS, SKIP

MEMORY_KEYS = ("peak_mem_learner_bytes", "peak_mem_rollout_bytes", "accumulator_peak_bytes")
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
    speed = over_seeds(pairs.assign(speedup=ratio(pairs["value_sync"], pairs["value"])), "speedup", prefix="speedup")
    busy = aggregate(rounds, "learner_busy_s", warmup, last_round)[CELL + ["learner_busy_s_mean"]]
    mk = aggregate(rounds, "rollout_makespan_s", warmup, last_round)[CELL + ["rollout_makespan_s_mean"]]
    t = join_cells(cells(runs), st.assign(rounds_per_seed=st["n_rounds"])[CELL + ["rounds_per_seed"]],
              stat_columns(st, "step_time_s"), stat_columns(speed, "speedup"), busy, mk)
    t["rounds_per_seed"] = t["rounds_per_seed"].fillna(0).astype(int)
    t["balance_busy_over_makespan"] = ratio(t["learner_busy_s_mean"], t["rollout_makespan_s_mean"])
    t["sync_baseline"] = t["experiment"].map(sync_baseline(res.runs))
    idle = aggregate(rounds, "learner_idle_frac", warmup, last_round)[CELL + ["learner_idle_frac_mean"]]
    t = join_cells(t, idle)
    t["sync_learner_idle_frac_mean"] = of_sync(t, "learner_idle_frac_mean")
    md = [("experiment · schedule", cell_label), ("seeds", lambda r: r["seeds"]),
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
    md = [("experiment · schedule", cell_label), ("seeds", lambda r: r["seeds"]),
          ("learner idle % of step time", lambda r: pm(r, "learner_idle_frac", scale=100))]
    t = join_cells(cells(run_frame(res)), stat_columns(idle, "learner_idle_frac"))
    return Table("learner_idle", "Learner idle fraction", t, md,
                 note="1 - learner busy / step time, per round; rounds after the warm-up.")


def memory_table(res: Results, last_round: int = LAST_ROUND) -> Table:
    """Peak bytes: the max over every round of a run (warm-up included: a peak is a peak), then over seeds."""
    peaks = {k: aggregate(res.rounds, k, 0, last_round, how="max") for k in MEMORY_KEYS}
    t = join_cells(cells(run_frame(res)), *(stat_columns(p, k) for k, p in peaks.items()))
    t["learner_peak_vs_sync"] = ratio(t["peak_mem_learner_bytes_mean"], of_sync(t, "peak_mem_learner_bytes_mean"))
    md = [("experiment · schedule", cell_label), ("seeds", lambda r: r["seeds"]),
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
    seeds = seeds[seeds["certified"] > 0].assign(share=lambda f: ratio(f["vs"], f["busy"]))
    per_cell = seeds.groupby(CELL, sort=False).agg(rounds_certified=("certified", "sum"),
                                                   verify_rel_diff_max=("rel_max", "max")).reset_index()
    share = over_seeds(seeds, "share", prefix="verify_share")
    t = join_cells(cells(run_frame(res)), per_cell, stat_columns(share, "verify_share"))
    t = t[t["rounds_certified"].notna()].reset_index(drop=True)
    t["rounds_certified"] = t["rounds_certified"].astype(int)
    md = [("experiment · schedule", cell_label), ("seeds", lambda r: r["seeds"]),
          ("rounds certified", lambda r: str(r["rounds_certified"])),
          ("max verify_rel_diff", lambda r: fmt(r["verify_rel_diff_max"])),
          ("verify_s % of learner busy", lambda r: pm(r, "verify_share", scale=100))]
    return Table("certificate", "Exactness certificate", t, md,
                 note="verify_rel_diff = max |lazy - other| / max |lazy| over the whole gradient of a round, the "
                      "step's gradient against its recomputation by the other decomposition (docs/streaming.md, "
                      "'The exactness certificate'); the maximum over every certified round and seed. Cost per "
                      "seed: sum of verify_s / sum of learner_busy_s over the certified rounds (busy time includes "
                      "the recomputation), then mean ± std [95 % t-interval] over seeds.")


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
