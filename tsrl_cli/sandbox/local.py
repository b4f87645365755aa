"""The `local` executor: each command in its own process group, namespaces and rlimits.

LocalSandbox chooses its isolation once and owns the process: start, read, kill, the limits.
The root a command sees is layout.py's; the tool that builds it is the isolation's own module:

- `bwrap` (bwrap.py): bubblewrap, as a user in a user namespace, as root dropping to the sandbox uid.
- `unshare` (unshare.py and its script unshare.sh; root only, when bwrap is missing): util-linux
  unshare with the same namespaces and the same root, built on a tmpfs and entered with chroot.
- `none`: only the rlimits, the process group and the scrubbed environment. Refused unless the
  caller passes allow_unisolated=True (the CLI's --allow-unisolated); refuses mounts.

As root, commands run as a uid of their own with no capabilities (ownership.py), which also owns a
read-write mount's host path for the mount's lifetime, then gives it back with what the command
created inside (set-id bits dropped). A host directory must not be mounted read-write by two
sandboxes at once.

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

import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

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
from tsrl_cli.sandbox.bwrap import bwrap_argv, bwrap_works
from tsrl_cli.sandbox.layout import SYSTEM_ROOTS, default_ro_binds, mount_layout
from tsrl_cli.sandbox.ownership import OwnedMounts, fresh_uid
from tsrl_cli.sandbox.unshare import unshare_argv

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# `python` (and pytest) inside the sandbox is this interpreter's environment, shown read-only:
# embedded repair tasks are pure Python verified with pytest, and the agent runs them the same way.
TOOL_PATH = f"{os.path.dirname(sys.executable)}:{SAFE_PATH}"
ISOLATIONS = ("auto", "bwrap", "unshare", "none")


def _unisolated_argv(workdir: str, ro_binds: Sequence[str], mounts: Sequence[Mount], uid: int | None) -> list[str]:
    """`none` has no launcher: the command runs as it is (mounts were refused before)."""
    return []


# isolation -> its launcher argv(workdir, ro_binds, mounts, uid), which the command's argv follows
LAUNCHERS = {"bwrap": bwrap_argv, "unshare": unshare_argv, "none": _unisolated_argv}

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


def _is_root() -> bool:
    return os.geteuid() == 0


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
        self._launcher = LAUNCHERS[self._isolation]
        self.limits = limits or Limits()
        # host directories shown read-only even under a hidden path
        self.ro_binds = [os.path.realpath(p) for p in (default_ro_binds() if ro_binds is None else ro_binds)]
        self.workdir = copy_task_dir(task_dir, base_dir)
        self._closed = False
        # As root, commands run as a uid of their own (sandbox_uid, default a random unused one):
        # not root on the host, and RLIMIT_NPROC, which counts per uid, counts this sandbox only.
        self._uid = None
        if _is_root() and self._isolation != "none":
            self._uid = sandbox_uid if sandbox_uid is not None else fresh_uid()
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
            self._owned = OwnedMounts(self.mounts, self._uid)
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
        root = "no network, a root of its own (system directories read-only), private /tmp, pid namespace"
        how = {"bwrap": f"bwrap: {root}", "unshare": f"unshare: {root}",
               "none": "NONE: commands can read and write the host and use the network"}[self._isolation]
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

    def _argv(self, command: str, mounts: Sequence[Mount] = ()) -> list[str]:
        argv = [*self._launcher(str(self.workdir), self.ro_binds, mounts, self._uid), *self._limited_bash(command)]
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
        owned = OwnedMounts(all_mounts[len(self.mounts):], self._uid)  # per-run read-write mounts: this run only
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
