"""The Table every report table is (a frame and the markdown columns it renders), the number formatting of its
cells, and the frames every table starts from: one row per run, one per experiment x schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from tsrl_cli.report.aggregate import CELL, STATS
from tsrl_cli.report.load import RUN, Results, Run

SCHEDULE_ORDER = {"sync": 0, "stream": 1, "async": 2}


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


def fmt(x, digits: int = 3) -> str:
    """A cell: `digits` significant digits, whole numbers from 10**digits up, '–' for None."""
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


def cell_label(row: dict) -> str:
    """A row's first markdown cell: 'experiment · schedule'."""
    return f"{row['experiment']} · {row['schedule']}"


def ratio(a: pd.Series, b: pd.Series) -> pd.Series:
    """a / b, NaN where b is 0 or missing (a ratio to nothing is not measured)."""
    return a / b.where(b != 0)


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


def join_cells(base: pd.DataFrame, *parts: pd.DataFrame) -> pd.DataFrame:
    """base with each part's columns beside its rows (left join on the cell columns a part has)."""
    for p in parts:
        base = base.merge(p, on=[c for c in CELL if c in p], how="left")
    return base


def stat_columns(frame: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """The cell columns and `prefix`'s statistics over seeds (STATS: mean, std, ci_low, ci_high)."""
    return frame[CELL + [f"{prefix}_{s}" for s in STATS]]


def of_sync(t: pd.DataFrame, col: str) -> pd.Series:
    """Per row of t, `col` of its experiment's sync row (NaN when the experiment has none)."""
    sync = t.loc[t["schedule"] == "sync", ["experiment", col]]
    return t[["experiment"]].merge(sync, how="left")[col]
