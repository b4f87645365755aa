"""Runs -> tables: pandas frames, one row per experiment x schedule unless said otherwise.

Every number over seeds goes through report.aggregate (warm-up dropped, per-seed reduce, mean ±
std and 95 % t-interval over seeds). Each Table carries the markdown columns it renders; its CSV
is every column of its frame. Rows come sync, stream, async within an experiment.

  table.py         Table, cell formatting (fmt, pm), the run and cell frames every table starts from
  steps.py         step time and speedup, learner idle, peak memory, the exactness certificate, one round's Gantt
  rewards.py       device-hours to a target reward, reward at a fixed budget, the reward curves
  predictions.py   the event model against the runs, the speedup against a spread value
"""

from tsrl_cli.report.tables.predictions import (
    PRED_COLUMNS,
    paired_speedup_rows,
    prediction_rows,
    prediction_table,
    spread_rows,
)
from tsrl_cli.report.tables.rewards import (
    BUDGET_FREE_KEYS,
    ROLLING_ROUNDS,
    arm_label,
    budget_curve_rows,
    budget_groups,
    budget_table,
    reward_curve_rows,
    rolling_reward,
    target_table,
)
from tsrl_cli.report.tables.steps import (
    MEMORY_KEYS,
    SYNC_BASELINES,
    certificate_table,
    certified,
    gantt_rows,
    idle_table,
    memory_table,
    step_time_table,
    sync_baseline,
)
from tsrl_cli.report.tables.table import SCHEDULE_ORDER, Table, cells, fmt, pm, records, run_frame, to_csv

__all__ = ["BUDGET_FREE_KEYS", "MEMORY_KEYS", "PRED_COLUMNS", "ROLLING_ROUNDS", "SCHEDULE_ORDER", "SYNC_BASELINES",
           "Table", "arm_label", "budget_curve_rows", "budget_groups", "budget_table", "cells", "certificate_table",
           "certified", "fmt", "gantt_rows", "idle_table", "memory_table", "paired_speedup_rows", "pm",
           "prediction_rows", "prediction_table", "records", "reward_curve_rows", "rolling_reward", "run_frame",
           "spread_rows", "step_time_table", "sync_baseline", "target_table", "to_csv"]
