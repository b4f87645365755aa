"""What each schedule trains on: the trajectories a run sampled against those that entered an optimizer step.

Two records of every round, written by different processes (docs/run-directory.md):

    sampled  the rollout side's own tally. Its `sampled` event (each trajectory's tokens and turns, the
             trajectories per task), else metrics.jsonl (`trajectories`, `tokens`, `turns_mean`,
             `exit_reasons`: counts and means, no distribution). Where a round has no `sampled` event but
             its learner rows account for the tally (as many trajectories, the same tokens and turns in
             sum), those rows stand for the sampled distribution: source "derived".
    trained  the learner's rows of rounds that have a `step` event (the step they entered): GRPO `item`
             rows (one per trajectory), OPD `trajectory` rows, else the trajectories the OPD turn `item`
             rows name (turns = their count, tokens = learner_work's sum for the round).

Staleness is each trained row's own (learner version minus generating version). What is cut: a trajectory
ended by a limit of the agent loop (max_turns, token_limit, wall_clock) is cut short and still trained on;
an error (env_error, engine_error) ends it early; a group `loss.max_open_groups` deferred waits for its
close (stream); a sampled trajectory outside every step is not trained on. What only delays: the wait of
an arrived item for its backward, and the rollout's wait for weights between two rounds (on-policy: for
the previous round's; async: for the version `offpolicy.max_staleness` allows).

Every round 1..last_round counts (warm-up included: every round's step trains on its data); trajectories
are pooled over a cell's seeds and rounds. A quantity the runs did not record is NaN, shown "not recorded".
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import pandas as pd

from tsrl_cli.report.aggregate import CELL, LAST_ROUND
from tsrl_cli.report.load import Results, Run, config_value
from tsrl_cli.report.tables import SCHEDULE_ORDER, Table, cells, fmt, run_frame
from tsrl_cli.rundir import EVENTS, SKIP

LIMITS = ("max_turns", "token_limit", "wall_clock")  # the agent loop's limits (agent/loop.py)
ERRORS = ("env_error", "engine_error")
NOT_RECORDED = "not recorded"
TOKEN_BINS = 20
_COPY = re.compile(r"#\d+$")  # a group of a task drawn twice in a round: '<task>#2' (rl/tasks.py)


def task_of(group_id: str) -> str:
    """The task key of a group id: the id without its '#k' suffix."""
    return _COPY.sub("", str(group_id))


# ---------------------------------------------------------------------------- one run


def run_audit(run: Run, metrics: dict[int, dict],
              last_round: int = LAST_ROUND) -> tuple[list[dict], list[dict], list[float]]:
    """One run's learner trajectories (one dict each), its rounds (the sampled tally beside the learner's
    count) and its items' waits from arrival to backward (seconds, rounds that stepped)."""
    by: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for e in run.dir.rows(EVENTS, SKIP):
        k = e.get("round")
        if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= last_round:
            by[k][e.get("event")].append(e)
    opd = (config_value(run.config, "objective") or next((m.get("objective") for m in metrics.values()), None)) == "opd"
    trajs, rounds, waits = [], [], []
    for k in sorted(set(by) | {r for r in metrics if r <= last_round}):
        ev, m = by.get(k, {}), metrics.get(k, {})
        stepped = bool(ev.get("step"))
        mine = _trajectories(k, ev, opd, stepped)
        trajs += mine
        if stepped:
            waits += [e["backward_start_s"] - e["finished_at_s"] for e in ev.get("item", [])
                      if _num(e.get("backward_start_s")) is not None and _num(e.get("finished_at_s")) is not None]
        rounds.append(_round(k, ev, m, mine, stepped))
    _rollout_waits(rounds, by)
    return trajs, rounds, waits


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _trajectories(k: int, ev: dict, opd: bool, stepped: bool) -> list[dict]:
    items = ev.get("item", [])

    def row(e, **over):
        return {"round": k, "task": task_of(e.get("group_id")), "tokens": _num(e.get("tokens")),
                "turns": _num(e.get("turns")), "exit": e.get("exit"), "staleness": _num(e.get("staleness")),
                "deferred": e.get("deferred"), "trained": stepped, **over}

    if not opd:
        return [row(e) for e in items]
    turns: dict[tuple, list[dict]] = defaultdict(list)
    for e in items:
        turns[(e.get("group_id"), e.get("sample_index"))].append(e)

    def deferred(key):
        flags = [e.get("deferred") for e in turns.get(key, [])]
        return None if not flags or any(f is None for f in flags) else any(flags)

    if ev.get("trajectory"):  # the learner's own row per OPD trajectory
        return [row(e, deferred=deferred((e.get("group_id"), e.get("sample_index")))) for e in ev["trajectory"]]
    # older runs: the trajectories their turn rows name; the number of rows is the number of model turns
    return [row(rows[0], tokens=None, turns=float(len(rows)), exit=None, deferred=deferred(key),
                staleness=_all([_num(e.get("staleness")) for e in rows]) and max(_num(e["staleness"]) for e in rows))
            for key, rows in turns.items()]


