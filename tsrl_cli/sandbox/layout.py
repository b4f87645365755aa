"""The sandbox's root, as a list of paths: what the host shows, what is hidden, where mounts land.

Both isolating backends (bwrap.py, unshare.py) build the same root from these lists; only the
tool that makes it differs. Nothing here touches the host: it reads the host's tree to decide.

- SYSTEM_ROOTS are shown read-only; HIDDEN_FILES and HIDDEN_ETC are covered inside them; PRIVATE_TMP
  (and /dev/shm) are fresh tmpfs. Every other top-level entry of the host is absent.
- `ro_binds` (default_ro_binds: this interpreter's installation, its base and its virtual
  environment, where they lie outside the system directories, as pyenv under /root and a venv in the
  checkout do here) are shown read-only at their own paths, so the agent's `python` and a verifier's
  `sys.executable` run; of a venv in the checkout only the venv itself is shown.
- `mounts` (Mount(host, target, read_only=True)) show host paths at chosen targets. The host is never
  changed to make a mount point: a target outside the system directories gets its mount point in the
  sandbox's own root (or /tmp); a target missing inside one (/etc/x) gets one in a tmpfs that replaces
  its deepest existing ancestor (a "splice"), holding read-only binds of that ancestor's entries.
  Those tmpfs are then read-only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox.base import Mount

# The host directories a sandbox shows (read-only): what an agent's shell tools need to run. Any
# other top-level entry of the host is absent from the sandbox's root.
SYSTEM_ROOTS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc")
# Hidden inside the system directories even though the command does not run as root (defence in depth).
HIDDEN_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers")
HIDDEN_ETC = ("/etc/ssh", "/etc/sudoers.d")
# fresh, private, writable tmpfs in every sandbox (world-writable and sticky, like the real ones)
PRIVATE_TMP = ("/tmp", "/var/tmp")
HIDDEN_DIRS = (*PRIVATE_TMP, *HIDDEN_ETC)  # each a fresh tmpfs in the sandbox


def under(path: str, roots: Iterable[str]) -> bool:
    """path is one of roots, or lies below one."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def default_ro_binds() -> list[str]:
    """This interpreter's installation (its base and its venv) where it lies outside SYSTEM_ROOTS.

    Shown read-only so that `python` on the sandbox's PATH and a verifier's `sys.executable` run
    (a venv's python links to its base). Nested paths are kept once, outermost first.
    """
    paths = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)
                    if os.path.isdir(p)})
    out: list[str] = []
    for p in paths:
        if not under(p, SYSTEM_ROOTS) and not under(p, out):
            out.append(p)
    return out


def visible_parents(path: str) -> list[str]:
    """Ancestors of `path` (outermost first) the sandbox must make as directories: those outside SYSTEM_ROOTS,
    except "/" and the private /tmp and /var/tmp themselves (a path under /tmp needs its parents made in
    that fresh tmpfs, as a checkout's venv there does)."""
    out = []
    for a in reversed(Path(path).parents):
        a = str(a)
        if a != "/" and a not in PRIVATE_TMP and not under(a, SYSTEM_ROOTS):
            out.append(a)
    return out


def hidden_parent(path: str) -> str | None:
    """The private tmpfs (/tmp, /var/tmp, /etc/ssh ...) that path is or lies under, if any."""
    return next((d for d in HIDDEN_DIRS if path == d or path.startswith(d + "/")), None)


def mount_layout(mounts: Sequence[Mount]) -> tuple[list[str], list[str]]:
    """Where each mount's target gets its mount point: (splices, dirs).

    A target outside SYSTEM_ROOTS gets its mount point in the sandbox's own root (or in the private
    /tmp): every missing component is a directory to make (`dirs`). A target inside a system
    directory that the host lacks (/etc/x) needs a writable layer there: its deepest existing
    ancestor A is "spliced", rebuilt as a tmpfs holding read-only binds of A's entries. The host
    itself is never changed. UsageError where a target inside a system directory goes through a
    symlink, or its kind (file/directory) does not match.
    """
    splices: set[str] = set()
    dirs: list[str] = []
    for m in mounts:
        t, host_is_dir = m.target, os.path.isdir(m.host)
        hidden = hidden_parent(t)
        chain = []
        if hidden is not None or not under(t, SYSTEM_ROOTS):  # a fresh tmpfs, or the sandbox's own root
            stop = hidden or "/"
            a = t
            while a != stop:
                chain.append(a)
                a = os.path.dirname(a)
        else:
            a = t
            while not os.path.lexists(a):
                chain.append(a)
                a = os.path.dirname(a)
            if os.path.islink(a) or os.path.realpath(a) != a:
                raise UsageError(f"mount {m.host} -> {t}: the target must not go through a symlink ({a})")
            if a == t:
                if os.path.isdir(t) != host_is_dir:
                    raise UsageError(f"mount {m.host} -> {t}: the target exists and is not a "
                                     f"{'directory' if host_is_dir else 'file'} like the host path")
                continue
            if not os.path.isdir(a):
                raise UsageError(f"mount {m.host} -> {t}: {a} is not a directory")
            splices.add(a)
        chain.reverse()
        dirs += [d for d in (chain if host_is_dir else chain[:-1]) if d not in dirs]
    return sorted(splices, key=lambda p: (p.count("/"), p)), dirs


def made_dirs(ro_binds: Sequence[str], workdir: str, mounts: Sequence[Mount], dirs: Sequence[str]) -> list[str]:
    """Directories the sandbox's own root must hold (0755), outermost first: the parents of ro_binds,
    of the working directory and of the mount targets, and mount_layout's `dirs` there. Never one
    inside a system directory (those are host binds: making one there would change the host)."""
    out: list[str] = []
    for path in (*ro_binds, workdir, *(m.target for m in mounts)):
        out += [a for a in visible_parents(path) if a not in out]
    own = [d for d in dirs if hidden_parent(d) is None and not under(d, SYSTEM_ROOTS)]
    return out + [d for d in own if d not in out]


def late_dirs(dirs: Sequence[str]) -> list[str]:
    """mount_layout's `dirs` that lie in a fresh tmpfs or a splice: made once those are mounted, not in
    the sandbox's own root (made_dirs has the rest)."""
    return [d for d in dirs if hidden_parent(d) is not None or under(d, SYSTEM_ROOTS)]
