"""Task tables and the per-round draw.

A task key is "<dataset>/<task_id>". The draw of a round's prompts is a pure function of
(seed, round, task table), so every schedule and every resumed run sees the same prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.engines.base import request_seed
from tsrl_cli.envs.tasks import make_env
from tsrl_cli.errors import UsageError
from tsrl_cli.rl.toy import ECHO, EchoEnv, echo_tasks
from tsrl_cli.rl.types import GroupSpec, RoundPlan


def load_task_table(datasets: tuple[str, ...], limit: int | None = None) -> dict[str, tuple[Path | None, object]]:
    """key -> (dataset folder, task), in dataset order then task order."""
    table: dict[str, tuple[Path | None, object]] = {}
    for name in datasets:
        if name == ECHO:
            for t in echo_tasks()[:limit]:
                table[f"echo/{t.task_id}"] = (None, t)
            continue
        ds = open_dataset(name, limit)
        for t in ds.tasks:
            table[f"{ds.name}/{t.task_id}"] = (ds.path, t)
    if not table:
        raise UsageError(f"no tasks in {', '.join(datasets)}")
    return table


def make_task_env(entry: tuple[Path | None, object], executor: str = "local"):
    """The AgentEnv for one task (call `await env.start()` first)."""
    d, task = entry
    if getattr(task, "kind", None) == "echo":
        return EchoEnv(task)

    return make_env(task, d, executor=executor)


def draw_prompts(keys: list[str], seed: int, round_: int, n: int) -> list[str]:
    """n task keys for this round: a seeded permutation (chained when n exceeds the table)."""
    rng = random.Random(request_seed(seed, round_, "prompts"))
    out: list[str] = []
    while len(out) < n:
        perm = list(keys)
        rng.shuffle(perm)
        out += perm[: n - len(out)]
    return out


def plan_round(keys: list[str], seed: int, round_: int, prompts: int, group_size: int,
               save_checkpoint: bool = False) -> RoundPlan:
    seen: dict[str, int] = {}
    groups = []
    for key in draw_prompts(keys, seed, round_, prompts):
        seen[key] = seen.get(key, 0) + 1
        gid = key if seen[key] == 1 else f"{key}#{seen[key]}"
        groups.append(GroupSpec(gid, key, group_size))
    return RoundPlan(round_, tuple(groups), save_checkpoint)