def _round(k: int, ev: dict, m: dict, mine: list[dict], stepped: bool) -> dict:
    """The sampled tally of round k beside what reached the learner."""
    n = len(mine)
    tokens = [t["tokens"] for t in mine]
    work = ev.get("learner_work", [{}])[0] if ev.get("learner_work") else {}
    learner_tokens = sum(tokens) if n and None not in tokens else _num(work.get("trajectory_tokens"))
    turns = [t["turns"] for t in mine]
    learner_turns = sum(turns) if n and None not in turns else None
    exits = m.get("exit_reasons") if isinstance(m.get("exit_reasons"), dict) else None
    out = {"round": k, "stepped": stepped, "learner_n": n, "learner_tokens": learner_tokens, "exits": exits,
           "dist_tokens": None, "dist_turns": None, "tasks": None}
    s = ev.get("sampled")
    if s and isinstance(s[0].get("tokens"), list):  # the rollout side's own rows
        s = s[0]
        out.update(source="rollout", sampled_n=len(s["tokens"]), sampled_tokens=float(sum(s["tokens"])),
                   sampled_turns=float(sum(s.get("turns") or [])) if s.get("turns") is not None else None,
                   dist_tokens=list(s["tokens"]), dist_turns=s.get("turns"),
                   tasks=dict(s["tasks"]) if isinstance(s.get("tasks"), dict) else None)
        return out
    sn, st, tm = _num(m.get("trajectories")), _num(m.get("tokens")), _num(m.get("turns_mean"))
    out.update(source="tally", sampled_n=sn, sampled_tokens=st,
               sampled_turns=tm * sn if tm is not None and sn else None)
    # the learner's rows stand for the sampled set when they account for the tally: the same count, tokens, turns
    same = (sn is not None and n == sn and n > 0 and learner_tokens is not None and st is not None
            and math.isclose(learner_tokens, st, rel_tol=1e-9)
            and (learner_turns is None or out["sampled_turns"] is None
                 or math.isclose(learner_turns, out["sampled_turns"], rel_tol=1e-9)))
    if same:
        out.update(source="derived", dist_tokens=tokens if None not in tokens else None,
                   dist_turns=turns if None not in turns else None, tasks=dict(Counter(t["task"] for t in mine)))
    return out


def _rollout_waits(rounds: list[dict], by: dict) -> None:
    """Each round's `held_s`: from the end of the rollout's previous round to the start of this one (absolute
    times: round k starts when round k-1's round_end is reached), the rollout waiting for weights."""
    start, ends = 0.0, {}
    for r in rounds:
        k = r["round"]
        ev = by.get(k, {})
        ro = ev.get("rollout", [{}])[0] if ev.get("rollout") else {}
        end = ev.get("round_end", [{}])[0] if ev.get("round_end") else {}
        a, b = _num(ro.get("start_s")), _num(ro.get("end_s"))
        prev = ends.get(k - 1)
        r["held_s"] = start + a - prev if a is not None and prev is not None and start is not None else None
        if b is not None and start is not None:
            ends[k] = start + b
        at = _num(end.get("at_s"))
        start = start + at if start is not None and at is not None else None


# ---------------------------------------------------------------------------- the table


def _share(counter: Counter, total: float) -> str:
    return ", ".join(f"{k}: {fmt(100 * v / total)} %" for k, v in sorted(counter.items())) if total else "–"


def _quantile(xs: list[float], q: float) -> float | None:
    return float(pd.Series(xs, dtype="float64").quantile(q)) if xs else None


def _all(values: list):
    """The list when every entry is recorded, else None (a statistic over part of the data is not the data's)."""
    return values if values and all(v is not None for v in values) else None


