"""`tsrl env exec`: thin shell over open_sandbox; exit 0 when the command ran, 2 on bad usage."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from tsrl_cli.cli.env import env_app
from tsrl_cli.sandbox import local as local_mod

app = typer.Typer()
app.add_typer(env_app, name="env")


@pytest.fixture
def task(tmp_path):
    (tmp_path / "a.txt").write_text("hi\n")
    return tmp_path


def _isolated():
    if not (local_mod.bwrap_works() or local_mod._is_root()):
        pytest.skip("no isolation on this machine (needs bwrap, or root for unshare)")


def test_exec_json_is_one_document(task):
    _isolated()
    r = CliRunner().invoke(app, ["env", "exec", "--workdir", str(task), "--json", "--", "cat a.txt; exit 4"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["stdout"] == "hi\n" and doc["exit_code"] == 4 and doc["limit"] is None
    assert doc["isolation"] in ("bwrap", "unshare")


def test_exec_reports_the_limit(task):
    _isolated()
    r = CliRunner().invoke(app, ["env", "exec", "--workdir", str(task), "--timeout-s", "1", "--", "sleep", "30"])
    assert r.exit_code == 0
    assert "limit fired: wall_clock" in r.stderr and "isolation" in r.stderr


def test_exec_usage_errors_exit_2(task, monkeypatch):
    r = CliRunner().invoke(app, ["env", "exec", "--workdir", str(task / "missing"), "--", "ls"])
    assert r.exit_code == 2 and "not a directory" in r.stderr
    r = CliRunner().invoke(app, ["env", "exec", "--workdir", str(task), "--executor", "nope", "--", "ls"])
    assert r.exit_code == 2 and "executor" in r.stderr
    monkeypatch.setattr(local_mod, "bwrap_works", lambda: False)
    monkeypatch.setattr(local_mod, "_is_root", lambda: False)
    r = CliRunner().invoke(app, ["env", "exec", "--workdir", str(task), "--", "ls"])
    assert r.exit_code == 2 and "--allow-unisolated" in r.stderr
    r = CliRunner().invoke(app, ["env", "exec", "--workdir", str(task), "--allow-unisolated", "--", "cat a.txt"])
    assert r.exit_code == 0 and r.stdout == "hi\n"


def test_env_help_does_not_import_torch():
    code = (
        "import sys\n"
        "import typer\n"
        "from typer.testing import CliRunner\n"
        "from tsrl_cli.cli.env import env_app\n"
        "app = typer.Typer(); app.add_typer(env_app, name='env')\n"
        "assert CliRunner().invoke(app, ['env', 'exec', '--help']).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'docker') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
