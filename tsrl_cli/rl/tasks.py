"""Task tables and the per-round draw.

A task key is "<dataset>/<task_id>". The draw of a round's prompts is a pure function of
(seed, round, task table), so every schedule and every resumed run sees the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from tsrl_cli.agent.oracle import oracle_turn_tokens
from tsrl_cli.agent.template import make_renderer
from tsrl_cli.config import TrainConfig, parse_base_images
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.engines.protocol import request_seed
from tsrl_cli.envs.images import build_task_images
from tsrl_cli.envs.pull import require_images
from tsrl_cli.envs.tasks import make_env
from tsrl_cli.errors import UsageError
from tsrl_cli.rl.toy import ECHO, EchoEnv, echo_tasks
from tsrl_cli.rl.types import GroupSpec, RoundPlan
from tsrl_cli.sandbox.docker_client import docker_unavailable_reason


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


def make_task_env(entry: tuple[Path | None, object], executor: str = "local",
                  base_images: dict[str, str] | None = None):
    """The AgentEnv for one task (call `await env.start()` first); base_images: docker.base_images, parsed."""
    d, task = entry
    if getattr(task, "kind", None) == "echo":
        return EchoEnv(task)
    return make_env(task, d, executor=executor, base_images=base_images)


def prepare_environments(cfg: TrainConfig, table: dict[str, tuple[Path | None, object]], tokenizer, log_dir: Path,
                         note: Callable[[str], None]) -> None:
    """Before any worker starts: every task's environment can be made, the docker executor's task
    images exist (built from their Dockerfiles, logs in log_dir; prebuilt ones already pulled: a missing one
    is named with the `tsrl env pull` that fetches them, instead of 128 sessions each pulling it inside an
    environment start), and under rollout.agent oracle
    every task has a reference solution that fits in one turn. The chat format is resolved here first
    (model.chat_template, rollout.thinking), so a tokenizer the agent cannot talk to fails before any
    worker starts. UsageError (exit 2) or ImageBuildFailed (exit 1), one line naming the task, otherwise."""
    ro = cfg.rollout
    renderer = make_renderer(tokenizer, cfg.model.chat_template, ro.thinking)
    base_images = parse_base_images(cfg.docker.base_images, where="config key docker.base_images:")
    if ro.executor == "docker":
        reason = docker_unavailable_reason()
        if reason:
            raise UsageError(f"rollout.executor docker: {reason}")
        for src, dst in base_images.items():
            note(f"docker.base_images: FROM {src} is built from the local image {dst}")
        tasks = [e for e in table.values() if e[0] is not None]
        build_task_images(tasks, base_images=base_images, log_dir=log_dir, progress=note)
        require_images(tasks, [n for n in cfg.data.train if n != ECHO])
    longest = (0, "")
    for key, entry in table.items():
        env = make_task_env(entry, ro.executor, base_images)
        if ro.agent != "oracle":
            continue
        if not hasattr(env, "oracle_command"):
            raise UsageError(f"rollout.agent oracle: task {key} has no reference solution to play")
        longest = max(longest, (oracle_turn_tokens(renderer, env.oracle_command()), key))
    if longest[0] > ro.max_turn_tokens:
        raise UsageError(f"rollout.agent oracle: task {longest[1]}'s solution is {longest[0]} tokens, over "
                         f"rollout.max_turn_tokens {ro.max_turn_tokens}; raise it "
                         f"(--set rollout.max_turn_tokens={longest[0]}, the longest)")


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
               save_checkpoint: bool = False, journal: bool = False) -> RoundPlan:
    seen: dict[str, int] = {}
    groups = []
    for key in draw_prompts(keys, seed, round_, prompts):
        seen[key] = seen.get(key, 0) + 1
        gid = key if seen[key] == 1 else f"{key}#{seen[key]}"
        groups.append(GroupSpec(gid, key, group_size))
    return RoundPlan(round_, tuple(groups), save_checkpoint, journal)