def _cell(runs: list[Run], trajs: list[dict], rounds: list[dict], waits: list[float]) -> tuple[dict, list[dict]]:
    """One cell's audit (the table's row) and its per-task rows."""
    trained = [t for t in trajs if t["trained"]]
    n_tr = len(trained)
    sn = _all([r["sampled_n"] for r in rounds])
    sampled = int(sum(sn)) if sn and float(sum(sn)).is_integer() else sum(sn) if sn else None
    out = {"sampled": sampled, "trained": n_tr, "trained_pct": 100 * n_tr / sampled if sampled else None,
           "not_trained": sampled - n_tr if sampled is not None else None,
           "rounds": len(rounds), "rounds_without_step": sum(not r["stepped"] for r in rounds),
           "sampled_source": "+".join(sorted({r["source"] for r in rounds})) or None}
    # tokens per trajectory
    st = _all([r["sampled_tokens"] for r in rounds])
    out["tokens_sampled_mean"] = sum(st) / sampled if st and sampled else None
    tt = _all([t["tokens"] for t in trained])
    lt = _all([r["learner_tokens"] for r in rounds if r["stepped"]])
    out["tokens_trained_mean"] = sum(tt) / n_tr if tt else sum(lt) / n_tr if lt and n_tr else None
    dist = _all([r["dist_tokens"] for r in rounds])
    dist = [x for d in dist for x in d] if dist else []
    for q in (50, 90):
        out[f"tokens_sampled_p{q}"] = _quantile(dist, q / 100)
        out[f"tokens_trained_p{q}"] = _quantile(tt or [], q / 100)
    # model turns per trajectory
    su = _all([r["sampled_turns"] for r in rounds])
    out["turns_sampled_mean"] = sum(su) / sampled if su and sampled else None
    tu = _all([t["turns"] for t in trained])
    out["turns_trained_mean"] = sum(tu) / n_tr if tu else None
    # tasks: the share of each task's sampled trajectories that entered a step
    tasks = _all([r["tasks"] for r in rounds])
    per_task = []
    if tasks:
        s_task = sum((Counter(d) for d in tasks), Counter())
        t_task = Counter(t["task"] for t in trained)
        per_task = [{"task": k, "sampled": v, "trained": t_task.get(k, 0), "trained_pct": 100 * t_task.get(k, 0) / v}
                    for k, v in sorted(s_task.items())]
        per_task += [{"task": k, "sampled": 0, "trained": v, "trained_pct": None}  # trained, never sampled: a defect
                     for k, v in sorted(t_task.items()) if k not in s_task]
    out["tasks"] = len(per_task) or None
    out["task_trained_pct_min"] = min((p["trained_pct"] for p in per_task if p["trained_pct"] is not None),
                                      default=None)
    # staleness of what was trained
    stale = _all([t["staleness"] for t in trained])
    out["staleness_mean"] = sum(stale) / n_tr if stale else None
    out["staleness_max"] = max(stale) if stale else None
    out["staleness_shares"] = _share(Counter(int(s) for s in stale), n_tr) if stale else None
    # cut short (the sampled tally's exit reasons), and among the trained rows where they carry theirs
    ex = _all([r["exits"] for r in rounds])
    ex = sum((Counter({k.split(":")[0]: v for k, v in d.items()}) for d in ex), Counter()) if ex else None
    out["cut_short_sampled_pct"] = 100 * sum(ex[k] for k in LIMITS) / sampled if ex is not None and sampled else None
    out["cut_short_by"] = ", ".join(f"{k} {fmt(100 * ex[k] / sampled)} %" for k in LIMITS if ex[k]) or "none" \
        if ex is not None and sampled else None
    out["errors_sampled"] = sum(ex[k] for k in ERRORS) if ex is not None else None
    te = _all([t["exit"] for t in trained])
    out["cut_short_trained_pct"] = 100 * sum(e in LIMITS for e in te) / n_tr if te else None
    # deferred by loss.max_open_groups (stream only), waits
    caps = {config_value(r.config, "loss.max_open_groups") for r in runs}
    out["max_open_groups"] = next(iter(caps)) if len(caps) == 1 else "mixed"
    flags = _all([t["deferred"] for t in trained])
    out["deferred"] = sum(bool(f) for f in flags) if flags else None
    out["wait_s_mean"] = sum(waits) / len(waits) if waits else None
    out["wait_s_p90"] = _quantile(waits, 0.9)
    held = [r["held_s"] for r in rounds if r.get("held_s") is not None]
    out["rollout_wait_s_mean"] = sum(held) / len(held) if held else None
    return out, per_task


