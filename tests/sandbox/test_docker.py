"""The docker executor: same interface as local, in the local base image (tests/conftest.py builds it),
and what a pull that fails says, against a real daemon: a bad name, an image its registry does not
have, a registry that asks for credentials (both a registry stub on this machine) and one that
cannot be reached. tests/sandbox/test_docker_client.py checks the same mapping without a daemon.

Those tests skip, with the reason, where no Docker daemon answers (CI starts one and sets
TSRL_REQUIRE_DOCKER=1: then a failure); whether one answers is asked when each test runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox import Limits, Mount, open_sandbox
from tsrl_cli.sandbox.docker_client import docker_unavailable_reason

IMAGE = "tsrl-no-such-image:never"  # for the checks that fail before any container starts
SMALL = Limits(cpu_time_s=2, memory_bytes=512 << 20, processes=64, file_size_bytes=1 << 20,
               output_bytes=64 << 10, output_kill_bytes=1 << 20)


def test_unavailable_daemon_is_a_usage_error(tmp_path, monkeypatch):
    """No daemon where DOCKER_HOST points, whether or not this machine runs one elsewhere."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/tsrl-test/docker.sock")
    with pytest.raises(UsageError, match="^the docker executor needs Docker: "):
        open_sandbox(tmp_path, executor="docker", image=IMAGE)


@pytest.fixture
def docker_daemon():
    """Whether a daemon answers, asked when the test runs (a daemon may come up during a session)."""
    reason = docker_unavailable_reason()
    if reason:
        if os.environ.get("TSRL_REQUIRE_DOCKER") == "1":
            pytest.fail(f"TSRL_REQUIRE_DOCKER=1 but {reason}")
        pytest.skip(f"docker: {reason}")


class _RegistryStub(BaseHTTPRequestHandler):
    """A registry (Docker Registry HTTP API v2) that has no images, or that wants credentials."""

    wants_credentials = False

    def log_message(self, format, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.wants_credentials:
            code, body, extra = 401, {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}, \
                {"WWW-Authenticate": 'Basic realm="tsrl-test"'}
        elif self.path == "/v2/":
            code, body, extra = 200, {}, {}
        else:
            code, body, extra = 404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}, {}
        data = json.dumps(body).encode()
        self.send_response(code)
        for k, v in {"Content-Type": "application/json", "Docker-Distribution-API-Version": "registry/2.0",
                     "Content-Length": str(len(data)), **extra}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    do_HEAD = do_GET


@contextlib.contextmanager
def registry_stub(wants_credentials: bool):
    """The stub on 127.0.0.1 (a registry the daemon reaches over plain HTTP): its address."""
    handler = type("Stub", (_RegistryStub,), {"wants_credentials": wants_credentials})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case,code,words", [
    ("bad name", 2, ["not an image name", "invalid reference format"]),
    ("not in its registry", 2, ["was not found", "manifest unknown"]),
    ("wants credentials", 1, ["no basic auth credentials", "docker login"]),
    ("registry unreachable", 1, ["connection refused", "cannot be reached"]),
])
def test_a_failed_pull_is_one_line_naming_the_image_and_the_cause(docker_daemon, tmp_path, case, code, words):
    """`tsrl env exec --executor docker --image X` where X cannot be pulled, against the real daemon."""
    with contextlib.ExitStack() as stack:
        image = {"bad name": lambda: "Not A/Valid:Name!",
                 "not in its registry": lambda: f"{stack.enter_context(registry_stub(False))}/tsrl/none:never",
                 "wants credentials": lambda: f"{stack.enter_context(registry_stub(True))}/tsrl/none:never",
                 "registry unreachable": lambda: f"127.0.0.1:{closed_port()}/tsrl/none:never"}[case]()
        res = CliRunner().invoke(app, ["env", "exec", "--workdir", str(tmp_path), "--executor", "docker",
                                       "--image", image, "--", "true"])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == code, res.output
    assert len(lines) == 1 and lines[0].startswith("error:") and image in lines[0], lines
    assert all(w in lines[0] for w in words), lines[0]


def test_docker_needs_an_image(tmp_path):
    with pytest.raises(UsageError, match="image"):
        open_sandbox(tmp_path, executor="docker")


@pytest.mark.slow
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


@pytest.mark.slow
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
