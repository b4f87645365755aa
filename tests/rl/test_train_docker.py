"""`tsrl train` with rollout.executor docker on Harbor-format tasks (the SETA-Env fixture): task images
built from their Dockerfiles before round 1 (FROM mapped to the local base image), every reward
from the task's own tests/test.sh in its container. The oracle (rollout.agent oracle: each task's
solution/solve.sh written as the model's turn) must get reward 1 on every trajectory; the toy policy,
through the same path, gets 0 (a verifier that always passes fails here). Needs a Docker daemon
(tests/conftest.py: skipped with the reason, or a failure under TSRL_REQUIRE_DOCKER=1)."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from tsrl_cli.cli import app

BOGUS_DOCKER = "unix:///nonexistent/tsrl-test-docker.sock"


@pytest.fixture(scope="module")
def seta(tmp_path_factory, prepare_fixture):
    return prepare_fixture("seta-env", "tests/fixtures/seta_env", tmp_path_factory.mktemp("ds") / "seta")


def rows(run_dir, name="metrics.jsonl"):
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def base_args(seta, out, *extra):
    # 3 tasks (the fixture's 4 folders, one a duplicate instruction) x 2 samples per round
    return ["train", "--set", "model.policy=builtin:toy", "--set", f"data.train=[{seta}]",
            "--set", "rollout.executor=docker", "--set", "rollout.prompts_per_round=3", "--set", "rollout.group_size=2",
            "--set", "rollout.max_turns=3", "--set", "rollout.max_turn_tokens=512", "--out", str(out), *extra]


@pytest.mark.slow
def test_oracle_gets_reward_one_on_every_task_and_the_policy_zero(seta, docker_base_image, tmp_path):
    mapping = f"ubuntu:24.04={docker_base_image}"
    res = CliRunner().invoke(app, [*base_args(seta, tmp_path / "oracle", "--rounds", "2", "--base-image", mapping,
                                              "--set", "rollout.agent=oracle", "--save-rollouts"), "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    built = f"docker: docker.base_images: FROM ubuntu:24.04 is built from the local image {docker_base_image}"
    assert built in res.stderr
    m = rows(tmp_path / "oracle")
    assert [r["round"] for r in m] == [1, 2]
    for r in m:
        assert (r["reward_mean"], r["trajectories"], r["env_errors"]) == (1.0, 6, 0), r
        assert r["exit_reasons"] == {"submitted": 6}, r
    cfg = yaml.safe_load((tmp_path / "oracle" / "config.yaml").read_text())
    assert cfg["docker"]["base_images"] == [mapping] and cfg["rollout"]["agent"] == "oracle"  # recorded, not silent
    assert len({r["group_id"] for r in rows(tmp_path / "oracle", "rollouts.jsonl")}) == 3  # every task, each round
    # the control: the toy policy through the same images, sandbox and verifiers scores 0, with no env_error
    res = CliRunner().invoke(app, [*base_args(seta, tmp_path / "policy", "--rounds", "1", "--base-image", mapping),
                                   "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    p = rows(tmp_path / "policy")[0]
    assert (p["reward_mean"], p["env_errors"]) == (0.0, 0) and "env_error" not in p["exit_reasons"], p


@pytest.mark.slow
def test_unpullable_from_image_is_one_line_naming_the_way_out(seta, docker_base_image, tmp_path):
    """The command a new user types first, on a machine that cannot pull: exit 1 before any round, one
    line naming the task, the FROM image, --base-image and the build log."""
    res = CliRunner().invoke(app, [*base_args(seta, tmp_path / "r", "--rounds", "1")])
    assert res.exit_code == 1, res.output[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "image build failed" in line and "ubuntu:24.04 is not here and cannot be pulled" in line, line
    assert "--base-image ubuntu:24.04=LOCAL_IMAGE" in line and str(tmp_path / "r" / "builds") in line
    assert not (tmp_path / "r" / "metrics.jsonl").is_file()


def test_no_daemon_is_exit_2_before_anything_runs(seta, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", BOGUS_DOCKER)
    res = CliRunner().invoke(app, [*base_args(seta, tmp_path / "r", "--rounds", "1")])
    assert res.exit_code == 2, res.output[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith("error: rollout.executor docker: ")


def test_oracle_needs_solutions_and_room_in_a_turn(seta, tmp_path, monkeypatch):
    """Checked before any process starts: the echo tasks have no solution; a turn limit below the
    solution's length names the length to set."""
    res = CliRunner().invoke(app, ["train", "--set", "model.policy=builtin:toy", "--set", "data.train=[builtin:echo]",
                                   "--set", "rollout.agent=oracle", "--rounds", "1", "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "has no reference solution to play" in res.stderr, res.output[-2000:]
    res = CliRunner().invoke(app, ["train", "--set", "model.policy=builtin:toy", "--set", f"data.train=[{seta}]",
                                   "--set", "rollout.agent=oracle", "--set", "rollout.max_turn_tokens=8",
                                   "--rounds", "1", "--out", str(tmp_path / "t")])
    assert res.exit_code == 2, res.output[-2000:]
    assert "over rollout.max_turn_tokens 8; raise it (--set rollout.max_turn_tokens=" in res.stderr
    assert ", the longest)" in res.stderr


def test_base_images_only_with_docker_and_well_formed(tmp_path):
    res = CliRunner().invoke(app, ["train", "--base-image", "ubuntu:24.04=x", "--rounds", "1"])
    assert res.exit_code == 2 and "config key docker.base_images: set, but rollout.executor is local" in res.stderr
    res = CliRunner().invoke(app, ["train", "--set", "rollout.executor=docker", "--base-image", "nonsense"])
    assert res.exit_code == 2 and "expected FROM_IMAGE=LOCAL_IMAGE" in res.stderr


@pytest.mark.slow
def test_env_base_image_prints_the_tag(docker_base_image, monkeypatch):
    res = CliRunner().invoke(app, ["env", "base-image", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout) == {"image": docker_base_image}, res.output
    monkeypatch.setenv("DOCKER_HOST", BOGUS_DOCKER)
    res = CliRunner().invoke(app, ["env", "base-image"])
    assert res.exit_code == 2 and "no Docker daemon reachable" in res.stderr, res.output
