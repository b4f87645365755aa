"""The time limits and opt-in markers that tests/conftest.py sets, checked on a small suite run in a subprocess
with this project's own conftest and pytest settings: a hung test fails by its limit with its stack, a slow test
gets the longer limit, an opt-in test runs only when `-m` names its marker, and a hang that no signal reaches
ends the run with every thread's stack."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = """
import signal
import time

import pytest


def test_quick():
    pass


def test_hangs():
    time.sleep(600)


@pytest.mark.slow
def test_slow_outlives_the_fast_limit():
    time.sleep(2)


@pytest.mark.vllm
def test_opt_in_named():
    pass


@pytest.mark.gpu
def test_opt_in_not_named():
    pass


def test_hangs_where_no_signal_lands():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)
"""
# stands in for torch, which the conftest imports for one call: the runs here skip its import time
TORCH_STUB = "def set_num_threads(n):\n    pass\n"


def run_suite(tmp_path: Path, *args: str, **ini) -> subprocess.CompletedProcess:
    """pytest ARGS on SUITE beside a copy of tests/conftest.py, under pyproject's pytest settings with INI over them."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    settings = {k: v for k, v in settings.items() if k != "testpaths"} | ini
    # JSON strings, numbers and lists of strings are also TOML values
    toml = "[tool.pytest.ini_options]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    (tmp_path / "pyproject.toml").write_text(toml)
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "torch.py").write_text(TORCH_STUB)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "test_suite.py", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_hung_test_fails_by_its_limit_slow_tests_get_theirs_opt_in_runs_only_when_named(tmp_path):
    # limits: 1 s, slow tests 10 s, backstops 0.5 s later; the slow test sleeps 2 s: past the fast limit
    # and its backstop, inside its own
    res = run_suite(tmp_path, "-m", "slow or not slow or vllm", "-k", "not no_signal",
                    timeout=1, slow_timeout=10, timeout_kill_grace=0.5)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    # the quick, slow and named opt-in tests pass (positive controls); the hung one fails by the limit
    assert "1 failed, 3 passed, 1 skipped, 1 deselected" in out, out
    assert "test_hangs" in out and "Failed: Timeout (>1.0s) from pytest-timeout" in out, out
    assert "time.sleep(600)" in out, out  # its stack
    assert "opt-in: runs with -m gpu" in out, out


def test_backstop_ends_a_hang_no_signal_reaches_with_its_stack(tmp_path):
    res = run_suite(tmp_path, "-k", "no_signal", timeout=1, timeout_kill_grace=1)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Timeout (0:00:02)!" in out, out
    assert "in test_hangs_where_no_signal_lands" in out, out
    assert " passed" not in out and " failed" not in out, out  # the run ended there, before any summary