def bias_rows(res: Results, last_round: int = LAST_ROUND) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per cell the audit (one row), per cell and task the trained share, and the figure's rows."""
    frame = res.rounds
    by_run: dict[tuple, tuple] = {}
    for run in res.runs:
        mine = frame[(frame["experiment"] == run.experiment) & (frame["schedule"] == run.schedule)
                     & (frame["seed"] == run.seed)]
        metrics = {int(r["round"]): r for r in mine.to_dict("records")}
        by_run[(run.experiment, run.schedule, run.seed)] = (run, *run_audit(run, metrics, last_round))
    base = cells(run_frame(res))
    rows, tasks, pools = [], [], defaultdict(lambda: ([], []))
    for cell in base.to_dict("records"):
        got = [v for k, v in by_run.items() if (k[0], k[1]) == (cell["experiment"], cell["schedule"])]
        trajs = [t for g in got for t in g[1]]
        rounds = [r for g in got for r in g[2]]
        one, per_task = _cell([g[0] for g in got], trajs, rounds, [w for g in got for w in g[3]])
        rows.append({**cell, **one})
        tasks += [{"experiment": cell["experiment"], "schedule": cell["schedule"], **p} for p in per_task]
        pools[cell["schedule"]][0].extend(trajs)
        pools[cell["schedule"]][1].extend(rounds)
    t = pd.DataFrame(rows) if rows else pd.DataFrame(columns=[*CELL, "seeds"])
    task_cols = [*CELL, "task", "sampled", "trained", "trained_pct"]
    return t, pd.DataFrame(tasks, columns=task_cols), figure_rows(pools)


def bias_table(res: Results, last_round: int = LAST_ROUND) -> tuple[Table, pd.DataFrame, pd.DataFrame]:
    """The table 'What each schedule trains on', the per-task rows and the figure's rows."""
    t, tasks, fig = bias_rows(res, last_round)

    def nr(x, digits=3):
        return NOT_RECORDED if x is None or (isinstance(x, float) and math.isnan(x)) else fmt(x, digits)

    def arrow(r, a, b):
        return f"{nr(r[a])} → {nr(r[b])}"

    def count(r):
        return f"{nr(r['sampled'])} → {r['trained']} ({nr(r['trained_pct'], 4)} %)"

    def tokens(r):
        return f"{arrow(r, 'tokens_sampled_mean', 'tokens_trained_mean')} (p90 " \
               f"{arrow(r, 'tokens_sampled_p90', 'tokens_trained_p90')})"

    def task_col(r):
        if r["tasks"] is None:
            return NOT_RECORDED
        return f"{fmt(r['tasks'])} tasks, least {fmt(r['task_trained_pct_min'], 4)} %"

    def cut(r):
        return NOT_RECORDED if r["cut_short_by"] is None else r["cut_short_by"] + (
            f"; {fmt(r['errors_sampled'])} errors" if r["errors_sampled"] else "")

    def deferred(r):
        if r["schedule"] != "stream":
            return "–"
        if r["max_open_groups"] is None:
            return "cap off"
        return NOT_RECORDED if r["deferred"] is None else f"{fmt(r['deferred'])} (cap {fmt(r['max_open_groups'])})"

    md = [("experiment · schedule", lambda r: f"{r['experiment']} · {r['schedule']}"),
          ("seeds", lambda r: r["seeds"]),
          ("trajectories sampled → trained", count),
          ("tokens/trajectory sampled → trained, mean (p90)", tokens),
          ("turns sampled → trained", lambda r: arrow(r, "turns_sampled_mean", "turns_trained_mean")),
          ("tasks: least share trained", task_col),
          ("staleness of trained", lambda r: r["staleness_shares"] or NOT_RECORDED),
          ("cut short at a limit (sampled)", cut),
          ("deferred to group close", deferred),
          ("wait for backward s, mean (p90)", lambda r: f"{nr(r['wait_s_mean'])} ({nr(r['wait_s_p90'])})"),
          ("rollout waits for weights s/round", lambda r: nr(r["rollout_wait_s_mean"]))]
    note = (f"Rounds 1-{last_round}, warm-up included; trajectories pooled over seeds and rounds. Sampled: the "
            "rollout side's tally (events `sampled`, else metrics.jsonl counts and means; its distribution is "
            "`derived` from the learner's rows when they account for the tally's count, tokens and turns). "
            "Trained: the learner's trajectories in rounds with an optimizer step. Staleness: learner version "
            "minus generating version, as a share of trained trajectories. Cut short: ended by max_turns, "
            "token_limit or wall_clock (still trained on, truncated). Deferred: trained trajectories whose group "
            "loss.max_open_groups held back (stream: its backwards waited for its close or a free buffer). "
            "Wait: an item's arrival at the learner to its "
            "backward. Rollout wait: end of one round's generation to the start of the next (on-policy: the "
            "previous round's weights; async: the version its bound allows). docs/reports.md, 'What each "
            "schedule trains on'; every column in tables/trained_vs_sampled.csv, per task in "
            "tables/trained_vs_sampled_tasks.csv.")
    return Table("trained_vs_sampled", "What each schedule trains on", t, md, note=note), tasks, fig


