"""The local sandbox stops what agent-written commands may try (each limit and each isolation rule).

Every bomb is bounded twice: by the sandbox limits under test (64 processes, 512 MiB, 2 s of
CPU) and by a wall clock of a few seconds (30 for the CPU-time bomb, so that a loaded machine cannot
make the wall clock fire first), so a broken sandbox still cannot hurt the machine.
Each "Done when" case runs under every isolation this machine offers (bwrap; unshare as root).
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from tsrl_cli.sandbox import IsolationError, Limits, open_sandbox
from tsrl_cli.sandbox import local as local_mod
from tsrl_cli.sandbox.local import TOOL_PATH, LocalSandbox, choose_isolation, limit_from_exit

SMALL = Limits(cpu_time_s=2, memory_bytes=512 << 20, processes=64, file_size_bytes=1 << 20,
               output_bytes=64 << 10, output_kill_bytes=1 << 20)


@pytest.fixture
def task_dir(tmp_path):
    d = tmp_path / "task"
    (d / "src").mkdir(parents=True)
    (d / "src" / "a.txt").write_text("hello from the task\n")
    return d


@pytest.fixture
def sb(isolation, task_dir):
    with LocalSandbox(task_dir, limits=SMALL, isolation=isolation) as s:
        yield s


def _procs_in(workdir: Path) -> list[int]:
    """Host pids whose working directory is the sandbox's (the sandboxed processes keep that path)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "cwd") == str(workdir):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


# -- the "Done when" list ---------------------------------------------------------------------


def test_write_outside_workdir_is_refused(sb, tmp_path):
    outside = tmp_path / "outside.txt"  # under /tmp on the host: a private tmpfs in the sandbox
    repo_file = Path(__file__).with_name("evil.txt")  # a host path that stays visible, read-only
    r = sb.run(f"echo x > {outside}; echo x > {repo_file}; echo x > /etc/tsrl-evil; echo ok > inside.txt", 10)
    assert not outside.exists() and not repo_file.exists() and not Path("/etc/tsrl-evil").exists()
    assert "Read-only file system" in r.stderr
    assert (sb.workdir / "inside.txt").read_text() == "ok\n"  # the workdir itself is writable


