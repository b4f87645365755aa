"""`tsrl env list` / `tsrl env exec --task` on a prepared dataset (terminal-bench fixtures)."""

import json

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tb(tmp_path_factory, prepare_fixture):
    out = tmp_path_factory.mktemp("ds") / "tb"
    return prepare_fixture("terminal-bench", "tests/fixtures/terminal_bench", out)


def test_list_tasks_json(tb):
    res = runner.invoke(app, ["env", "list", "--dataset", str(tb), "--json"])
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["num_tasks"] == 3 and doc["tasks"][0]["task_id"] == "csv-to-parquet"
    assert all(t["local_start"] for t in doc["tasks"])


@pytest.mark.sandboxed
def test_exec_in_a_task_sandbox(tb):
    res = runner.invoke(app, ["env", "exec", "--task", "hello-world", "--dataset", str(tb), "--json", "--", "ls"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == 0 and "Dockerfile" in doc["stdout"] and doc["limit"] is None


def test_exec_usage_errors(tb):
    res = runner.invoke(app, ["env", "exec", "--task", "hello-wrld", "--dataset", str(tb), "--", "ls"])
    assert res.exit_code == 2 and "did you mean hello-world" in res.stderr
    res = runner.invoke(app, ["env", "exec", "--task", "hello-world", "--", "ls"])
    assert res.exit_code == 2 and "--dataset" in res.stderr
    res = runner.invoke(app, ["env", "exec", "--", "ls"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["env", "list", "--dataset", "/nonexistent/ds"])
    assert res.exit_code == 2


@pytest.mark.slow
def test_exec_under_docker_builds_the_tasks_image_first(tb, docker_base_image):
    """--executor docker on a task built from its Dockerfile: the image is built (FROM mapped by
    --base-image), then the command runs in it, as in training; without the mapping, the unpullable FROM
    is one line naming --base-image (the control: the build really is the task's)."""
    mapping = f"ubuntu:24.04={docker_base_image}"
    res = runner.invoke(app, ["env", "exec", "--task", "fix-permissions", "--dataset", str(tb), "--executor",
                              "docker", "--base-image", mapping, "--json", "--", "pwd; cat /etc/debian_version"])
    assert res.exit_code == 0, res.output[-2000:]
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == 0 and doc["stdout"].splitlines()[0] == "/app", doc  # the Dockerfile's WORKDIR
    assert doc["executor"] == "docker" and doc["stdout"].splitlines()[1][:2].isdigit()  # the Debian base image
    res = runner.invoke(app, ["env", "exec", "--task", "fix-permissions", "--dataset", str(tb), "--executor",
                              "docker", "--", "true"])
    assert res.exit_code == 1 and "--base-image ubuntu:24.04=LOCAL_IMAGE" in res.stderr, res.output[-2000:]
    res = runner.invoke(app, ["env", "exec", "--task", "hello-world", "--dataset", str(tb), "--base-image", mapping,
                              "--", "true"])
    assert res.exit_code == 2 and "only the docker executor builds images" in res.stderr
