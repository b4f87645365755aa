"""From a prepared dataset and a task id to a ready environment: what `tsrl env` and training use.

Start state per executor:
  repair task   local: <dataset>/<start_dir> (embedded tasks ship their repositories); docker: task.image
  terminal task local: a copy of <dataset>/<task_dir>/<environment_dir> (an approximation of the
                image for tasks whose environment is plain files); docker: task.docker_image, else
                the image built from its Dockerfile (envs/images.py)
"""

from __future__ import annotations

import asyncio
import difflib
import tempfile
from collections.abc import Callable
from pathlib import Path

from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.envs.images import build_task_images, task_image
from tsrl_cli.envs.repair import RepairEnv
from tsrl_cli.envs.terminal import TerminalEnv
from tsrl_cli.errors import UsageError


def find_task(tasks: list, task_id: str, dataset: str = ""):
    by_id = {t.task_id: t for t in tasks}
    if task_id in by_id:
        return by_id[task_id]
    near = difflib.get_close_matches(task_id, list(by_id), n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else f"; `tsrl env list --dataset {dataset}` lists them"
    raise UsageError(f"task {task_id!r} is not in dataset {dataset or '?'}{hint}")


def start_dir(dataset_dir: Path, task) -> Path | None:
    if task.kind == "repair":
        return dataset_dir / task.start_dir if task.start_dir else None
    return dataset_dir / task.task_dir / task.environment_dir


def make_env(task, dataset_dir: Path, *, executor: str = "local", base_images: dict[str, str] | None = None, **kw):
    """The AgentEnv for a task (call `await env.start()` before use). base_images: the FROM mapping a
    terminal task's image was built with (its tag depends on it)."""
    if task.kind == "repair":
        return RepairEnv(task, repo_dir=start_dir(dataset_dir, task), executor=executor, **kw)
    image = task_image(task, base_images) if executor == "docker" else None
    return TerminalEnv(task, dataset_dir, executor=executor, image=image, **kw)


def run_in_task(task_id: str, dataset: str, command: str, timeout_s: float, *, executor: str = "local",
                allow_unisolated: bool = False, base_images: dict[str, str] | None = None,
                progress: Callable[[str], None] = lambda m: None):
    """Run one command in a fresh environment of the task, exactly as the agent's bash tool would. Under
    docker a terminal task without a prebuilt image runs in the image built from its Dockerfile, as in
    training: built first when missing (FROM mapped by `base_images`; log under the temporary folder).

    Returns (ExecResult, the sandbox's isolation, its isolation summary, its visible roots).
    """
    ds = open_dataset(dataset)
    d, t = ds.path, find_task(ds.tasks, task_id, dataset)
    if executor == "local" and t.kind == "repair" and start_dir(d, t) is None:
        raise UsageError(f"task {task_id}: its start state exists only in the image {task_image(t)!r}; "
                         "use --executor docker where a Docker daemon runs")
    if executor == "docker":
        build_task_images([(d, t)], base_images=base_images or {},
                          log_dir=Path(tempfile.gettempdir()) / "tsrl-env-builds", progress=progress)
    elif base_images:
        raise UsageError("--base-image: only the docker executor builds images; add --executor docker")
    env = make_env(t, d, executor=executor, allow_unisolated=allow_unisolated, base_images=base_images)
    asyncio.run(env.start())
    try:
        sb = env.sandbox
        return env.exec(command, timeout_s), sb.isolation, sb.isolation_summary, sb.visible_roots
    finally:
        asyncio.run(env.close())