def test_loopback_server_is_unreachable(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted, done = [], threading.Event()

    def serve():
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not accepted and not done.is_set():
            try:
                accepted.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        r = sb.run(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected", 5)
    finally:
        done.set()
        t.join(timeout=6)
        srv.close()
    assert accepted == [] and "connected" not in r.stdout
    assert r.exit_code != 0


def test_fork_bomb_is_capped(sb):
    r = sb.run("bomb() { bomb | bomb & }; bomb; sleep 1", 4)
    assert r.limit == "processes", r
    assert r.duration_s < 10
    assert _procs_in(sb.workdir) == []  # nothing left behind on the host


def test_limit_named_from_the_exit():
    """A fork bomb's bash says EAGAIN at the cap and then ENOMEM once the pid namespace's init has gone
    (stderr seen on a CI machine): that is the process cap. A plain MemoryError is memory."""
    bomb = ("environment: fork: retry: Resource temporarily unavailable\n"
            "environment: fork: Cannot allocate memory\n")
    assert limit_from_exit(0, bomb) == "processes"
    assert limit_from_exit(1, "Traceback ...\nMemoryError\n") == "memory"
    assert limit_from_exit(1, "bash: fork: Cannot allocate memory\n") == "memory"
    assert limit_from_exit(152, "") == "cpu_time"
    assert limit_from_exit(1, "AssertionError\n") is None


def test_memory_bomb_is_capped(sb):
    r = sb.run("python3 -c 'b = bytearray(2 << 30)'", 10)  # 2 GiB against a 512 MiB cap
    assert r.limit == "memory" and r.exit_code != 0, r


def test_memory_bomb_of_many_processes_hits_the_cgroup(sb):
    if "memory" not in sb.cgroups:
        pytest.skip("no memory cgroup here (needs root on cgroup v1, or a delegated v2 cgroup)")
    # 4 x 400 MB resident: each process is under RLIMIT_AS (512 MiB), the tree is not
    touch = "import time; b = bytearray(400 << 20); b[::4096] = bytes(len(b[::4096])); time.sleep(1)"
    r = sb.run(f"for i in 1 2 3 4; do python3 -c '{touch}' & done; wait", 8)
    assert r.limit == "memory", r


def test_infinite_loop_hits_cpu_time(sb):
    # 2 s of CPU under a 30 s wall clock: the CPU limit fires first while the loop gets 7 % of a core or
    # more (load 4-5 on 2 cores gives it about 40 %), so the machine's load cannot make it the wall clock
    r = sb.run("while :; do :; done", 30)
    assert r.limit == "cpu_time" and r.exit_code == 152, r  # 128 + SIGXCPU
    assert r.duration_s < 28


def test_hang_hits_wall_clock(sb):
    r = sb.run("sleep 60", 1)
    assert r.limit == "wall_clock" and r.exit_code == 137, r
    assert r.duration_s < 4
    assert _procs_in(sb.workdir) == []


def test_100mb_of_output_is_capped(sb):
    r = sb.run("head -c 100000000 /dev/zero | tr '\\0' x", 20)
    assert r.limit == "output" and r.truncated, r.limit
    assert len(r.stdout) == SMALL.output_bytes and set(r.stdout) == {"x"}
    assert r.duration_s < 10


def test_big_file_hits_file_size(sb):
    r = sb.run("head -c 5M /dev/zero > big.bin", 10)
    assert r.limit == "file_size", r
    assert (sb.workdir / "big.bin").stat().st_size <= SMALL.file_size_bytes


# -- ordinary behaviour -----------------------------------------------------------------------


def test_normal_command_and_task_files(sb, task_dir):
    r = sb.run("cat src/a.txt; pwd; echo err >&2", 10)
    assert r.exit_code == 0 and r.limit is None and not r.truncated
    assert r.stdout == f"hello from the task\n{sb.workdir}\n" and r.stderr == "err\n"
    sb.run("echo changed > src/a.txt", 10)
    assert (task_dir / "src" / "a.txt").read_text() == "hello from the task\n"  # a copy, not the task


def test_tmp_and_shared_memory_are_private_and_writable(sb):
    r = sb.run("echo t > /tmp/t && cat /tmp/t && python3 -c "
               "'import multiprocessing as m; print(m.Pool(2).map(abs, [-1, -2]))'", 20)
    assert r.stdout == "t\n[1, 2]\n", r
    assert not Path("/tmp/t").exists() or Path("/tmp/t").read_text() != "t\n"


def test_exit_codes(sb):
    assert sb.run("exit 3", 10).exit_code == 3
    assert sb.run("kill -9 $$", 10).exit_code == 137
    assert sb.run("no-such-command-xyz", 10).exit_code == 127


def test_nul_byte_in_a_command_is_a_tool_error(sb):
    """A model can emit a NUL byte; no argv can carry one: the tool answers, the run goes on."""
    res = sb.run("echo a\x00b", 5)
    assert res.exit_code == 126 and "NUL byte" in res.stderr
    assert sb.run("echo ok", 5).stdout == "ok\n"


def test_environment_is_scrubbed(sb, monkeypatch):
    monkeypatch.setenv("TSRL_TEST_SECRET", "s3cret")
    r = sb.run("env", 10)
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert "TSRL_TEST_SECRET" not in env and "s3cret" not in r.stdout
    assert env["PATH"] == TOOL_PATH and env["HOME"] == str(sb.workdir) and env["LANG"] == "C.UTF-8"


def test_private_files_are_invisible(sb):
    r = sb.run("ls -A /root; ls -A /home; cat /etc/shadow", 10)
    # only the interpreter's installation may show under /root (ro_binds, e.g. pyenv), read-only
    shown = {Path(p).parts[2] for p in sb.ro_binds if p.startswith(("/root/", "/home/"))}
    assert set(r.stdout.split()) <= shown and "root:" not in r.stdout
    try:
        host_root = set(os.listdir("/root"))
    except OSError:
        host_root = set()
    assert not (host_root - shown) & set(r.stdout.split())
    assert sb.run("id -u", 10).stdout.strip() != "0"  # never root on the host


def test_ro_binds_show_a_hidden_directory_read_only(task_dir):
    with LocalSandbox(task_dir, limits=SMALL, ro_binds=[]) as s:
        assert s.run("ls -A /root", 10).stdout == ""
    if os.geteuid() != 0:
        pytest.skip("the interpreter is visible anyway when not root")
    import sys

    with LocalSandbox(task_dir, limits=SMALL) as s:  # default: this interpreter, if hidden
        r = s.run(f"{sys.executable} -c 'import sys; print(sys.version_info[0])'", 20)
        assert r.stdout == "3\n", r


def test_background_processes_die_with_the_command_and_close(task_dir):
    with LocalSandbox(task_dir, limits=SMALL) as s:
        r = s.run("setsid sleep 300 & sleep 300 & echo started", 10)
        assert r.stdout == "started\n" and r.duration_s < 5  # the strays do not hold the pipes open
        assert _procs_in(s.workdir) == []
        workdir = s.workdir
    assert not workdir.exists()
    assert s.run("echo hi", 5).exit_code == 126  # closed: an error result, not an exception


# -- isolation choice -------------------------------------------------------------------------


def test_refuses_without_isolation(monkeypatch):
    monkeypatch.setattr(local_mod, "bwrap_works", lambda: False)
    monkeypatch.setattr(local_mod, "_is_root", lambda: False)
    with pytest.raises(IsolationError, match="--allow-unisolated"):
        choose_isolation("auto")
    with pytest.raises(IsolationError):
        open_sandbox(None, isolation="none")
    assert choose_isolation("auto", allow_unisolated=True) == "none"


def test_unisolated_when_allowed(task_dir):
    with open_sandbox(task_dir, isolation="none", allow_unisolated=True, limits=SMALL) as s:
        assert s.isolation == "none" and "NONE" in s.isolation_summary
        r = s.run("cat src/a.txt; sleep 60", 1)
        assert r.stdout == "hello from the task\n" and r.limit == "wall_clock"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)")
def test_auto_prefers_bwrap():
    if not local_mod.bwrap_works():
        pytest.skip("bwrap is installed but cannot create namespaces here")
    assert choose_isolation("auto") == "bwrap"
