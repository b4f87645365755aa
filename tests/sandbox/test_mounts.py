"""Extra mounts: a Harbor-style verifier sees /tests (read-only) and writes /logs/verifier/reward.txt.

Each case runs under every isolation this machine offers (bwrap; unshare as root).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox import Limits, Mount, open_sandbox
from tsrl_cli.sandbox import local as local_mod
from tsrl_cli.sandbox.local import LocalSandbox

SMALL = Limits(cpu_time_s=5, memory_bytes=1 << 30, processes=64, file_size_bytes=1 << 20,
               output_bytes=64 << 10, output_kill_bytes=1 << 20)


@pytest.fixture
def harbor(tmp_path):
    """A Harbor-like task: tests/test.sh writes the reward; logs/verifier starts empty (root-owned 0755)."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text("#!/bin/bash\n"
                                   "cat /app/answer.txt > /dev/null && echo 1 > /logs/verifier/reward.txt\n")
    (tests / "data.txt").write_text("expected\n")
    logs = tmp_path / "logs" / "verifier"
    logs.mkdir(parents=True)
    os.chmod(logs, 0o755)
    app = tmp_path / "app"
    app.mkdir()
    (app / "answer.txt").write_text("42\n")
    return tmp_path


def _verifier(harbor: Path) -> list[Mount]:
    return [Mount(str(harbor / "tests"), "/tests"), Mount(str(harbor / "logs" / "verifier"), "/logs/verifier", False)]


def test_ro_mount_is_readable_and_not_writable(isolation, harbor):
    with LocalSandbox(None, limits=SMALL, isolation=isolation) as sb:
        r = sb.run("cat /tests/data.txt; echo x > /tests/data.txt; echo x > /tests/new; touch /new-top", 10,
                   mounts=[Mount(str(harbor / "tests"), "/tests")])
    assert r.stdout == "expected\n", r
    assert r.stderr.count("Read-only file system") == 3, r.stderr
    assert (harbor / "tests" / "data.txt").read_text() == "expected\n" and not (harbor / "tests" / "new").exists()
    assert not Path("/tests").exists() and not Path("/new-top").exists()  # the host is not changed


def test_rw_mount_receives_the_reward(isolation, harbor):
    logs = harbor / "logs" / "verifier"
    before = logs.stat()
    with LocalSandbox(None, limits=SMALL, isolation=isolation,
                      mounts=[Mount(str(harbor / "app"), "/app")]) as sb:  # sandbox-level: every command
        r = sb.run("bash /tests/test.sh && mkdir /logs/verifier/sub && "
                   "echo '{\"reward\": 1}' > /logs/verifier/sub/r.json",
                   30, mounts=_verifier(harbor))
        assert r.exit_code == 0, r
        assert (logs / "reward.txt").read_text() == "1\n"
        assert (logs / "sub" / "r.json").read_text() == '{"reward": 1}\n'
        # given back: the host path and what the command made in it belong to the path's owner again
        after = logs.stat()
        assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
        assert {p.stat().st_uid for p in logs.rglob("*")} == {before.st_uid}
        assert sb.run("cat /app/answer.txt", 10).stdout == "42\n"


def test_per_run_mounts_are_absent_from_other_runs(isolation, harbor):
    with LocalSandbox(None, limits=SMALL, isolation=isolation) as sb:
        assert sb.run("ls /tests /logs", 10).exit_code != 0  # the agent's episode: no tests
        assert sb.run("cat /tests/data.txt", 10, mounts=_verifier(harbor)).stdout == "expected\n"
        r = sb.run("ls /tests /logs", 10)
        assert r.exit_code != 0 and "No such file or directory" in r.stderr, r
        r = sb.run("ls /", 10)
        assert "tests" not in r.stdout.split() and "logs" not in r.stdout.split(), r


@pytest.mark.parametrize("new_root", [True, False], ids=["new-root", "in-place"])
def test_targets_of_every_kind(isolation, harbor, tmp_path, new_root):
    """Missing at the top (the root is rebuilt), missing under an existing host directory (spliced),
    under a hidden one (/tmp), a file, an existing directory."""
    f = tmp_path / "one.txt"
    f.write_text("one\n")
    existing = "/usr/share" if os.path.isdir("/usr/share") else "/usr"
    ms = [Mount(str(harbor / "tests"), "/etc/tsrl-test/tests"), Mount(str(f), "/tmp/deep/one.txt"),
          Mount(str(harbor / "app"), existing)]
    if new_root:
        ms.append(Mount(str(f), "/top-one.txt"))
    with LocalSandbox(None, limits=SMALL, isolation=isolation) as sb:
        r = sb.run(f"cat /etc/tsrl-test/tests/data.txt /tmp/deep/one.txt {existing}/answer.txt; "
                   "cat /etc/hostname > /dev/null && echo etc-kept; cat /etc/shadow; touch /etc/x; "
                   "cat /top-one.txt 2>/dev/null", 20, mounts=ms)
        assert "Read-only file system" in r.stderr, r
        assert sb.run("ls /etc/tsrl-test /tmp/deep", 10).exit_code != 0
    assert r.stdout == "expected\none\n42\netc-kept\n" + ("one\n" if new_root else ""), r
    assert "root:" not in r.stdout and not Path("/etc/tsrl-test").exists() and not Path("/top-one.txt").exists()


