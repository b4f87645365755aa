"""The `local` executor: each command in its own process group, namespaces and rlimits.

Isolation, best first (`isolation="auto"`):

- `bwrap` (Debian's bubblewrap): new pid, network, IPC and UTS namespaces; a root of its own (a
  read-only tmpfs) showing only the system directories an agent's tools need (SYSTEM_ROOTS:
  /usr, /etc, /bin, /lib, ... read-only, /etc/shadow and friends hidden), this interpreter's
  installation (ro_binds), the working directory (read-write) and the mounts; fresh tmpfs over
  /tmp, /var/tmp and /dev/shm; no capabilities left. Everything else of the host (the project
  checkout, data/, home directories, other sandboxes' working copies, /opt, /srv, /mnt ...) is
  absent: not hidden behind a tmpfs, not there at all (`visible_roots` lists what is).
  As a user, bwrap runs unprivileged in a new user namespace (`--cap-drop ALL`).
  As root, bwrap sets the mounts up as root (so `ro_binds` under /root can be shown), and the
  command then drops, through setpriv, to a uid of its own (a random unused uid >= 200000,
  or `sandbox_uid`) with no capabilities and no_new_privs: it is not root on the host.
- `unshare` (root only, when bwrap is missing): util-linux unshare with the same namespaces and
  the same root, built by a shell script on a tmpfs and entered with chroot, then the same
  setpriv drop.
- `none`: only the rlimits, the process group and the scrubbed environment. Refused unless the
  caller passes allow_unisolated=True (the CLI's --allow-unisolated).

`ro_binds` (default: this interpreter's installation, its base and its virtual environment, where
they lie outside the system directories, as pyenv under /root and a venv in the checkout do here)
are shown read-only at their own paths, so the agent's `python` and a verifier's `sys.executable`
run; of a venv in the checkout only the venv itself is shown.

`mounts` (Mount(host, target, read_only=True); per sandbox, and per command with
`run(..., mounts=)`) show host paths at chosen targets, e.g. a Harbor verifier's /tests
(read-only) and /logs/verifier (read-write). The host is never changed to make a mount point: a
target outside the system directories gets its mount point in the sandbox's own root (or /tmp);
a target missing inside one (/etc/x) gets one in a tmpfs that replaces its deepest existing
ancestor, holding read-only binds of that ancestor's entries. Those tmpfs are then read-only. A read-write mount must be
writable by the command's uid: as root, its host path (not its contents) is chowned to the
sandbox uid for the mount's lifetime, then given back, with what the command created inside
chowned to the path's owner (set-id bits dropped). A host directory must not be mounted
read-write by two sandboxes at once. `none` isolation refuses mounts.

What is enforced, measured on this project's machine (root, kernel 6.18, cgroup v1, bwrap 0.8):

- wall clock: enforced everywhere. At the timeout the whole tree dies: the process group,
  the pid namespace (its init is killed) and the cgroup.
- CPU time (RLIMIT_CPU): per process, not per tree: a command that forks can use
  processes x cpu_time_s in total; the wall clock bounds the rest.
- memory: RLIMIT_AS per process (virtual memory, so runtimes that reserve big address ranges,
  such as the JVM or Go, need a larger cap), plus a memory cgroup over the whole tree where one
  can be created (root on cgroup v1 here: four 400 MB processes under a 512 MiB cap are
  OOM-killed, and the result says "memory").
- processes: RLIMIT_NPROC counts per user and is never enforced for root. As root the command
  runs as its own fresh uid, so the count is this sandbox's processes. As a user under bwrap it
  runs in its own user namespace, where the kernel (>= 5.14, ucounts) also counts only this
  sandbox: measured, 30 host processes of the same uid did not use up a cap of 20 inside.
  A pids cgroup (pids.max = processes + 8, the launcher's own processes included) is added
  where one can be created. With `none` as root only that cgroup caps processes, and the
  command, being root, could raise its own rlimits again.
- file size (RLIMIT_FSIZE): per file written.
- output: at most output_bytes kept per stream, read while the command runs; after
  output_kill_bytes in total the command is killed.
- background processes die with their command: the pid namespace ends when the command does,
  and otherwise the process group (and the cgroup) is killed. Nothing survives between runs.

Run: `tsrl env exec --workdir DIR -- 'echo hi'`.
"""

