"""`tsrl prepare-data embedded` on a small slice of the suite: four prepared datasets, checked,
kept apart, and usable by `tsrl env exec` exactly as the agent would use them."""

import json

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.datasets.check import check
from tsrl_cli.datasets.store import EMBEDDED_SETS, open_dataset
from tsrl_cli.embedded.prepare import prepare_embedded
from tsrl_cli.envs.tasks import run_in_task

SMALL = {"repos": ["roman", "money"], "max_per_repo": 3, "n_terminal_train": 6, "n_terminal_heldout": 3}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return root, prepare_embedded(root, seed=0, **SMALL)


@pytest.mark.slow
def test_four_datasets_checked_and_separated(built):
    root, res = built
    for name in EMBEDDED_SETS:
        assert check(str(root / name))["ok"], check(str(root / name))
    train = open_dataset(str(root / "embedded_repair_train")).tasks
    held = open_dataset(str(root / "embedded_repair_heldout")).tasks
    assert {t.upstream_repo for t in train} == {"embedded/roman"}
    assert {t.upstream_repo for t in held} == {"embedded/money"}
    assert res["embedded_repair_train"]["overlaps"]["eval_sets"] == [str(root / "embedded_repair_heldout")]
    assert not list(root.glob(".embedded-stage-*"))  # staging removed


@pytest.mark.slow
def test_rebuild_is_deterministic_and_a_no_op(built):
    root, first = built
    again = prepare_embedded(root, seed=0, **SMALL)
    for name in EMBEDDED_SETS:
        assert again[name]["unchanged"] and again[name]["content_sha256"] == first[name]["content_sha256"]


@pytest.mark.sandboxed
@pytest.mark.slow
def test_env_exec_runs_the_failing_tests(built):
    root, _ = built
    tasks = open_dataset(str(root / "embedded_repair_train")).tasks
    t = tasks[0]
    res, *_ = run_in_task(t.task_id, str(root / "embedded_repair_train"), "python -m pytest -q -p no:cacheprovider", 60)
    assert res.exit_code == 1
    for test in t.fail_to_pass:
        assert f"FAILED {test}" in res.stdout


@pytest.mark.slow
def test_cli_embedded_json(tmp_path, monkeypatch):
    import tsrl_cli.embedded.prepare as ep

    real = ep.prepare_embedded
    monkeypatch.setattr(ep, "prepare_embedded", lambda root, seed, progress, **kw: real(root, seed, progress, **SMALL))
    res = CliRunner().invoke(app, ["prepare-data", "embedded", "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(EMBEDDED_SETS) <= set(doc) and doc["embedded_terminal_train"]["written"] == 6


def test_cli_passes_the_policy_options(tmp_path, monkeypatch):
    """--rebuild-policy and --policy-out reach the library call; the removed --policy-recipe is a usage error."""
    import tsrl_cli.embedded.prepare as ep

    seen = {}
    monkeypatch.setattr(ep, "prepare_embedded", lambda root, seed, progress, **kw: seen.update(kw) or {"seconds": 0})
    res = CliRunner().invoke(app, ["prepare-data", "embedded", "--out", str(tmp_path), "--rebuild-policy",
                                   "--policy-out", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    assert seen["rebuild_policy"] and seen["build_policy"] and seen["policy_out"] == str(tmp_path / "p")
    res = CliRunner().invoke(app, ["prepare-data", "embedded", "--out", str(tmp_path), "--policy-recipe", "copy"])
    assert res.exit_code == 2
