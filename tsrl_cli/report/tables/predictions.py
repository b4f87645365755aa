"""The event model (tsrl_cli.predict) against the runs: predicted and measured step time per round, the paired
sync/stream speedup, their summary table, and the speedup against a spread config value (figure data).
"""

from __future__ import annotations

import pandas as pd

from tsrl_cli.errors import UsageError
from tsrl_cli.predict import predict_rounds
from tsrl_cli.report.aggregate import CELL, LAST_ROUND, STATS, WARMUP_ROUNDS
from tsrl_cli.report.load import Run, config_value, flat_config
from tsrl_cli.report.tables.table import Table, cell_label, fmt, ratio
from tsrl_cli.traces import load_trace

PRED_COLUMNS = ["experiment", "schedule", "seed", "round", "measured_s", "predicted_s", "error_pct", "sync_s",
                "stream_s", "async_s", "predicted_speedup", "ceiling", "makespan_s", "work_s", "learners"]


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

    both = ratio(m["sync_s_sync"], m["stream_s"])
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
    md = [("experiment · what", cell_label), ("rows", lambda r: str(r["rows"])),
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
