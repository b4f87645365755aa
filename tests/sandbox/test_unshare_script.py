"""The unshare isolation's script is a static file: shellcheck reads it clean, the package ships it, and
paths reach it as arguments (odd characters included), never as shell text. No handle the script
opens on a host path reaches the command.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from tsrl_cli.sandbox import Mount
from tsrl_cli.sandbox.local import LocalSandbox
from tsrl_cli.sandbox.unshare import script

SCRIPT = resources.files("tsrl_cli.sandbox") / "unshare.sh"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
needs_shellcheck = pytest.mark.skipif(shutil.which("shellcheck") is None,
                                      reason="shellcheck not installed (apt-get install shellcheck)")


def shellcheck(path: Path) -> subprocess.CompletedProcess:
    """shellcheck at its strictest severity (style): exit 0 only when it has nothing to say."""
    return subprocess.run(["shellcheck", "--severity=style", str(path)], capture_output=True, text=True, timeout=60)


@needs_shellcheck
def test_shellcheck_flags_a_bad_snippet(tmp_path):
    """Positive control: unquoted expansions and a loop over ls are what shellcheck exists to catch."""
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/bin/bash\nfor f in $(ls $1); do rm $f; done\n')
    r = shellcheck(bad)
    assert r.returncode != 0 and "SC2045" in r.stdout and "SC2086" in r.stdout, r.stdout


@needs_shellcheck
def test_unshare_script_passes_shellcheck():
    r = shellcheck(Path(str(SCRIPT)))
    assert r.returncode == 0, r.stdout


def test_script_is_package_data():
    """A non-editable install ships unshare.sh only when pyproject lists it as package data."""
    data = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]
    assert "unshare.sh" in data["tsrl_cli.sandbox"]
    assert script() == SCRIPT.read_text() and script().startswith("#!/bin/bash\n")


def test_odd_paths_reach_the_script_as_they_are(isolation, tmp_path):
    """Quotes, spaces, `$`, a glob and a newline in the working directory, a mount's host path and its
    target: each shown where it was asked."""
    odd = "a b'c\"d$HOME*e\nf"
    host, base = tmp_path / "host" / odd, tmp_path / "base" / odd
    (host / "task").mkdir(parents=True)
    base.mkdir(parents=True)
    (host / "data.txt").write_text("mounted\n")
    (host / "task" / "mine.txt").write_text("mine\n")
    target = f"/tests/{odd}"
    with LocalSandbox(host / "task", isolation=isolation, base_dir=str(base)) as sb:
        assert odd in str(sb.workdir)
        r = sb.run(f"cat {shlex.quote(target)}/data.txt mine.txt; pwd", 20, mounts=[Mount(str(host), target)])
        assert r.stdout == f"mounted\nmine\n{sb.workdir}\n", r


def test_no_host_handle_reaches_the_command(isolation, tmp_path):
    """The script holds fds on ro binds, mount sources, splices and the working directory (each one a way
    out of the new root); the command sees only stdin, stdout and stderr."""
    (tmp_path / "m").mkdir()
    fds = "ls /proc/self/fd | sort -n | tr '\\n' ' '"  # fd 3 is ls's own, open on /proc/self/fd
    with LocalSandbox(None, isolation=isolation) as sb:
        mounts = [Mount(str(tmp_path / "m"), "/tests"), Mount(str(tmp_path / "m"), "/etc/tsrl-test")]
        r = sb.run(fds, 20, mounts=mounts)
        control = sb.run(f"exec 7</dev/null; {fds}", 20)  # positive control: an open fd shows in the list
    assert r.stdout == "0 1 2 3 ", r
    assert control.stdout == "0 1 2 3 7 ", control