from __future__ import annotations

import functools
import os
import random
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox._cgroup import Cgroup
from tsrl_cli.sandbox.base import (
    ExecResult,
    IsolationError,
    Limits,
    Mount,
    Sandbox,
    check_mounts,
    chown_tree,
    copy_task_dir,
    remove_tree,
)

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The host directories a sandbox shows (read-only): what an agent's shell tools need to run. Any
# other top-level entry of the host is absent from the sandbox's root.
SYSTEM_ROOTS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc")
# `python` (and pytest) inside the sandbox is this interpreter's environment, shown read-only:
# embedded repair tasks are pure Python verified with pytest, and the agent runs them the same way.
TOOL_PATH = f"{os.path.dirname(sys.executable)}:{SAFE_PATH}"
# Hidden inside the system directories even though the command does not run as root (defence in depth).
HIDDEN_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers")
HIDDEN_ETC = ("/etc/ssh", "/etc/sudoers.d")
# fresh, private, writable tmpfs in every sandbox (world-writable and sticky, like the real ones)
PRIVATE_TMP = ("/tmp", "/var/tmp")
HIDDEN_DIRS = (*PRIVATE_TMP, *HIDDEN_ETC)  # each a fresh tmpfs in the sandbox
ISOLATIONS = ("auto", "bwrap", "unshare", "none")

_MEMORY_ERRORS = ("MemoryError", "Cannot allocate memory", "cannot allocate memory", "Out of memory",
                  "out of memory", "std::bad_alloc", "xmalloc: cannot allocate", "xrealloc: cannot allocate")
_FORK_ERRORS = ("fork: retry: Resource temporarily unavailable", "fork: Resource temporarily unavailable",
                "Resource temporarily unavailable", "BlockingIOError")


def limit_from_exit(rc: int, stderr: str) -> str | None:
    """The limit a command's exit status and stderr name, where no cgroup counter did: "cpu_time",
    "file_size", "processes", "memory", or None."""
    if rc == 128 + signal.SIGXCPU or "CPU time limit exceeded" in stderr:
        return "cpu_time"
    if rc == 128 + signal.SIGXFSZ or "File size limit exceeded" in stderr or "File too large" in stderr:
        return "file_size"
    # A fork bomb's shell reports EAGAIN ("fork: retry: ...") at the process cap, then ENOMEM
    # ("fork: Cannot allocate memory") once the pid namespace's init has exited (the kernel's
    # alloc_pid answers ENOMEM there): with any EAGAIN present, the cap hit was on processes.
    if any(s in stderr for s in _FORK_ERRORS):
        return "processes"
    if any(s in stderr for s in _MEMORY_ERRORS):
        return "memory"
    return None


def _under(path: str, roots: Iterable[str]) -> bool:
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
        if not _under(p, SYSTEM_ROOTS) and not _under(p, out):
            out.append(p)
    return out


def visible_parents(path: str) -> list[str]:
    """Ancestors of `path` (outermost first) the sandbox must make as directories: those outside SYSTEM_ROOTS,
    except "/" and the private /tmp and /var/tmp themselves (a path under /tmp needs its parents made in
    that fresh tmpfs, as a checkout's venv there does)."""
    out = []
    for a in reversed(Path(path).parents):
        a = str(a)
        if a != "/" and a not in PRIVATE_TMP and not _under(a, SYSTEM_ROOTS):
            out.append(a)
    return out


def _fresh_uid() -> int:
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


def _hidden_parent(path: str) -> str | None:
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
        hidden = _hidden_parent(t)
        chain = []
        if hidden is not None or not _under(t, SYSTEM_ROOTS):  # a fresh tmpfs, or the sandbox's own root
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


def _entries(d: str) -> list[tuple[str, str | None]]:
    """(path, symlink target or None) for each entry of host directory d."""
    out = []
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        out.append((p, os.readlink(p) if os.path.islink(p) else None))
    return out


