"""The `unshare` isolation (root only, when bwrap is missing): util-linux unshare runs unshare.sh.

Same namespaces as bwrap (mount, pid, net, IPC, UTS) and the same root (layout.py): the script builds
it on a tmpfs, enters it with chroot and runs the command after the setpriv drop to the sandbox uid
(ownership.drop_to). The script is a static file of this package; its inputs are its options, which
this module computes from the layout, so no path is ever spliced into shell text.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from importlib import resources

from tsrl_cli.sandbox.base import Mount
from tsrl_cli.sandbox.layout import (
    HIDDEN_ETC,
    HIDDEN_FILES,
    PRIVATE_TMP,
    SYSTEM_ROOTS,
    hidden_parent,
    late_dirs,
    made_dirs,
    mount_layout,
    under,
)
from tsrl_cli.sandbox.ownership import drop_to

UNSHARE = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]


@functools.cache
def script() -> str:
    """unshare.sh's text: run with `bash -c`, so that a run never reads a file that may change under it."""
    return resources.files(__package__).joinpath("unshare.sh").read_text()


def unshare_options(workdir: str, ro_binds: Sequence[str], mounts: Sequence[Mount]) -> list[str]:
    """unshare.sh's options (before its `--`) for this working directory, ro_binds and mounts."""
    splices, dirs = mount_layout(mounts)
    # in the new root, made before the read-only pass: the sandbox's own directories, the private
    # /tmp and /var/tmp (tmpfs are mounted on them later), and the mount points of ro_binds and of
    # file mounts that no fresh tmpfs or splice will hold
    stage_dirs = [*made_dirs(ro_binds, workdir, mounts, dirs), *PRIVATE_TMP,
                  *(p for p in ro_binds if hidden_parent(p) is None)]
    stage_files = [m.target for m in mounts if not os.path.isdir(m.host) and hidden_parent(m.target) is None
                   and not under(m.target, SYSTEM_ROOTS)]
    # the rest of the file mounts' mount points, made once their tmpfs or splice is there (unless they exist)
    files = [m.target for m in mounts if not os.path.isdir(m.host) and m.target not in stage_files]
    hide_dirs = [*PRIVATE_TMP, *(d for d in HIDDEN_ETC if os.path.isdir(d)), "/dev/shm"]
    hide_files = [f for f in HIDDEN_FILES if os.path.exists(f)]

    out = ["--workdir", workdir]
    for p in (*SYSTEM_ROOTS, "/dev", "/proc"):
        if os.path.islink(p):
            out += ["--link", p, os.readlink(p)]
        elif os.path.isdir(p):
            out += ["--root", p]
    out += [a for p in ro_binds for a in ("--ro-bind", p)]
    out += [a for m in mounts for a in ("--mount", m.host, m.target, "ro" if m.read_only else "rw")]
    out += [a for p in splices for a in ("--splice", p)]
    out += [a for p in stage_dirs for a in ("--stage-dir", p)]
    out += [a for p in stage_files for a in ("--stage-file", p)]
    out += [a for p in late_dirs(dirs) for a in ("--dir", p)]
    out += [a for p in files for a in ("--file", p)]
    out += [a for p in hide_dirs for a in ("--hide-dir", p)]
    out += [a for p in hide_files for a in ("--hide-file", p)]
    return out


def unshare_argv(workdir: str, ro_binds: Sequence[str], mounts: Sequence[Mount], uid: int) -> list[str]:
    """The launcher argv: the command's argv follows it, run in the new root as uid."""
    return [*UNSHARE, "bash", "--noprofile", "--norc", "-c", script(), "tsrl-unshare",
            *unshare_options(str(workdir), ro_binds, mounts), "--", *drop_to(uid)]
