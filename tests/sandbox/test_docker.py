"""The docker executor: same interface as local, in the local base image (tests/conftest.py builds it).

Skipped, with the reason, where no Docker daemon answers (CI starts one and sets TSRL_REQUIRE_DOCKER=1).
"""

from __future__ import annotations

import os

import pytest

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox import Limits, Mount, open_sandbox
from tsrl_cli.sandbox.docker import docker_unavailable_reason

REASON = docker_unavailable_reason()
IMAGE = "tsrl-no-such-image:never"  # for the checks that fail before any container starts
SMALL = Limits(cpu_time_s=2, memory_bytes=512 << 20, processes=64, file_size_bytes=1 << 20,
               output_bytes=64 << 10, output_kill_bytes=1 << 20)


def test_unavailable_daemon_is_a_usage_error(tmp_path):
    if REASON is None:
        pytest.skip("a Docker daemon is reachable")
    with pytest.raises(UsageError, match="docker executor"):
        open_sandbox(tmp_path, executor="docker", image=IMAGE)


def test_docker_needs_an_image(tmp_path):
    with pytest.raises(UsageError, match="image"):
        open_sandbox(tmp_path, executor="docker")


def test_docker_runs_and_limits(tmp_path, docker_base_image):
    (tmp_path / "a.txt").write_text("hello\n")
    with open_sandbox(tmp_path, executor="docker", image=docker_base_image, limits=SMALL) as sb:
        assert sb.isolation == "docker"
        r = sb.run("cat a.txt; exit 3", 30)
        assert r.stdout == "hello\n" and r.exit_code == 3
        assert sb.run("sleep 60", 1).limit == "wall_clock"
        assert sb.run("while :; do :; done", 20).limit == "cpu_time"
        r = sb.run("head -c 100000000 /dev/zero | tr '\\0' x", 30)
        assert r.limit == "output" and r.truncated
        r = sb.run("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=3)'", 20)
        assert r.exit_code != 0 and "Network is unreachable" in r.stderr, r  # no network, not a slow one
        assert sb.run("python3 -c 'print(6 * 7)'", 20).stdout == "42\n"  # the control: python itself runs


def test_docker_bad_mounts_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        open_sandbox(tmp_path, executor="docker", image=IMAGE, mounts=[Mount(str(tmp_path / "missing"), "/tests")])
    with pytest.raises(UsageError, match="absolute"):
        open_sandbox(tmp_path, executor="docker", image=IMAGE, mounts=[Mount(str(tmp_path), "tests")])


def test_docker_mounts(tmp_path, docker_base_image):
    tests, logs, app = tmp_path / "tests", tmp_path / "logs", tmp_path / "app"
    for d in (tests, logs, app):
        d.mkdir()
    (tests / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (app / "a.txt").write_text("app\n")
    verifier = [Mount(str(tests), "/tests"), Mount(str(logs), "/logs/verifier", read_only=False)]
    with open_sandbox(None, executor="docker", image=docker_base_image, limits=SMALL,
                      mounts=[Mount(str(app), "/app")]) as sb:
        assert sb.run("cat /app/a.txt; echo x > /app/b.txt", 30).stdout == "app\n"
        assert not (app / "b.txt").exists()  # read-only volume
        assert sb.run("ls /tests", 30).exit_code != 0
        r = sb.run("bash /tests/test.sh", 30, mounts=verifier)
        assert r.exit_code == 0, r
        assert (logs / "reward.txt").read_text() == "1\n"
        assert sb.run("ls /tests /logs/verifier", 30).exit_code != 0  # per-run: gone again