class _Owned:
    """Read-write mounts made writable by the sandbox's uid for their lifetime, then given back.

    The host path itself is chowned to the uid (not its contents: existing files keep their
    owner and mode). On release its owner comes back, and whatever the uid created inside
    (found without following symlinks) is chowned to that owner too, set-id bits dropped.
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


def _is_root() -> bool:
    return os.geteuid() == 0


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


def choose_isolation(isolation: str = "auto", allow_unisolated: bool = False) -> str:
    """The isolation to use, or IsolationError with a one-line reason and the fix."""
    if isolation not in ISOLATIONS:
        raise IsolationError(f"isolation {isolation!r}: expected one of {', '.join(ISOLATIONS)}")
    can_unshare = _is_root() and shutil.which("unshare") is not None and shutil.which("setpriv") is not None
    if isolation == "bwrap" and not bwrap_works():
        raise IsolationError("bwrap is missing or cannot create namespaces here (apt-get install bubblewrap)")
    if isolation == "unshare" and not can_unshare:
        raise IsolationError("unshare isolation needs root and util-linux's unshare and setpriv")
    if isolation == "auto":
        isolation = "bwrap" if bwrap_works() else "unshare" if can_unshare else "none"
    if isolation == "none" and not allow_unisolated:
        raise IsolationError(
            "no sandbox isolation available (install bubblewrap, or run as root for unshare); "
            "pass --allow-unisolated (allow_unisolated=True) to run untrusted commands without it"
        )
    return isolation


class LocalSandbox(Sandbox):
    """Commands run on this machine, isolated by bwrap or unshare (see the module docstring)."""

    executor = "local"

    def __init__(
        self,
        task_dir: str | os.PathLike | None = None,
        *,
        limits: Limits | None = None,
        isolation: str = "auto",
        allow_unisolated: bool = False,
        env: dict[str, str] | None = None,
        base_dir: str | None = None,
        sandbox_uid: int | None = None,
        ro_binds: Sequence[str] | None = None,
        mounts: Iterable[Mount] | None = None,
    ):
        self._closed = True
        self._owned = None
        self._isolation = choose_isolation(isolation, allow_unisolated)
        self.limits = limits or Limits()
        # host directories shown read-only even under a hidden path (at most 7: the unshare script's fds 3-9)
        self.ro_binds = [os.path.realpath(p) for p in (default_ro_binds() if ro_binds is None else ro_binds)][:7]
        self.workdir = copy_task_dir(task_dir, base_dir)
        self._closed = False
        # As root, commands run as a uid of their own (sandbox_uid, default a random unused one):
        # not root on the host, and RLIMIT_NPROC, which counts per uid, counts this sandbox only.
        self._uid = None
        if _is_root() and self._isolation != "none":
            self._uid = sandbox_uid if sandbox_uid is not None else _fresh_uid()
        if self._uid is not None:
            chown_tree(self.workdir, self._uid, self._uid)
            os.chmod(self.workdir, 0o700)
        self._cgroup = Cgroup(pids_max=self.limits.processes + 8, memory_bytes=self.limits.memory_bytes)
        self.env = {"PATH": TOOL_PATH, "HOME": str(self.workdir), "LANG": "C.UTF-8", "TERM": "dumb",
                    "USER": "sandbox", **(env or {})}
        if self._isolation != "none":
            self.env["TMPDIR"] = "/tmp"  # a private tmpfs
        self.mounts: tuple[Mount, ...] = ()
        try:  # the sandbox's own mounts, shown to every command (run(mounts=) adds more per command)
            self.mounts = self._check_mounts(mounts)
            self._owned = _Owned(self.mounts, self._uid)
        except BaseException:
            self.close()
            raise

    @property
    def isolation(self) -> str:
        return self._isolation

    @property
    def cgroups(self) -> list[str]:
        """The cgroup controllers capping this sandbox's whole tree ("memory", "pids"), maybe none."""
        return sorted(self._cgroup.dirs)

    @property
    def visible_roots(self) -> list[str]:
        """What a command sees of the host, one entry each: path (and how); nothing else of the host is there."""
        if self._isolation == "none":
            return ["/ (the whole host, read-write where permissions allow)"]
        out = [f"{p} (read-only{', secrets hidden' if p == '/etc' else ''})" for p in SYSTEM_ROOTS
               if os.path.isdir(p) and not os.path.islink(p)]
        out += [f"{p} (read-only: this interpreter)" for p in self.ro_binds]
        out += [f"{self.workdir} (read-write: the working copy)"]
        out += [f"{m.target} (read-{'only' if m.read_only else 'write'}: {m.host})" for m in self.mounts]
        out += ["/tmp, /var/tmp, /dev/shm (private, empty)", "/dev, /proc (the sandbox's own)"]
        return out

    @property
    def isolation_summary(self) -> str:
        lim = self.limits
        caps = [f"cpu {lim.cpu_time_s}s/process", f"memory {lim.memory_bytes >> 20} MiB",
                f"processes {lim.processes}", f"file size {lim.file_size_bytes >> 20} MiB",
                f"output {lim.output_bytes >> 10} KiB/stream"]
        cg = ",".join(self.cgroups) or "none"
        how = {
            "bwrap": "bwrap: no network, a root of its own (system directories read-only), private /tmp, pid namespace",
            "unshare": "unshare: no network, a root of its own (system directories read-only), private /tmp, pid namespace",
            "none": "NONE: commands can read and write the host and use the network",
        }[self._isolation]
        if self._isolation == "bwrap" and self._uid is None:
            how += ", user namespace"
        uid = f", uid {self._uid}, no capabilities" if self._uid is not None else ""
        return f"{how}{uid}; cgroups: {cg}; limits: {', '.join(caps)}"

    # -- command line -----------------------------------------------------------------------------

    def _limited_bash(self, command: str) -> list[str]:
        """bash that sets the rlimits (hard and soft) and then runs the command; it cannot raise them."""
        lim = self.limits
        def kib(nbytes: int) -> int:  # ulimit's unit for -v and -f
            return max(1, nbytes >> 10)

        setup = (
            f"ulimit -t {lim.cpu_time_s + 1} -v {kib(lim.memory_bytes)} -f {kib(lim.file_size_bytes)}"
            f" -u {lim.processes} -c 0 && ulimit -S -t {lim.cpu_time_s} || exit 125; "
            'exec bash -c "$1"'
        )
        return ["bash", "--noprofile", "--norc", "-c", setup, "tsrl-sandbox", command]

    def _check_mounts(self, mounts: Iterable[Mount] | None, base: Sequence[Mount] = ()) -> tuple[Mount, ...]:
        """base + mounts, validated (UsageError); `none` isolation refuses any."""
        mounts = list(mounts or ())
        if mounts and self._isolation == "none":
            raise UsageError("mounts need sandbox isolation (bwrap or unshare): with isolation 'none' "
                             "commands see the host's own filesystem")
        checked = check_mounts([*base, *mounts], self.workdir)
        for m in checked:
            for p in self.ro_binds:
                if m.target == p or m.target.startswith(p + "/") or p.startswith(m.target + "/"):
                    raise UsageError(f"mount {m.host} -> {m.target}: the target overlaps ro_binds {p}")
        mount_layout(checked)  # refuses symlinked targets and kind mismatches now, not at run time
        return checked

    @staticmethod
    def _bwrap_entries(d: str, skip: tuple[str, ...] = ()) -> list[str]:
        out = []
        for p, link in _entries(d):
            if p not in skip:
                out += ["--symlink", link, p] if link is not None else ["--ro-bind", p, p]
        return out

    def _made_dirs(self, mounts: Sequence[Mount], dirs: Sequence[str]) -> list[str]:
        """Directories the sandbox's own root must hold (0755), outermost first: the parents of ro_binds,
        of the working directory and of the mount targets, and mount_layout's `dirs` there. Never one
        inside a system directory (those are host binds: making one there would change the host)."""
        out: list[str] = []
        for path in (*self.ro_binds, str(self.workdir), *(m.target for m in mounts)):
            out += [a for a in visible_parents(path) if a not in out]
        own = [d for d in dirs if _hidden_parent(d) is None and not _under(d, SYSTEM_ROOTS)]
        return out + [d for d in own if d not in out]

    def _bwrap(self, mounts: Sequence[Mount] = ()) -> list[str]:
        wd = str(self.workdir)
        splices, dirs = mount_layout(mounts)
        cmd = ["bwrap"]  # bwrap's own root is an empty tmpfs: only what is added below is there
        for p in SYSTEM_ROOTS:
            if os.path.islink(p):
                cmd += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                cmd += ["--ro-bind", p, p]
        cmd += ["--dev", "/dev", "--perms", "01777", "--tmpfs", "/dev/shm", "--proc", "/proc"]
        for a in splices:  # before the hidden paths, which then cover what the splices show again
            cmd += ["--perms", "0755", "--tmpfs", a, *self._bwrap_entries(a)]
        for d in PRIVATE_TMP:
            cmd += ["--perms", "01777", "--tmpfs", d]
        for d in HIDDEN_ETC:
            if os.path.isdir(d):
                cmd += ["--perms", "0755", "--tmpfs", d]
        for f in HIDDEN_FILES:
            if os.path.exists(f):
                cmd += ["--ro-bind", "/dev/null", f]
        for d in self._made_dirs(mounts, dirs):  # after the private /tmp; traversable by the sandbox uid (bwrap: 0700)
            cmd += ["--perms", "0755", "--dir", d]
        for p in self.ro_binds:
            cmd += ["--ro-bind", p, p]
        cmd += ["--bind", wd, wd]
        for d in dirs:
            if _hidden_parent(d) is not None or _under(d, SYSTEM_ROOTS):  # inside a fresh tmpfs or a splice
                cmd += ["--perms", "0755", "--dir", d]
        for m in mounts:
            cmd += ["--ro-bind" if m.read_only else "--bind", m.host, m.target]
        for a in splices:
            cmd += ["--remount-ro", a]
        cmd += ["--remount-ro", "/"]
        cmd += ["--chdir", wd, "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
        if self._uid is None:  # a user: unprivileged bwrap, in a user namespace, no capabilities
            return [*cmd, "--unshare-user", "--cap-drop", "ALL"]
        # root: bwrap sets up as root (so it can show ro_binds under /root), then the command drops
        # to the sandbox uid with no capabilities at all
        return [*cmd, *self._drop_root()]

    def _drop_root(self) -> list[str]:
        return ["setpriv", f"--reuid={self._uid}", f"--regid={self._uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs"]

    def _unshare_script(self, mounts: Sequence[Mount] = ()) -> str:
        """Runs as root (bash) in fresh mount/pid/net namespaces: build the sandbox's root, enter it, drop.

        The root is a tmpfs (mounted over /tmp of this private mount namespace) holding binds of
        SYSTEM_ROOTS, /dev and /proc, and the directories ro_binds, the working directory and mount
        targets need; it is entered with chroot. Host paths needed inside (ro_binds, mount sources,
        the working directory) are opened first, as fds, so they stay reachable after the chroot.
        Inside: every mount read-only, the private tmpfs and hidden files, then the read-write
        working directory and the mounts; then the drop to the sandbox uid.
        """
        q = shlex.quote
        wd = q(str(self.workdir))
        splices, dirs = mount_layout(mounts)
        hide_dirs = " ".join(q(d) for d in (*PRIVATE_TMP, *(d for d in HIDDEN_ETC if os.path.isdir(d)), "/dev/shm"))
        hide_files = " ".join(q(f) for f in HIDDEN_FILES if os.path.exists(f))
        keep = "".join(f"exec {3 + i}<{q(p)}; " for i, p in enumerate(self.ro_binds))  # handles, like the cwd
        show = "".join(f"mkdir -p {q(p)}; mount -c --bind /proc/self/fd/{3 + i} {q(p)}; "
                       f"mount -o remount,bind,ro {q(p)}; " for i, p in enumerate(self.ro_binds))
        sources = "".join(f"exec {10 + i}<{q(m.host)}; " for i, m in enumerate(mounts))

        def rebind(src_dir: str, entries_of: str, dest: str) -> str:
            """Binds (symlinks) of host directory entries_of's entries, read under src_dir (shell text), made under dest."""
            out = ""
            for p, link in _entries(entries_of):
                name = os.path.basename(p)
                s_, d_ = f"{src_dir}/{q(name)}", q(f"{dest.rstrip('/')}/{name}")
                if link is not None:
                    out += f"ln -s {q(link)} {d_}; "
                elif os.path.isdir(p):
                    out += f"mkdir {d_}; mount -c --rbind {s_} {d_}; "
                else:
                    out += f"touch {d_}; mount -c --bind {s_} {d_}; "
            return out

        fd0 = 10 + len(mounts)
        splice = "".join(
            f"exec {fd0 + j}<{q(a)}; mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs {q(a)}; "
            + rebind(f"/proc/$$/fd/{fd0 + j}", a, a) for j, a in enumerate(splices))
        # inside a private tmpfs or a splice: made after the read-only pass; the rest before it, on the new root
        late_dirs = [d for d in dirs if _hidden_parent(d) or _under(d, SYSTEM_ROOTS)]
        stage = "/tmp"  # covered by the tmpfs that becomes the root
        roots = ""
        for p in (*SYSTEM_ROOTS, "/dev", "/proc"):
            if os.path.islink(p):
                roots += f"ln -s {q(os.readlink(p))} {q(stage + p)}; "
            elif os.path.isdir(p):
                roots += f"mkdir {q(stage + p)}; mount -c --rbind {q(p)} {q(stage + p)}; "
        early = [*self._made_dirs(mounts, dirs), *PRIVATE_TMP,
                 *(p for p in self.ro_binds if _hidden_parent(p) is None)]
        early_files = [m.target for m in mounts if not os.path.isdir(m.host) and _hidden_parent(m.target) is None
                       and not _under(m.target, SYSTEM_ROOTS)]
        build = (f"mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs {stage}; " + roots
                 + "".join(f"mkdir -p {q(stage + d)}; " for d in early)
                 + "".join(f"touch {q(stage + t)}; " for t in early_files))
        make = "".join(f"mkdir -p {q(d)}; " for d in late_dirs)
        make += "".join(f"[ -e {q(m.target)} ] || touch {q(m.target)}; " for m in mounts
                        if not os.path.isdir(m.host) and m.target not in early_files)
        cwd_fd = fd0 + len(splices)  # a handle on the workdir across `cd /` and chroot
        closing = "".join(f"exec {fd}<&-; " for fd in (*range(3, 3 + len(self.ro_binds)), *range(10, cwd_fd + 1)))
        binds = "".join(f"mount -c --bind /proc/$P/fd/{10 + i} {q(m.target)}; "
                        f"mount -o remount,bind,{'ro' if m.read_only else 'rw'} {q(m.target)}; "
                        for i, m in enumerate(mounts))
        body = (
            # every mount read-only, the new root included (the cwd keeps a handle on the workdir)
            "for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do "
            'case "$m" in /proc|/proc/*) continue;; esac; mount -o remount,bind,ro "$m" 2>/dev/null || true; done; '
            + splice +
            f"for d in {hide_dirs}; do mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs \"$d\"; done; "
            f"for f in {hide_files}; do mount --bind /dev/null \"$f\"; done; " + show +
            # -c: mount must not canonicalize ".", which now names the new empty directory
            f"mkdir -p {wd}; mount -c --bind . {wd}; mount -o remount,bind,rw {wd}; " + make + binds
            + "".join(f"mount -o remount,ro {q(a)}; " for a in splices) +
            f"cd {wd}; ip link set lo up 2>/dev/null || true; {closing}set +e; "
            # not exec: pid 1 of a namespace ignores SIGXCPU, so the command must not be pid 1
            f'{shlex.join(self._drop_root())} "$@"; exit $?'
        )
        head = "set -e; mount --make-rprivate /; cd " + wd + "; P=$$; " + keep + sources
        # The outer shell is in / by the chroot, so /proc/$P/cwd does not name the workdir (without this,
        # commands would run in the host's /). The chrooted shell gets back to the workdir
        # through a handle the outer shell opened while still in it. cd's getcwd warning there is
        # expected and dropped: the path has no parents in the new root until the workdir is bound
        # at its own path below.
        body2 = f'set -e; P=$1; shift; cd -P "/proc/$P/fd/{cwd_fd}" 2>/dev/null; ' + body
        return head + f"exec {cwd_fd}<.; " + build + f"cd /; set +e; chroot {stage} /bin/bash -c {q(body2)} tsrl-unshare \"$P\" \"$@\"; exit $?"

    def _argv(self, command: str, mounts: Sequence[Mount] = ()) -> list[str]:
        inner = self._limited_bash(command)
        if self._isolation == "bwrap":
            argv = [*self._bwrap(mounts), *inner]
        elif self._isolation == "unshare":
            argv = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                    "--mount-proc", "bash", "--noprofile", "--norc", "-c", self._unshare_script(mounts),
                    "tsrl-unshare", *inner]
        else:
            argv = inner
        procs = self._cgroup.procs_files
        if procs:  # join the cgroups before anything else runs, so no child escapes them
            joins = "; ".join(f"echo $$ > {shlex.quote(p)}" for p in procs)
            argv = ["sh", "-c", f'{joins}; exec "$@"', "tsrl-cgroup", *argv]
        return argv

    # -- running ----------------------------------------------------------------------------------

    def run(self, command: str, timeout_s: float, *, mounts: Iterable[Mount] | None = None) -> ExecResult:
        if self._closed:
            return ExecResult("", "sandbox is closed", 126, 0.0)
        if "\x00" in command:  # no argv can carry it (a model can emit one): a tool error, not a crash
            return ExecResult("", "sandbox: the command contains a NUL byte, which a shell cannot receive", 126, 0.0)
        extra = list(mounts or ())
        all_mounts = self._check_mounts(extra, self.mounts) if extra else self.mounts
        owned = _Owned(all_mounts[len(self.mounts):], self._uid)  # per-run read-write mounts: this run only
        try:
            return self._run(command, timeout_s, all_mounts)
        finally:
            owned.release()

    def _run(self, command: str, timeout_s: float, mounts: Sequence[Mount]) -> ExecResult:
        before = self._cgroup.counters()
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                self._argv(command, mounts), cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
            )
        except (OSError, ValueError) as e:
            return ExecResult("", f"sandbox: could not start the command: {e}", 126, time.monotonic() - start)
        try:
            out, err, truncated, limit = self._communicate(proc, timeout_s)
        finally:
            self._kill(proc)
        duration = time.monotonic() - start
        rc = proc.returncode
        rc = 137 if rc is None else rc if rc >= 0 else 128 - rc  # None: still dying after SIGKILL
        if limit in ("wall_clock", "output"):
            rc = 128 + signal.SIGKILL  # we killed it; launchers (unshare) may report that differently
        stdout = out.decode("utf-8", errors="replace")
        stderr = err.decode("utf-8", errors="replace")
        if self._isolation == "unshare":  # util-linux noise when its child was SIGKILLed by us
            stderr = stderr.replace("unshare: sigprocmask unblock failed: Invalid argument\n", "")
        if limit != "output":  # a fork bomb hits pids.max, then hangs until the wall clock: say processes
            limit = self._which_limit(rc, stderr, before) or limit
        return ExecResult(stdout, stderr, rc, round(duration, 4), limit, truncated)

    def _communicate(self, proc: subprocess.Popen, timeout_s: float) -> tuple[bytes, bytes, bool, str | None]:
        """Read both pipes as they fill, keep the first output_bytes of each, enforce the wall clock."""
        lim = self.limits
        bufs = [bytearray(), bytearray()]
        total, truncated, limit, killed_at = 0, False, None, None
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, 0)
        sel.register(proc.stderr, selectors.EVENT_READ, 1)
        try:
            while sel.get_map():
                now = time.monotonic()
                if killed_at is None:
                    if now >= deadline:
                        limit, killed_at = "wall_clock", now
                        self._kill(proc)
                    elif proc.poll() is not None:  # done: its strays must not hold the pipes open
                        killed_at = now
                        self._kill(proc)
                elif now - killed_at > 2.0:  # something unkillable holds a pipe; give up on it
                    break
                for key, _ in sel.select(timeout=0.05):
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(data)
                    buf = bufs[key.data]
                    room = lim.output_bytes - len(buf)
                    if room > 0:
                        buf += data[:room]
                    if len(data) > room:
                        truncated = True
                    if total > lim.output_kill_bytes and killed_at is None:
                        limit, killed_at = "output", time.monotonic()
                        self._kill(proc)
        finally:
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
        return bytes(bufs[0]), bytes(bufs[1]), truncated, limit

    def _kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the command's tree: the process group, the cgroup, and with them the pid namespace.

        With a cgroup, everything but the launcher (bwrap or unshare) dies first, so that the
        launcher reaps its child before it exits itself: a host init that does not reap (this
        project's machines) would otherwise collect one zombie per timeout.
        """
        if self._cgroup.dirs and proc.poll() is None:
            self._cgroup.kill_all(spare=proc.pid)
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._cgroup.kill_all()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _which_limit(self, rc: int, stderr: str, before: tuple[int, int]) -> str | None:
        pids_hits, ooms = self._cgroup.counters()
        if ooms > before[1]:
            return "memory"
        if pids_hits > before[0]:
            return "processes"
        return limit_from_exit(rc, stderr)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owned is not None:
            self._owned.release()
        self._cgroup.remove()
        remove_tree(self.workdir)
