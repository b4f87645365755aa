"""A task's image for the docker executor: its prebuilt image, else one built from its own Dockerfile.

    repair task     task.image (SWE-bench / SWE-smith images are prebuilt)
    terminal task   task.docker_image (task.toml), else `tsrl-task-<id>:<dir sha 12>[-<mapping 8>]`
                    built from environment/Dockerfile (TB 1.x: its Dockerfile or the one service of
                    its docker-compose.yaml with a `build` section)

The tag is a function of the task and the FROM mapping (`--base-image FROM=LOCAL`, config
`docker.base_images`), so the process that builds the images (`tsrl eval tbench`, `tsrl train`
before any worker starts) and the processes that run the tasks agree on it without talking.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox.images import build_image, task_image_tag


def image_workdir(environment_dir: Path, default: str = "/app") -> str:
    """The last WORKDIR of environment/Dockerfile (Harbor images work in /app), else `default`."""
    df = Path(environment_dir) / "Dockerfile"
    if not df.is_file():
        return default
    found = re.findall(r"^\s*WORKDIR\s+(\S+)\s*$", df.read_text(errors="replace"), flags=re.MULTILINE | re.IGNORECASE)
    return found[-1] if found and found[-1].startswith("/") else default


def task_image(task, base_images: dict[str, str] | None = None) -> str | None:
    """The image the docker executor runs `task` in (a built one must exist: build_task_images)."""
    if task.kind == "repair":
        return task.image
    if task.docker_image:
        return task.docker_image
    return task_image_tag(task.task_id, task.dir_sha256, base_images or {})


def build_context(env_dir: Path, task_id: str) -> tuple[Path, str]:
    """(context folder, Dockerfile path in it) of a task's environment: its Dockerfile, else the one
    service of its docker-compose.yaml that has a `build` section."""
    if (env_dir / "Dockerfile").is_file():
        return env_dir, "Dockerfile"
    for name in ("docker-compose.yaml", "docker-compose.yml"):
        p = env_dir / name
        if not p.is_file():
            continue
        try:
            doc = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise UsageError(f"task {task_id}: {p}: not valid YAML ({str(e).splitlines()[0]})") from None
        builds = [s["build"] for s in (doc.get("services") or {}).values() if isinstance(s, dict) and s.get("build")]
        if len(builds) != 1:
            raise UsageError(f"task {task_id}: {p}: expected one service with a `build` section, found {len(builds)} "
                             "(multi-container tasks need --via-harbor)")
        b = builds[0] if isinstance(builds[0], dict) else {"context": builds[0]}
        ctx = (env_dir / str(b.get("context", "."))).resolve()
        return ctx, str(b.get("dockerfile", "Dockerfile"))
    raise UsageError(f"task {task_id}: no Dockerfile or docker-compose.yaml in {env_dir}, and no docker_image "
                     "in task.toml: nothing to run it in")


def build_task_images(entries: Iterable[tuple[Path, object]], *, base_images: dict[str, str], log_dir: Path,
                      progress: Callable[[str], None]) -> tuple[dict[str, str], dict[str, str]]:
    """Build what the terminal tasks among (dataset folder, task) pairs need and lack.

    Returns ({task id: image}, the FROM mapping the builds used). Images already present are reused
    (their tag names the task directory's sha256); logs go to log_dir/<task id>.log; a failed build
    raises ImageBuildFailed, one line naming the task and its log, before anything runs.
    """
    images, used, built = {}, {}, set()
    for dataset_dir, t in entries:
        if t.kind != "terminal":
            continue
        tag = images[t.task_id] = task_image(t, base_images)
        if not t.docker_image and tag not in built:
            built.add(tag)
            ctx, dockerfile = build_context(Path(dataset_dir) / t.task_dir / t.environment_dir, t.task_id)
            used.update(build_image(ctx, tag=tag, what=f"task {t.task_id}", log_path=log_dir / f"{t.task_id}.log",
                                    dockerfile=dockerfile, base_images=base_images, timeout_s=t.build_timeout_s,
                                    progress=progress))
    return images, used
