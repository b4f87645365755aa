"""The docker executor: same interface as local. Skipped where no Docker daemon answers.

Set TSRL_DOCKER_TEST_IMAGE to choose the image (it needs bash and coreutils).
"""

from __future__ import annotations

import os

import pytest

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox import Limits, Mount, open_sandbox
from tsrl_cli.sandbox.docker import docker_unavailable_reason

REASON = docker_unavailable_reason()
IMAGE = os.environ.get("TSRL_DOCKER_TEST_IMAGE", "python:3.11-slim")
SMALL = Limits(cpu_time_s=2, memory_bytes=512 << 20, processes=64, file_size_bytes=1 << 20,
               output_bytes=64 << 10, output_kill_bytes=1 << 20)
needs_daemon = pytest.mark.skipif(REASON is not None, reason=f"docker executor: {REASON}")


def test_unavailable_daemon_is_a_usage_error(tmp_path):
    if REASON is None:
        pytest.skip("a Docker daemon is reachable")
    with pytest.raises(UsageError, match="docker executor"):
        open_sandbox(tmp_path, executor="docker", image=IMAGE)


def test_docker_needs_an_image(tmp_path):
    with pytest.raises(UsageError, match="image"):
        open_sandbox(tmp_path, executor="docker")


@needs_daemon
def test_docker_runs_and_limits(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    with open_sandbox(tmp_path, executor="docker", image=IMAGE, limits=SMALL) as sb:
        assert sb.isolation == "docker"
        r = sb.run("cat a.txt; exit 3", 30)
        assert r.stdout == "hello\n" and r.exit_code == 3
        assert sb.run("sleep 60", 1).limit == "wall_clock"
        assert sb.run("while :; do :; done", 20).limit == "cpu_time"
        r = sb.run("head -c 100000000 /dev/zero | tr '\\0' x", 30)
        assert r.limit == "output" and r.truncated
        r = sb.run("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=3)'", 20)
        assert r.exit_code != 0


def test_docker_bad_mounts_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        open_sandbox(tmp_path, executor="docker", image=IMAGE, mounts=[Mount(str(tmp_path / "missing"), "/tests")])
    with pytest.raises(UsageError, match="absolute"):
        open_sandbox(tmp_path, executor="docker", image=IMAGE, mounts=[Mount(str(tmp_path), "tests")])


@needs_daemon
def test_docker_mounts(tmp_path):
    tests, logs, app = tmp_path / "tests", tmp_path / "logs", tmp_path / "app"
    for d in (tests, logs, app):
        d.mkdir()
    (tests / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (app / "a.txt").write_text("app\n")
    verifier = [Mount(str(tests), "/tests"), Mount(str(logs), "/logs/verifier", read_only=False)]
    with open_sandbox(None, executor="docker", image=IMAGE, limits=SMALL, mounts=[Mount(str(app), "/app")]) as sb:
        assert sb.run("cat /app/a.txt; echo x > /app/b.txt", 30).stdout == "app\n"
        assert not (app / "b.txt").exists()  # read-only volume
        assert sb.run("ls /tests", 30).exit_code != 0
        r = sb.run("bash /tests/test.sh", 30, mounts=verifier)
        assert r.exit_code == 0, r
        assert (logs / "reward.txt").read_text() == "1\n"
        assert sb.run("ls /tests /logs/verifier", 30).exit_code != 0  # per-run: gone again
