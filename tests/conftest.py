"""Shared fixtures: tiny models built locally from a config (no hub), one torch thread."""

import functools
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # measured here: extra OpenMP threads beside a busy process run far slower


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
