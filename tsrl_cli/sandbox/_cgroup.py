"""Per-sandbox cgroups (pids and memory), where this machine lets us create them.

Best effort: root on cgroup v1 (this project's machines), or cgroup v2 when the current cgroup
already delegates the controller. Where none can be made, the rlimits are the only caps.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path


def _current_paths() -> dict[str, tuple[str, str]]:
    """controller -> (mount point, this process's cgroup path) for pids and memory."""
    mounts: dict[str, str] = {}
    v2_mount = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, opts = (right.split(" ") + ["", "", ""])[:3]
        mp = left.split(" ")[4]
        if fstype == "cgroup":
            for c in opts.split(","):
                if c in ("pids", "memory"):
                    mounts[c] = mp
        elif fstype == "cgroup2":
            v2_mount = mp
    out: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            if c in mounts:
                out[c] = (mounts[c], path)
        if ctrls == "" and v2_mount:
            delegated = Path(v2_mount, path.lstrip("/"), "cgroup.subtree_control")
            try:
                enabled = delegated.read_text().split()
            except OSError:
                enabled = []
            for c in ("pids", "memory"):
                if c in enabled and c not in out:
                    out[c] = (v2_mount, path)
    return out


class Cgroup:
    """One cgroup per controller for one sandbox; `dirs` is empty where none could be created."""

    def __init__(self, pids_max: int, memory_bytes: int):
        self.dirs: dict[str, Path] = {}
        name = f"tsrl-sbx-{uuid.uuid4().hex[:12]}"
        try:
            paths = _current_paths()
        except OSError:
            paths = {}
        for ctrl, (mount, path) in paths.items():
            d = Path(mount, path.lstrip("/"), name)
            try:
                d.mkdir()
            except OSError:
                continue
            try:
                v2 = (d / "memory.max").exists() or (d / "cgroup.type").exists()
                if ctrl == "pids":
                    (d / "pids.max").write_text(str(pids_max))
                elif v2:
                    (d / "memory.max").write_text(str(memory_bytes))
                    if (d / "memory.swap.max").exists():
                        (d / "memory.swap.max").write_text("0")
                else:
                    (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
                    if (d / "memory.memsw.limit_in_bytes").exists():  # no swapping past the cap
                        (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
            except OSError:
                _rmdir(d)
                continue
            # v1 and v2 on the same directory (both controllers in one v2 cgroup): join once
            self.dirs[ctrl] = d

    @property
    def procs_files(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def _read(self, ctrl: str, fname: str) -> str:
        try:
            return (self.dirs[ctrl] / fname).read_text()
        except (KeyError, OSError):
            return ""

    def counters(self) -> tuple[int, int]:
        """(pids.max refusals, OOM kills) so far; run() compares before and after each command."""
        return self.pids_max_hits(), self.oom_kills()

    def pids_max_hits(self) -> int:
        for line in self._read("pids", "pids.events").splitlines():
            if line.startswith("max "):
                return int(line.split()[1])
        return 0

    def oom_kills(self) -> int:
        text = self._read("memory", "memory.events") or self._read("memory", "memory.oom_control")
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def kill_all(self, timeout_s: float = 2.0, spare: int | None = None) -> None:
        """SIGKILL every process in the cgroups (but `spare`) until none is left; pids.max bounds a fork bomb."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = set()
            for f in self.procs_files:
                try:
                    pids.update(int(p) for p in Path(f).read_text().split())
                except OSError:
                    pass
            pids.discard(spare)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            _rmdir(d)
        self.dirs = {}


def _rmdir(d: Path) -> None:
    for _ in range(50):  # a cgroup is removable only once its last process has been reaped
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
