"""The one Docker client opener and its pull errors (tsrl_cli/sandbox/docker_client.py), without a daemon.

The errors are the Docker SDK's own classes, built by the SDK's own mapping from an HTTP answer
(docker.errors.create_api_error_from_http_exception) with the texts dockerd 20.10 sends, so the
mapping is checked against what a real pull raises; tests/sandbox/test_docker.py does the same
against a real daemon where one runs.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

docker = pytest.importorskip("docker", reason="the docker package is not installed (pip install 'tsrl[docker]')")
import requests  # the docker SDK's own dependency

from tsrl_cli.cli import app
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.sandbox import docker as docker_sandbox
from tsrl_cli.sandbox.docker_client import (
    docker_client,
    docker_unavailable_reason,
    ensure_image,
    pull_error,
)

IMAGE = "tsrl-no-such-image:never"
NO_DAEMON = "unix:///nonexistent/tsrl-test/docker.sock"  # a socket no daemon can be listening on


def api_error(status: int, message: str) -> docker.errors.APIError:
    """The exception the SDK raises for this HTTP answer of the daemon (its class chosen by the SDK)."""
    resp = requests.Response()
    resp.status_code, resp.reason = status, "error"
    resp.url = "http+docker://localhost/v1.41/images/create?tag=never&fromImage=tsrl-no-such-image"
    resp._content = json.dumps({"message": message}).encode()
    try:
        docker.errors.create_api_error_from_http_exception(requests.exceptions.HTTPError(response=resp))
    except docker.errors.APIError as e:
        return e
    raise AssertionError("the SDK raised nothing")


# what dockerd answers a pull, by case
NOT_IN_REGISTRY = api_error(404, "pull access denied for tsrl-no-such-image, repository does not exist or may "
                                 "require 'docker login': denied: requested access to the resource is denied")
NO_SUCH_TAG = api_error(404, "manifest for alpine:never not found: manifest unknown: manifest unknown")
NO_SUCH_TAG_500 = api_error(500, "manifest unknown")  # dockerd 20.10, a registry of its own without that tag
UNREACHABLE = api_error(500, 'Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io on '
                             "10.0.0.2:53: no such host")
NO_CREDENTIALS = api_error(500, 'Head "https://registry.example.com/v2/team/x/manifests/1": no basic auth credentials')
UNAUTHORIZED = api_error(401, "unauthorized: authentication required")
BAD_REFERENCE = api_error(400, "invalid reference format: repository name must be lowercase")


class FakeClient:
    """images.get / api.pull / close as the SDK's DockerClient has them; `pull` is what the pull does:
    an exception to raise, or the decoded progress items to stream (then the image is there, unless
    an item is an error)."""

    def __init__(self, pull=(), have=()):
        self.have, self.outcome, self.pulls, self.closed = set(have), pull, [], False
        self.images, self.api = self, self

    def get(self, image):
        repository, tag = docker.utils.parse_repository_tag(image)
        if f"{repository}:{tag or 'latest'}" not in self.have:  # the daemon reads a bare name as NAME:latest
            raise api_error(404, f"No such image: {image}")
        return image

    def pull(self, repository, tag=None, stream=False, decode=False):
        assert stream and decode
        self.pulls.append((repository, tag))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        items = list(self.outcome)
        if not any("error" in i for i in items):
            self.have.add(f"{repository}:{tag}")
        return iter(items)

    def close(self):
        self.closed = True


def test_the_sdk_builds_the_classes_the_mapping_expects():
    assert type(NOT_IN_REGISTRY) is docker.errors.ImageNotFound and type(NO_SUCH_TAG) is docker.errors.NotFound
    assert type(UNREACHABLE) is docker.errors.APIError and UNREACHABLE.status_code == 500


@pytest.mark.parametrize("error,kind,words", [
    (NOT_IN_REGISTRY, UsageError, ["was not found", "repository does not exist", "docker login"]),
    (NO_SUCH_TAG, UsageError, ["was not found", "manifest unknown"]),
    (NO_SUCH_TAG_500, UsageError, ["was not found", "manifest unknown"]),
    (BAD_REFERENCE, UsageError, ["not an image name", "must be lowercase"]),
    (docker.errors.InvalidRepository("Repository name cannot contain a scheme (http://x)"), UsageError,
     ["not an image name", "scheme"]),
    (UNREACHABLE, OperationFailed, ["pulling image", "no such host", "HTTP 500", "cannot be reached", "docker load"]),
    (NO_CREDENTIALS, OperationFailed, ["no basic auth credentials", "docker login"]),
    (UNAUTHORIZED, OperationFailed, ["authentication required", "HTTP 401", "docker login"]),
    (requests.exceptions.ConnectionError("Connection aborted."), OperationFailed, ["stopped answering"]),
    (RuntimeError("something else"), OperationFailed, ["RuntimeError: something else"]),
], ids=["not-in-registry", "no-such-tag", "no-such-tag-500", "bad-reference", "scheme-in-name", "unreachable",
        "no-credentials", "unauthorized", "daemon-gone", "other"])
def test_a_failed_pull_is_one_line_naming_the_image_and_the_cause(error, kind, words):
    client = FakeClient(pull=error)
    with pytest.raises(kind) as e:
        ensure_image(client, IMAGE)
    msg = str(e.value)
    assert type(e.value) is kind and "\n" not in msg and IMAGE in msg, msg
    assert all(w in msg for w in words), msg
    assert client.pulls == [("tsrl-no-such-image", "never")]
    assert pull_error(IMAGE, error).args == e.value.args  # the same mapping, called directly


def test_an_error_inside_the_pull_stream_is_raised():
    """The SDK's images.pull() skips {"error": ...} items of the progress stream; ensure_image does not."""
    client = FakeClient(pull=[{"status": "Pulling from library/x"}, {"error": "unauthorized: authentication required",
                                                                     "errorDetail": {"message": "unauthorized"}}])
    with pytest.raises(OperationFailed,
                       match=r"pulling image tsrl-no-such-image:never failed: unauthorized.*docker login"):
        ensure_image(client, IMAGE)


