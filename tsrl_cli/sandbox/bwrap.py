"""The `bwrap` isolation: Debian's bubblewrap builds the sandbox's root (layout.py) and runs the command in it.

New pid, network, IPC and UTS namespaces; a root of its own (a read-only tmpfs) holding only what
layout.py lists; fresh tmpfs over /tmp, /var/tmp and /dev/shm; no capabilities left. As a user, bwrap
runs unprivileged in a new user namespace (`--cap-drop ALL`). As root, bwrap sets the mounts up as
root (so `ro_binds` under /root can be shown), and the command then drops, through setpriv
(ownership.drop_to), to the sandbox uid: it is not root on the host.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence

from tsrl_cli.sandbox.base import Mount
from tsrl_cli.sandbox.layout import (
    HIDDEN_ETC,
    HIDDEN_FILES,
    PRIVATE_TMP,
    SYSTEM_ROOTS,
    late_dirs,
    made_dirs,
    mount_layout,
)
from tsrl_cli.sandbox.ownership import drop_to


@functools.cache
def bwrap_works() -> bool:
    """bwrap is installed and can create its namespaces here (it cannot in some containers)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    cmd = [exe, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "--die-with-parent", "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _entries(d: str) -> list[str]:
    """bwrap arguments that show host directory d's entries read-only in a tmpfs over d (symlinks as symlinks)."""
    out = []
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        out += ["--symlink", os.readlink(p), p] if os.path.islink(p) else ["--ro-bind", p, p]
    return out


def bwrap_argv(workdir: str, ro_binds: Sequence[str], mounts: Sequence[Mount], uid: int | None) -> list[str]:
    """The launcher argv: the command's argv follows it. uid None: a user's bwrap, in a user namespace."""
    wd = str(workdir)
    splices, dirs = mount_layout(mounts)
    cmd = ["bwrap"]  # bwrap's own root is an empty tmpfs: only what is added below is there
    for p in SYSTEM_ROOTS:
        if os.path.islink(p):
            cmd += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            cmd += ["--ro-bind", p, p]
    cmd += ["--dev", "/dev", "--perms", "01777", "--tmpfs", "/dev/shm", "--proc", "/proc"]
    for a in splices:  # before the hidden paths, which then cover what the splices show again
        cmd += ["--perms", "0755", "--tmpfs", a, *_entries(a)]
    for d in PRIVATE_TMP:
        cmd += ["--perms", "01777", "--tmpfs", d]
    for d in HIDDEN_ETC:
        if os.path.isdir(d):
            cmd += ["--perms", "0755", "--tmpfs", d]
    for f in HIDDEN_FILES:
        if os.path.exists(f):
            cmd += ["--ro-bind", "/dev/null", f]
    # after the private /tmp; 0755, so the sandbox uid can traverse them (bwrap's default is 0700)
    for d in made_dirs(ro_binds, wd, mounts, dirs):
        cmd += ["--perms", "0755", "--dir", d]
    for p in ro_binds:
        cmd += ["--ro-bind", p, p]
    cmd += ["--bind", wd, wd]
    for d in late_dirs(dirs):  # inside a fresh tmpfs or a splice
        cmd += ["--perms", "0755", "--dir", d]
    for m in mounts:
        cmd += ["--ro-bind" if m.read_only else "--bind", m.host, m.target]
    for a in splices:
        cmd += ["--remount-ro", a]
    cmd += ["--remount-ro", "/"]
    cmd += ["--chdir", wd, "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if uid is None:  # a user: unprivileged bwrap, in a user namespace, no capabilities
        return [*cmd, "--unshare-user", "--cap-drop", "ALL"]
    # root: bwrap sets up as root (so it can show ro_binds under /root), then the command drops
    # to the sandbox uid with no capabilities at all
    return [*cmd, *drop_to(uid)]
