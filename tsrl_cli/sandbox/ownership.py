"""The sandbox uid: as root, each sandbox's commands run as a fresh uid of their own, not root.

fresh_uid() picks it, drop_to(uid) is the setpriv prefix that switches to it with no capabilities,
and OwnedMounts lends the read-write mounts' host paths to it for their lifetime, then gives them
back. RLIMIT_NPROC counts per uid, so with a uid per sandbox it counts that sandbox's processes only.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Sequence
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox.base import Mount, chown_tree


def fresh_uid() -> int:
    """A uid in [200000, 1200000) that no running process uses (no passwd entry needed)."""
    used = set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                used.add(os.stat(f"/proc/{p}").st_uid)
            except OSError:
                pass
    while (uid := random.randrange(200_000, 1_200_000)) in used:
        pass
    return uid


def drop_to(uid: int) -> list[str]:
    """The argv prefix that runs the rest as uid (gid the same), no groups, no capabilities, no_new_privs."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs"]


class OwnedMounts:
    """Read-write mounts made writable by the sandbox's uid for their lifetime, then given back.

    The host path itself is chowned to the uid (not its contents: existing files keep their
    owner and mode), or, for an own_tree mount, everything below it. On release its owner comes
    back, and whatever the uid owns inside (found without following symlinks) is chowned to that
    owner too, set-id bits dropped. uid None (not root): nothing to lend.
    """

    def __init__(self, mounts: Sequence[Mount], uid: int | None):
        self.uid, self.saved = uid, []
        if uid is None:
            return
        try:
            for m in mounts:
                if not m.read_only:
                    st = os.stat(m.host)
                    try:
                        if m.own_tree and os.path.isdir(m.host):
                            chown_tree(Path(m.host), uid, uid)  # given back by release(): all uid-owned
                        else:
                            os.chown(m.host, uid, uid)
                    except OSError as e:
                        raise UsageError(f"mount {m.host} -> {m.target}: cannot hand it to the sandbox uid: {e}") from e
                    self.saved.append((m.host, st.st_uid, st.st_gid))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        saved, self.saved = self.saved, []
        for host, uid, gid in saved:
            try:
                os.chown(host, uid, gid)
                for dirpath, dirnames, filenames in os.walk(host) if os.path.isdir(host) else ():
                    for name in dirnames + filenames:
                        p = os.path.join(dirpath, name)
                        st = os.lstat(p)
                        if st.st_uid == self.uid:
                            os.lchown(p, uid, gid)
                            if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                                os.chmod(p, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
            except OSError:
                pass
