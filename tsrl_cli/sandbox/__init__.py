"""Sandboxes for agent-written commands: `open_sandbox(task_dir, executor=...)` -> Sandbox.

`local` (bubblewrap or unshare, see local.py, bwrap.py, unshare.py) and `docker` (docker.py) share
one interface (base.py). Importing this package imports neither torch nor the docker package.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox.base import LIMIT_NAMES, ExecResult, IsolationError, Limits, Mount, Sandbox
from tsrl_cli.sandbox.docker import DockerSandbox
from tsrl_cli.sandbox.local import LocalSandbox

EXECUTORS = ("local", "docker")

__all__ = ["EXECUTORS", "LIMIT_NAMES", "ExecResult", "IsolationError", "Limits", "Mount", "Sandbox", "open_sandbox"]


def open_sandbox(
    task_dir: str | os.PathLike | None,
    *,
    executor: str = "local",
    image: str | None = None,
    limits: Limits | None = None,
    allow_unisolated: bool = False,
    isolation: str = "auto",
    mounts: Iterable[Mount] | None = None,
) -> Sandbox:
    """A fresh sandbox for one trajectory, starting from a copy of task_dir. Close it (or use `with`).

    `mounts` (Mount(host, target, read_only=True)) are shown to every command; `sandbox.run(...,
    mounts=[...])` shows more to one command only (a verifier's /tests, its /logs/verifier).
    """
    if executor == "local":
        return LocalSandbox(task_dir, limits=limits, isolation=isolation, allow_unisolated=allow_unisolated,
                            mounts=mounts)
    if executor == "docker":
        if image is None:
            raise UsageError("the docker executor needs an image (--image, or the task's image)")
        return DockerSandbox(task_dir, image=image, limits=limits, mounts=mounts)
    raise UsageError(f"executor {executor!r}: expected one of {', '.join(EXECUTORS)}")