def test_interpreter_still_runs_with_mounts(isolation, harbor):
    """The rebuilt root keeps ro_binds (this interpreter under /root), so a verifier can use sys.executable."""
    with LocalSandbox(None, limits=SMALL, isolation=isolation) as sb:
        r = sb.run(f"{sys.executable} -c 'print(open(\"/tests/data.txt\").read().strip())'", 30,
                   mounts=_verifier(harbor))
    assert r.stdout == "expected\n", r


@pytest.mark.parametrize(("mount", "match"), [
    (Mount("/nonexistent-tsrl", "/tests"), "does not exist"),
    (Mount("{tests}", "tests"), "absolute"),
    (Mount("{tests}", "/a/../tests"), "absolute"),
    (Mount("/", "/host"), "host root"),
    (Mount("{tests}", "/"), "cannot be /"),
    (Mount("{tests}", "/proc/x"), "/proc"),
    (Mount("{workdir_parent}", "/w"), "working directory"),
    (Mount("{tests}", "{workdir}/t"), "working directory"),
    (Mount("{file}", "/etc"), "not a file"),
])
def test_bad_mounts_are_usage_errors(harbor, mount, match):
    if not (local_mod.bwrap_works() or local_mod._is_root()):
        pytest.skip("no isolation on this machine")
    (harbor / "f.txt").write_text("f")
    with LocalSandbox(None, limits=SMALL) as sb:
        fill = {"tests": str(harbor / "tests"), "workdir": str(sb.workdir),
                "workdir_parent": str(sb.workdir.parent), "file": str(harbor / "f.txt")}
        m = Mount(mount.host.format(**fill), mount.target.format(**fill), mount.read_only)
        with pytest.raises(UsageError, match=match):
            sb.run("true", 5, mounts=[m])
        with pytest.raises(UsageError, match="overlaps another"):
            sb.run("true", 5, mounts=[Mount(fill["tests"], "/t"), Mount(fill["tests"], "/t/u")])
        assert sb.run("echo still fine", 5).stdout == "still fine\n"
    if "{workdir}" not in mount.target:  # a new sandbox has a workdir of its own
        with pytest.raises(UsageError, match=match):
            open_sandbox(None, mounts=[m])


def test_unisolated_refuses_mounts(harbor):
    with pytest.raises(UsageError, match="need sandbox isolation"):
        open_sandbox(None, isolation="none", allow_unisolated=True, mounts=[Mount(str(harbor / "tests"), "/tests")])
    with open_sandbox(None, isolation="none", allow_unisolated=True) as sb, \
            pytest.raises(UsageError, match="need sandbox isolation"):
        sb.run("true", 5, mounts=[Mount(str(harbor / "tests"), "/tests")])


def test_sandbox_level_rw_mount_is_given_back_at_close(isolation, harbor):
    logs = harbor / "logs" / "verifier"
    before = logs.stat()
    sb = open_sandbox(None, limits=SMALL, isolation=isolation, mounts=[Mount(str(logs), "/logs/verifier", False)])
    with sb:
        assert sb.run("echo 0.5 > /logs/verifier/reward.txt", 10).exit_code == 0
        assert sb.run("cat /logs/verifier/reward.txt", 10).stdout == "0.5\n"
    assert (logs / "reward.txt").read_text() == "0.5\n"
    assert {p.stat().st_uid for p in (logs, *logs.rglob("*"))} == {before.st_uid}


def test_own_tree_mount_lets_commands_change_shipped_files(isolation, tmp_path):
    """A working copy mounted with own_tree: existing files can be chmod-ed, moved and removed;
    plain rw mounts keep shipped files read-only to the sandbox uid (root-owned here)."""
    app = tmp_path / "app"
    (app / "sub").mkdir(parents=True)
    (app / "run.sh").write_text("echo hi\n")
    (app / "sub" / "old.txt").write_text("x\n")
    owner = app.stat().st_uid
    sb = open_sandbox(None, limits=SMALL, isolation=isolation,
                      mounts=[Mount(str(app), "/app", read_only=False, own_tree=True)])
    with sb:
        res = sb.run("cd /app && chmod +x run.sh && mv sub/old.txt sub/new.txt && rm run.sh && echo ok", 10)
        assert res.exit_code == 0 and res.stdout == "ok\n", res.stderr
    assert (app / "sub" / "new.txt").exists() and not (app / "run.sh").exists()
    assert {p.stat().st_uid for p in (app, *app.rglob("*"))} == {owner}  # given back at close


@pytest.mark.parametrize("target", ["/tests", "/etc/tsrl-test/tests"], ids=["new-root", "in-place"])
def test_working_copy_stays_the_cwd_with_mounts(isolation, harbor, target):
    """A verifier reads the agent's files relative to the cwd. Under unshare, a rebuilt root (a new
    top-level target such as /tests) once left the command in the host's / instead: every embedded
    terminal reward was 0 and `tsrl prepare-data embedded` failed on machines without bwrap."""
    with LocalSandbox(None, limits=SMALL, isolation=isolation) as sb:
        assert sb.run("echo made > mine.txt", 10).exit_code == 0
        r = sb.run("cat mine.txt; pwd; echo again >> mine.txt", 10, mounts=[Mount(str(harbor / "tests"), target)])
        assert r.stdout == f"made\n{sb.workdir}\n" and r.stderr == "", r
        assert sb.run("cat mine.txt", 10).stdout == "made\nagain\n"
