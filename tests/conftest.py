"""Shared fixtures: tiny models built locally from a config (no hub), one torch thread; the test tiers (fast by
default, `-m slow`, opt-in markers) and a time limit on every test."""

import faulthandler
import functools
import os
import re
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # measured here: extra OpenMP threads beside a busy process run far slower

# Markers for what a plain CPU machine lacks (CUDA, the vllm package, the harbor CLI in its image): their tests
# run only when `-m` names the marker, so `pytest -m vllm` selects and runs them and no other run does.
OPT_IN = ("gpu", "vllm", "harbor")


def pytest_addoption(parser):
    parser.addini("slow_timeout", "time limit in seconds for slow and opt-in tests (`timeout`: the others')",
                  default="600")
    parser.addini("timeout_kill_grace", "seconds past a test's time limit before the whole run is ended", default="30")


def pytest_collection_modifyitems(config, items):
    """Skip opt-in tests that `-m` does not name. Slow and opt-in tests (an engine or image to start), and tests
    of the Docker base image (built on first use, minutes cold), get `slow_timeout` unless they set their own."""
    named = set(re.findall(r"\w+", config.option.markexpr or ""))
    slow_timeout = float(config.getini("slow_timeout"))
    for item in items:
        opt_in = [m for m in OPT_IN if item.get_closest_marker(m) is not None]
        for marker in opt_in:
            if marker not in named:
                item.add_marker(pytest.mark.skip(reason=f"opt-in: runs with -m {marker}"))
        heavy = opt_in or item.get_closest_marker("slow") is not None or "docker_base_image" in item.fixturenames
        if heavy and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(slow_timeout))


# Time limits: pytest-timeout's signal method (SIGALRM in this process) fails a test past its limit with the
# stack of every thread, and the run goes on: the test's `with` blocks and fixtures unwind, which terminate the
# subprocesses and worker pools it started (subprocess.run kills its child on any exception). The thread method
# would instead end the whole run at the first hang, skipping every later test and orphaning those children.
# A signal only lands while this process runs Python code; a hang inside C code that never returns (or with
# SIGALRM blocked) is caught by a backstop: faulthandler's own watchdog thread needs neither, and dumps every
# thread's stack then exits the run `timeout_kill_grace` seconds after the limit (children it started are left
# to the CI job's end). Debugger sessions (--pdb, --trace) have no backstop.
def pytest_configure(config):
    # the terminal's stderr, copied before any test runs: fd 2 itself is captured during a test, and the
    # backstop's dump must reach the terminal after the process is gone
    config.stash[_BACKSTOP_FD] = os.dup(2)


def pytest_unconfigure(config):
    os.close(config.stash[_BACKSTOP_FD])


_BACKSTOP_FD = pytest.StashKey[int]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # the limit pytest-timeout applies: the test's marker, else --timeout, else the ini's `timeout`
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        limit = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    elif item.config.getoption("timeout", None) is not None:
        limit = item.config.getoption("timeout")
    else:
        limit = item.config.getini("timeout")
    limit = float(limit or 0)
    debugging = item.config.getoption("usepdb", False) or item.config.getoption("trace", False)
    if limit > 0 and not debugging:
        grace = float(item.config.getini("timeout_kill_grace"))
        faulthandler.dump_traceback_later(limit + grace, exit=True, file=item.config.stash[_BACKSTOP_FD])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_runtest_setup(item):
    """`@pytest.mark.sandboxed`: skip where the sandbox itself would refuse (its own choice and reason)."""
    if item.get_closest_marker("sandboxed") is not None:
        reason = _no_isolation()
        if reason:
            pytest.skip(f"sandbox: {reason}")


@functools.cache
def _no_isolation() -> str:
    """The sandbox's reason for refusing, '' where bwrap or unshare works."""
    from tsrl_cli.sandbox.local import IsolationError, choose_isolation

    try:
        choose_isolation("auto")
        return ""
    except IsolationError as e:
        return str(e)


@pytest.fixture(scope="session")
def docker_base_image():
    """The local base image's tag (tsrl_cli/sandbox/images.py), built on first use (about a minute cold).

    Skips, with the reason, where no Docker daemon answers; with TSRL_REQUIRE_DOCKER=1 (CI, which
    starts a daemon) that is a failure instead, so the Docker tests cannot pass by being skipped.
    """
    import os

    from tsrl_cli.sandbox.docker_client import docker_unavailable_reason

    reason = docker_unavailable_reason()
    if reason:
        if os.environ.get("TSRL_REQUIRE_DOCKER") == "1":
            pytest.fail(f"TSRL_REQUIRE_DOCKER=1 but {reason}")
        pytest.skip(f"docker: {reason}")
    from tsrl_cli.sandbox.images import ensure_base_image

    return ensure_base_image()


@pytest.fixture(scope="session")
def tiny64():
    from tsrl_cli.policy import build_tiny_model

    return build_tiny_model(seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def teacher64():
    from tsrl_cli.policy import build_tiny_model

    return build_tiny_model(seed=1000, dtype=torch.float64)


# a ChatML tokenizer for agent-loop, environment and engine tests (folders with their own `tok` override it)
CORPUS = [
    "THOUGHT: look at the files\n```bash\nls -la\n```",
    "THOUGHT: fix the bug\n```bash\nsed -i 's/a - b/a + b/' calc.py\n```",
    "```bash\nsubmit\n```",
    "def add(a, b):\n    return a + b\n",
    "[exit code 0]\ncalc.py\ntest_calc.py\n",
    "You are an agent working in a shell. Each reply: a short THOUGHT, then exactly one bash block.",
]


@pytest.fixture(scope="session")
def tok():
    from tsrl_cli.tokenizer import train_chatml_tokenizer

    return train_chatml_tokenizer(CORPUS * 10, vocab_size=320)


@pytest.fixture(scope="session")
def prepare_fixture():
    """prepare_fixture(SOURCE, ORIGIN, OUT): `tsrl prepare-data SOURCE --from ORIGIN --out OUT` through the
    CLI, as a user would run it; returns OUT."""
    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    def run(source: str, origin, out):
        res = CliRunner().invoke(app, ["prepare-data", source, "--from", str(origin), "--out", str(out), "--json"])
        assert res.exit_code == 0, res.output
        return out

    return run


@pytest.fixture(scope="session")
def tsrl_here():
    """tsrl_here(*ARGS) -> the subprocess.CompletedProcess of `tsrl ARGS`, run in this process (typer's CliRunner).

    For the runs a test does not strike: the uninterrupted reference, the `--resume` after a kill, the same
    sweep again. It is the command's own code path (the CLI's parsing, config, run and --json summary), less
    a new interpreter and, for `tsrl train`, a new forkserver that import torch again: about 10 s a run on 2
    loaded cores. A run that is struck, or whose workers read a hook from the environment (a hold, a broken
    fold), stays a subprocess: workers fork from this process's forkserver, which keeps the environment it
    started with. An exception the command did not turn into an exit code is appended to stderr.
    """
    import subprocess
    import traceback

    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    def run(*args) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        res = CliRunner().invoke(app, argv)
        err = res.stderr
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            err += "".join(traceback.format_exception(res.exception))
        return subprocess.CompletedProcess(["tsrl", *argv], res.exit_code, res.stdout, err)

    return run


@pytest.fixture
def fixtures() -> Path:
    """tests/fixtures: small inputs in each source's real format, no hub access."""
    return Path(__file__).resolve().parent / "fixtures"
