"""`tsrl eval tbench --via-harbor --harbor-in-docker` for real: the `harbor` CLI (Python >= 3.12, which
this machine's Python 3.11 cannot run) in a Debian trixie image built here, driving this machine's
Docker daemon. Harbor's own oracle agent scores 1 and its nop agent 0 on a Harbor task, scored by
harbor itself (its result.json). Opt-in (`pytest -m harbor`): the image pip-installs harbor from PyPI
(about 3 minutes cold). Needs a Docker daemon (tests/conftest.py).

The task is the fixture write-greeting with two changes the test makes, not tsrl: its FROM is the
local base image (nothing can be pulled here, and harbor builds the Dockerfile as written), and it
allows the network, because harbor's docker environment enforces `allow_internet = false` with an
egress-control sidecar whose images it pulls."""

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app

pytestmark = pytest.mark.harbor


@pytest.fixture(scope="module")
def harbor_ds(tmp_path_factory, prepare_fixture, docker_base_image):
    src = tmp_path_factory.mktemp("src")
    task = src / "write-greeting"
    shutil.copytree("tests/fixtures/harbor_local/write-greeting", task)
    df = task / "environment" / "Dockerfile"
    df.write_text(re.sub(r"(?m)^FROM .*$", f"FROM {docker_base_image}", df.read_text()))
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("allow_internet = false", "allow_internet = true"))
    return prepare_fixture("terminal-bench", src, tmp_path_factory.mktemp("ds") / "harbor_local")


def _run(ds, out, agent):
    res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(ds), "--via-harbor", "--harbor-in-docker",
                                   "--harbor-agent", agent, "--workers", "1", "--out", str(out), "--json"])
    return res


def test_harbor_oracle_one_nop_zero(harbor_ds, tmp_path):
    res = _run(harbor_ds, tmp_path / "oracle", "oracle")
    assert res.exit_code == 0, res.output[-3000:]
    doc = json.loads(res.stdout)
    assert doc["command"][:2] == ["docker", "run"] and "harbor" in doc["command"]
    assert doc["harbor_scores"] == {"oracle__tasks": {"trials": 1, "errors": 0, "mean": 1.0}}, doc["harbor_scores"]
    assert "--model" not in doc["command"]  # harbor's control agents call no model
    # the control through harbor's own verifier: nothing done scores 0
    res = _run(harbor_ds, tmp_path / "nop", "nop")
    assert res.exit_code == 0, res.output[-3000:]
    assert json.loads(res.stdout)["harbor_scores"] == {"nop__tasks": {"trials": 1, "errors": 0, "mean": 0.0}}