# ---------------------------------------------------------------------------- the figure's rows


def figure_rows(pools: dict[str, tuple[list[dict], list[dict]]]) -> pd.DataFrame:
    """Per schedule (pooled over its experiments): the share of trajectories per token bin, per number of
    turns and per staleness, sampled and trained (`kind` bin), and each quantity's means (`kind` mean).
    Token bins are shared by every schedule; a sampled distribution that was not recorded has no bin rows."""
    order = sorted(pools, key=lambda s: (SCHEDULE_ORDER.get(s, 9), s))
    data = {}
    for s in order:
        trajs, rounds = pools[s]
        trained = [t for t in trajs if t["trained"]]
        d_tok, d_turn = _all([r["dist_tokens"] for r in rounds]), _all([r["dist_turns"] for r in rounds])
        sn = _all([r["sampled_n"] for r in rounds])
        st, su = _all([r["sampled_tokens"] for r in rounds]), _all([r["sampled_turns"] for r in rounds])
        data[s] = {
            ("tokens", "sampled"): [x for d in d_tok for x in d] if d_tok else None,
            ("tokens", "trained"): _all([t["tokens"] for t in trained]),
            ("turns", "sampled"): [x for d in d_turn for x in d] if d_turn else None,
            ("turns", "trained"): _all([t["turns"] for t in trained]),
            ("staleness", "trained"): _all([t["staleness"] for t in trained]),
            ("means", "sampled"): {"tokens": sum(st) / sum(sn) if st and sn and sum(sn) else None,
                                   "turns": sum(su) / sum(sn) if su and sn and sum(sn) else None},
        }
    every = [x for s in data for k in (("tokens", "sampled"), ("tokens", "trained")) for x in (data[s][k] or [])]
    lo, hi = (min(every), max(every)) if every else (0.0, 1.0)
    width = (hi - lo) / TOKEN_BINS or 1.0
    edges = [lo + i * width for i in range(TOKEN_BINS + 1)]
    rows = []
    for s, d in data.items():
        for (q, which), xs in d.items():
            if q == "means":
                rows += [{"schedule": s, "quantity": k, "set": "sampled", "kind": "mean", "value": v}
                         for k, v in xs.items() if v is not None]
                continue
            if not xs:
                continue
            if which == "trained":  # the sampled means are the tally's (above), over every sampled trajectory
                rows.append({"schedule": s, "quantity": q, "set": which, "kind": "mean", "value": sum(xs) / len(xs)})
            if q == "tokens":
                counts = Counter(min(int((x - lo) / width), TOKEN_BINS - 1) for x in xs)
                bins = [(edges[i], edges[i + 1], counts.get(i, 0)) for i in range(TOKEN_BINS)]
            else:
                counts = Counter(int(x) for x in xs)  # whole numbers: one bin per value, low = high = the value
                bins = [(v, v, counts.get(v, 0)) for v in range(int(min(xs)), int(max(xs)) + 1)]
            rows += [{"schedule": s, "quantity": q, "set": which, "kind": "bin", "low": a, "high": b, "count": c,
                      "share": c / len(xs)} for a, b, c in bins]
    cols = ["schedule", "quantity", "set", "kind", "low", "high", "count", "share", "value"]
    return pd.DataFrame(rows, columns=cols)
