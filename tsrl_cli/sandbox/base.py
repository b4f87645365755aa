"""The executor interface: one Sandbox per trajectory, `run(command, timeout_s) -> ExecResult`.

Agent-written commands are untrusted. A sandbox starts from a copy of the task's directory, runs
each command with `bash -c` in it, caps every resource it can, and never raises because a
command crashed or hung: what happened is in the ExecResult.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from tsrl_cli.errors import UsageError

LIMIT_NAMES = ("wall_clock", "cpu_time", "memory", "processes", "file_size", "output")


class IsolationError(UsageError):
    """No isolation is available and the caller did not allow running unisolated."""


@dataclass(frozen=True)
class Limits:
    """Caps for one command. Units: seconds and bytes. Defaults suit an agent's bash tool."""

    cpu_time_s: int = 120  # RLIMIT_CPU, per process (soft -> SIGXCPU, hard one second later -> SIGKILL)
    memory_bytes: int = 4 << 30  # RLIMIT_AS per process, and the cgroup memory cap of the whole tree where possible
    processes: int = 256  # RLIMIT_NPROC inside the sandbox's user namespace, and cgroup pids.max where possible
    file_size_bytes: int = 1 << 30  # RLIMIT_FSIZE: the largest file a command may write
    output_bytes: int = 1 << 20  # kept per stream (stdout, stderr); the rest is read and dropped
    output_kill_bytes: int = 32 << 20  # stdout + stderr read in total before the command is killed


@dataclass(frozen=True)
class Mount:
    """A host file or directory shown inside the sandbox at `target` (an absolute path).

    Read-only unless read_only=False. A target that does not exist is created as an empty mount
    point (the host is not changed). See `check_mounts` for what is refused.
    own_tree (read-write only): hand every file below `host` to the sandbox's uid for the mount's
    lifetime, not just the top folder, so commands may chmod/mv/rm what is already there. For a
    working copy tsrl made itself (a terminal task's /app), never for a user's folder.
    """

    host: str
    target: str
    read_only: bool = True
    own_tree: bool = False


# targets refused: the sandbox's own /proc, /dev and /sys are not to be covered
RESERVED_TARGETS = ("/proc", "/dev", "/sys")


def _overlaps(a: str, b: str) -> bool:
    """a and b are the same path, or one is inside the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def check_mounts(mounts: Iterable[Mount] | None, workdir: str | os.PathLike) -> tuple[Mount, ...]:
    """The mounts with host paths resolved and targets normalized, or UsageError (one line) saying why not.

    Refused: a host path that does not exist or is neither a directory nor a regular file, the
    host root, a host path containing the sandbox's working directory; a target that is not
    absolute, has `..`, is `/`, is under /proc, /dev or /sys, overlaps the working directory, or
    overlaps another mount's target.
    """
    out: list[Mount] = []
    wd = os.path.realpath(workdir) if os.path.isabs(str(workdir)) and os.path.exists(workdir) else str(workdir)
    for m in mounts or ():
        if not isinstance(m, Mount):
            raise UsageError(f"mount {m!r}: expected a Mount(host, target, read_only=True)")
        where = f"mount {m.host} -> {m.target}"
        if not os.path.exists(m.host):
            raise UsageError(f"{where}: the host path does not exist")
        host = os.path.realpath(m.host)
        if not (os.path.isdir(host) or os.path.isfile(host)):
            raise UsageError(f"{where}: the host path is neither a directory nor a regular file")
        if host == "/":
            raise UsageError(f"{where}: the host root cannot be mounted")
        if host == wd or wd.startswith(host + "/"):
            raise UsageError(f"{where}: the host path contains the sandbox's working directory")
        t = str(m.target)
        if not t.startswith("/") or ".." in t.split("/"):
            raise UsageError(f"{where}: the target must be an absolute path without '..'")
        t = posixpath.normpath(t)
        if t.startswith("//"):
            t = "/" + t.lstrip("/")
        if t == "/" or any(_overlaps(t, r) for r in RESERVED_TARGETS):
            raise UsageError(f"{where}: the target cannot be /, nor under {', '.join(RESERVED_TARGETS)}")
        if _overlaps(t, wd):
            raise UsageError(f"{where}: the target overlaps the sandbox's working directory {wd}")
        for o in out:
            if _overlaps(t, o.target):
                raise UsageError(f"{where}: the target overlaps another mount's target {o.target}")
        out.append(Mount(host, t, bool(m.read_only), bool(m.own_tree) and not m.read_only))
    return tuple(out)


@dataclass
class ExecResult:
    """What one command did. `limit` is None, or the limit that fired (one of LIMIT_NAMES).

    When several fired, the most specific wins: output, then memory/processes seen by the cgroup,
    then cpu_time/file_size (signals), memory/processes read from stderr, and wall_clock last.
    `exit_code` follows the shell: 128 + N when the command died of signal N.
    """

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    limit: str | None = None
    truncated: bool = False  # some stdout/stderr was dropped (over Limits.output_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


class Sandbox(ABC):
    """A fresh working directory with the task's files, and a way to run commands in it."""

    executor: str = ""
    workdir: Path

    @property
    @abstractmethod
    def isolation(self) -> str:
        """What separates commands from the host: "bwrap", "unshare", "docker" or "none"."""

    @property
    def isolation_summary(self) -> str:
        return self.isolation

    @property
    def visible_roots(self) -> list[str]:
        """What a command sees of the host filesystem, one entry per root (and how)."""
        return [f"{self.workdir} (the working copy)"]

    @abstractmethod
    def run(self, command: str, timeout_s: float, *, mounts: Iterable[Mount] | None = None) -> ExecResult:
        """Run `bash -c command` in the working directory; never raises for the command's faults.

        `mounts` are shown for this command only, on top of the sandbox's own (`open_sandbox(mounts=)`):
        e.g. a verifier's tests, invisible to the agent's earlier commands. Bad mounts: UsageError.
        """

    @abstractmethod
    def close(self) -> None:
        """Kill everything the sandbox started and delete its working directory. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110  interpreter shutdown: nothing left to report to
            pass


def copy_task_dir(task_dir: str | os.PathLike | None, base_dir: str | None = None) -> Path:
    """A fresh directory holding a copy of task_dir (empty when None)."""
    if task_dir is not None and not Path(task_dir).is_dir():
        raise UsageError(f"task directory {task_dir}: not a directory")
    workdir = Path(tempfile.mkdtemp(prefix="tsrl-sbx-", dir=base_dir))
    if task_dir is not None:
        try:
            shutil.copytree(task_dir, workdir, symlinks=True, dirs_exist_ok=True)
        except BaseException:
            remove_tree(workdir)
            raise
    return workdir


def chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def remove_tree(root: Path) -> None:
    """rmtree that also removes what a command made unwritable (chmod 000 directories)."""

    def onerror(func, path, _exc):
        try:
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
            func(path)
        except OSError:
            pass

    shutil.rmtree(root, onerror=onerror)