def test_a_present_image_is_not_pulled_and_a_missing_one_is():
    client = FakeClient(have=[IMAGE])
    ensure_image(client, IMAGE)
    assert client.pulls == []
    client = FakeClient(pull=[{"status": "Downloaded newer image"}])
    ensure_image(client, "alpine")
    assert client.pulls == [("alpine", "latest")] and "alpine:latest" in client.have


def test_a_lookup_of_a_bad_name_is_a_usage_error():
    class BadName(FakeClient):
        def get(self, image):
            raise BAD_REFERENCE

    with pytest.raises(UsageError, match="not an image name"):
        ensure_image(BadName(), "Not/A Name")


def test_no_daemon_is_a_usage_error_checked_at_the_call(monkeypatch):
    """DOCKER_HOST names a socket where nothing listens: every opener says so, read when called."""
    monkeypatch.setenv("DOCKER_HOST", NO_DAEMON)
    reason = docker_unavailable_reason()
    assert reason is not None and reason.startswith("no Docker daemon reachable") and "\n" not in reason
    with pytest.raises(UsageError, match="^the docker executor needs Docker: no Docker daemon reachable"):
        docker_client(60, "the docker executor")


@pytest.mark.parametrize("error,code", [(NOT_IN_REGISTRY, 2), (BAD_REFERENCE, 2), (UNREACHABLE, 1), (UNAUTHORIZED, 1)],
                         ids=["not-in-registry", "bad-reference", "unreachable", "unauthorized"])
def test_tsrl_env_exec_exits_2_for_a_bad_name_and_1_for_a_failed_pull(monkeypatch, tmp_path, error, code):
    client = FakeClient(pull=error)
    monkeypatch.setattr(docker_sandbox, "docker_client", lambda timeout_s, what: client)
    res = CliRunner().invoke(app, ["env", "exec", "--workdir", str(tmp_path), "--executor", "docker", "--image",
                                   IMAGE, "--", "true"])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == code, res.output
    assert lines[0].startswith("error:") and IMAGE in lines[0] and "Traceback" not in res.output, lines
    assert client.closed  # the sandbox that did not start closed its client
