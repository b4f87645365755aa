"""`tsrl eval tbench --executor docker` for real: task images built from the tasks' Dockerfiles (FROM
mapped to the local base image), Harbor's oracle and nop agents scored through tests/test.sh and
/logs/verifier/reward.txt, the same reward path as training. Needs a Docker daemon (tests/conftest.py)."""

import json

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import parse_base_images
from tsrl_cli.envs.images import build_context
from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox.images import map_from_lines, task_image_tag

# a Harbor task with environment/Dockerfile (FROM ubuntu:24.04). The fixture's TB 1.x task pip-installs at
# test time and its prebuilt-image task names a registry image: neither can run without a network.
TASKS = "fix-permissions"


@pytest.fixture(scope="module")
def tbds(tmp_path_factory, prepare_fixture):
    out = tmp_path_factory.mktemp("ds") / "terminal_bench"
    return prepare_fixture("terminal-bench", "tests/fixtures/terminal_bench", out)


def _eval(tbds, base, out, agent):
    res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(tbds), "--executor", "docker", "--agent", agent,
                                   "--instances", TASKS, "--base-image", f"ubuntu:24.04={base}",
                                   "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _remove_task_images(tbds, base):
    import docker

    from tsrl_cli.datasets.store import open_dataset

    client = docker.from_env()
    for t in open_dataset(str(tbds)).tasks:
        for tag in (task_image_tag(t.task_id, t.dir_sha256, {"ubuntu:24.04": base}),):
            try:
                client.images.remove(tag, force=True)
            except docker.errors.ImageNotFound:
                pass
    client.close()


@pytest.mark.slow
def test_oracle_scores_one_nop_zero(tbds, docker_base_image, tmp_path):
    _remove_task_images(tbds, docker_base_image)  # built here, then reused by the nop run
    s = _eval(tbds, docker_base_image, tmp_path / "oracle", "oracle")
    assert (s["all"]["n"], s["all"]["resolved"], s["all"]["success"], s["all"]["errors"]) == (1, 1, 1.0, 0)
    assert s["config"]["base_images"] == {"ubuntu:24.04": docker_base_image}  # recorded, not silent
    assert s["label"].endswith("(not the official Harbor harness) [oracle agent] (FROM mapped to local images)")
    logs = sorted(p.name for p in (tmp_path / "oracle" / "builds").iterdir())
    assert logs == ["fix-permissions.log"]
    # the control: nothing done scores 0 through the same verifier (a verifier that always passes fails here)
    n = _eval(tbds, docker_base_image, tmp_path / "nop", "nop")
    assert not (tmp_path / "nop" / "builds").exists()  # the image was reused, not rebuilt
    assert (n["all"]["n"], n["all"]["resolved"], n["all"]["errors"]) == (1, 0, 0)
    recs = [json.loads(x) for x in (tmp_path / "nop" / "records.jsonl").read_text().splitlines()]
    assert {r["reward"] for r in recs} == {0.0} and {r["exit_reason"] for r in recs} == {"nop"}


@pytest.mark.slow
def test_build_failure_is_one_line_naming_the_log(tbds, docker_base_image, tmp_path):
    _remove_task_images(tbds, docker_base_image)  # tags follow the prepared manifest's sha, not the file
    df = tbds / "tasks" / "fix-permissions" / "environment" / "Dockerfile"
    good = df.read_text()
    df.write_text(good + "RUN exit 7\n")
    try:
        res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(tbds), "--executor", "docker", "--agent",
                                       "oracle", "--instances", "fix-permissions", "--base-image",
                                       f"ubuntu:24.04={docker_base_image}", "--out", str(tmp_path / "o")])
    finally:
        df.write_text(good)
    assert res.exit_code == 1, res.output
    line = res.stderr.strip().splitlines()[-1]
    assert "task fix-permissions: image build failed" in line and str(tmp_path / "o" / "builds") in line
    assert "exit 7" in (tmp_path / "o" / "builds" / "fix-permissions.log").read_text() or "non-zero" in line


def test_from_mapping_and_tags():
    text, used = map_from_lines("FROM --platform=linux/amd64 ubuntu:24.04 AS base\nFROM base\nRUN x\n",
                                {"ubuntu:24.04": "tsrl-base:b"})
    assert text == "FROM --platform=linux/amd64 tsrl-base:b AS base\nFROM base\nRUN x\n"
    assert used == {"ubuntu:24.04": "tsrl-base:b"}
    assert map_from_lines("FROM debian\n", {"ubuntu:24.04": "x"}) == ("FROM debian\n", {})
    assert task_image_tag("Fix_Permissions", "ab" * 32) == "tsrl-task-fix_permissions:" + "ab" * 6
    assert task_image_tag("t", "ab" * 32, {"a": "b"}) != task_image_tag("t", "ab" * 32)
    assert parse_base_images(["a:1=b:2"]) == {"a:1": "b:2"}
    with pytest.raises(UsageError, match="FROM_IMAGE=LOCAL_IMAGE"):
        parse_base_images(["nonsense"])


def test_compose_context(tbds):
    ctx, dockerfile = build_context(tbds / "tasks" / "csv-to-parquet", "csv-to-parquet")
    assert (ctx / dockerfile).is_file()
