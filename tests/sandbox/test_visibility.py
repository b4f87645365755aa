"""The sandbox shows only what the task needs: a file planted anywhere in the project checkout, in
data/, in a home directory, in another sandbox's working copy or elsewhere on the host is absent, under
bwrap and unshare alike; the working copy, the system tools and the interpreter are there."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tsrl_cli
from tsrl_cli.cli import app
from tsrl_cli.sandbox import local as local_mod
from tsrl_cli.sandbox.local import LocalSandbox

CHECKOUT = Path(tsrl_cli.__file__).resolve().parents[1]


@pytest.fixture
def planted(tmp_path):
    """Secret files in the places an agent must not reach; removed afterwards."""
    secret = f"tsrl-secret-{uuid.uuid4().hex}"  # the content; the names differ (error messages print names)
    name = f"tsrl-planted-{uuid.uuid4().hex}"
    places = [CHECKOUT / f".{name}", CHECKOUT / "data" / f".{name}", CHECKOUT / "tsrl_cli" / f".{name}",
              Path.home() / f".{name}", tmp_path / name]
    if os.geteuid() == 0:
        places += [Path("/srv") / f".{name}", Path("/opt") / f".{name}", Path("/var/lib") / f".{name}"]
    made = []
    for p in places:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(secret + "\n")
            made.append(p)
        except OSError:
            pass
    yield secret, made
    for p in made:
        p.unlink(missing_ok=True)


def test_planted_files_are_absent(isolation, planted, tmp_path):
    secret, files = planted
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "mine.txt").write_text("the task's own file\n")
    with LocalSandbox(tmp_path / "task", isolation=isolation) as other, \
            LocalSandbox(tmp_path / "task", isolation=isolation) as sb:
        (other.workdir / "theirs.txt").write_text(secret)  # another trajectory's working copy
        paths = [*files, other.workdir / "theirs.txt"]
        r = sb.run("; ".join(f"cat {p} 2>&1" for p in paths) + f"; ls -a {CHECKOUT} 2>&1; cat mine.txt; "
                   f"{sys.executable} -c 'print(2 + 2)'", 60)
    assert secret not in r.stdout, r.stdout[-2000:]
    assert r.stdout.count("No such file or directory") >= len(paths), r.stdout
    assert "the task's own file" in r.stdout and r.stdout.rstrip().endswith("4")  # positive control
    with LocalSandbox(tmp_path / "task", isolation="none", allow_unisolated=True) as bare:  # positive control
        assert bare.run("; ".join(f"cat {p}" for p in files), 30).stdout.count(secret) == len(files)
    listed = r.stdout.split("No such file or directory")[-1]
    assert "tsrl_cli" not in listed and "README.md" not in listed  # of the checkout only its venv may show


def test_only_the_system_roots_the_interpreter_and_the_task_are_there(isolation, tmp_path):
    with LocalSandbox(None, isolation=isolation) as sb:
        top = set(sb.run("ls -A /", 10).stdout.split())
    host_only = {p.name for p in Path("/").iterdir()} - top
    allowed = {p.strip("/").split("/")[0] for p in (*local_mod.SYSTEM_ROOTS, "/dev", "/proc", "/tmp", "/var",
                                                    *sb.ro_binds, str(sb.workdir))}
    assert top <= allowed, top - allowed
    assert {"usr", "etc", "tmp", "proc", "dev"} <= top and host_only  # the rest of the host is not there


def test_env_exec_prints_the_visible_roots(tmp_path):
    (tmp_path / "w").mkdir()
    res = CliRunner().invoke(app, ["env", "exec", "--workdir", str(tmp_path / "w"), "--json", "--", "true"])
    assert res.exit_code == 0, res.output
    roots = json.loads(res.stdout)["visible_roots"]
    assert any(r.startswith("/usr ") for r in roots) and any("working copy" in r for r in roots)
    assert not any(r.startswith(str(CHECKOUT) + " ") for r in roots)
    res = CliRunner().invoke(app, ["env", "exec", "--workdir", str(tmp_path / "w"), "--", "true"])
    assert "visible of the host:" in res.stderr and "/usr (read-only)" in res.stderr


def test_an_interpreter_under_tmp_stays_runnable(isolation, tmp_path):
    """A checkout (and its venv) under /tmp, as in a CI clone there: the private /tmp must still show it,
    traversable by the sandbox's uid, and nothing else of the host's /tmp."""
    venv = tmp_path / "clone" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "tool").write_text("#!/bin/sh\necho from-the-venv\n")
    (venv / "tool").chmod(0o755)
    (tmp_path / "clone" / "secret.txt").write_text("checkout file\n")
    assert str(tmp_path).startswith("/tmp/")  # what this test is about (pytest's default basetemp)
    with LocalSandbox(None, isolation=isolation, ro_binds=[str(tmp_path / "clone" / ".venv")]) as sb:
        r = sb.run(f"{venv / 'tool'}; cat {tmp_path / 'clone' / 'secret.txt'} 2>&1; ls -A {tmp_path}", 10)
    assert r.stdout.startswith("from-the-venv\n"), r
    assert "checkout file" not in r.stdout and r.stdout.rstrip().endswith("clone"), r.stdout
