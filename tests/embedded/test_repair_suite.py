"""The embedded repair suite: clean repositories pass, every built task fails as recorded and its gold
patch fixes it, builds are deterministic, and held-out repositories never appear in training."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tsrl_cli.agent.rewards import parse_pytest_log, repair_reward
from tsrl_cli.datasets.records import RepairTask, records_sha256
from tsrl_cli.embedded.repair_suite import (
    KINDS,
    SRC_DIR,
    build_repair_suite,
    list_mutations,
    repo_names,
    run_tests,
    source_files,
    unified_diff,
)
from tsrl_cli.envs.repair import test_files as verifier_test_files

REPOS = ["roman", "money"]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _build(out: Path) -> dict:
    return build_repair_suite(out, seed=0, repos=REPOS, heldout=("money",), max_per_repo=2, max_per_function=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    return out, _build(out)


def _tasks(suite):
    return suite["train"] + suite["heldout"]


@pytest.mark.slow
def test_clean_repositories_pass():
    names = repo_names()
    assert len(names) >= 8
    for name in names:
        ran = run_tests(SRC_DIR / name)
        assert ran is not None, f"{name}: suite timed out"
        status, _ = ran
        assert 15 <= len(status) <= 40, f"{name}: {len(status)} tests"
        assert set(status.values()) == {"PASSED"}, name


def test_mutations_are_one_line_and_deterministic():
    src = (SRC_DIR / "roman" / "roman.py").read_text()
    a, b = list_mutations(src, "roman.py"), list_mutations(src, "roman.py")
    assert a == b and len(a) > 20
    for m in a:
        diff = unified_diff(src, src.replace(m.old_line + "\n", m.new_line + "\n", 1), "roman.py")
        changed = [ln for ln in diff.splitlines()[3:] if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
        assert len(changed) == 2, m


@pytest.mark.slow
def test_same_seed_same_tasks(built, tmp_path):
    _, first = built
    second = _build(tmp_path)
    assert records_sha256(_tasks(first)) == records_sha256(_tasks(second))


def test_records_are_valid(built):
    _, suite = built
    assert suite["train"] and suite["heldout"]
    names = {f.name for f in dataclasses.fields(RepairTask)}
    for split, tasks in suite.items():
        for t in tasks:
            assert isinstance(t, RepairTask) and set(dataclasses.asdict(t)) == names
            assert t.split == split and t.source == "embedded" and t.language == "python"
            assert t.task_id.startswith(f"embedded__{t.repo.split('/')[1]}__")
            assert t.start_dir == f"repair/{t.task_id}" and t.fail_to_pass and t.problem_statement
            assert not set(t.fail_to_pass) & set(t.pass_to_pass)
            assert t.meta["mutation"] in KINDS and t.meta["mutation"] in t.task_id
            assert t.meta["file"] in source_files(SRC_DIR / t.repo.split("/")[1])
    assert len({t.task_id for t in _tasks(suite)}) == len(_tasks(suite))


def test_split_shares_no_repository(built):
    _, suite = built
    assert {t.repo for t in suite["train"]}.isdisjoint({t.repo for t in suite["heldout"]})


def test_patches_change_one_line(built):
    _, suite = built
    for t in _tasks(suite):
        for patch in (t.bug_patch, t.gold_patch):
            body = patch.splitlines()[3:]
            assert sum(ln.startswith("-") for ln in body) == 1 and sum(ln.startswith("+") for ln in body) == 1


def _run(repo: Path, task) -> dict:
    # the verifier's command (envs/repair.py): only the test files the task names
    cmd = [sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider",
           *verifier_test_files(task.fail_to_pass + task.pass_to_pass)]
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run(cmd, check=False, cwd=repo, capture_output=True, text=True, timeout=60, env=env)
    return parse_pytest_log(out.stdout)


@needs_git
@pytest.mark.slow
def test_start_state_fails_and_gold_patch_fixes(built, tmp_path):
    out, suite = built
    for t in _tasks(suite):
        start = out / t.start_dir
        status = _run(start, t)
        assert all(status.get(x) != "PASSED" for x in t.fail_to_pass), t.task_id
        assert all(status.get(x) == "PASSED" for x in t.pass_to_pass), t.task_id
        assert repair_reward(status, t.fail_to_pass, t.pass_to_pass).reward == 0.0

        fixed = tmp_path / t.task_id
        shutil.copytree(start, fixed)
        subprocess.run(["git", "apply", "-"], cwd=fixed, input=t.gold_patch, text=True, check=True)
        assert (fixed / t.meta["file"]).read_text() == (SRC_DIR / t.repo.split("/")[1] / t.meta["file"]).read_text()
        assert repair_reward(_run(fixed, t), t.fail_to_pass, t.pass_to_pass).reward == 1.0, t.task_id


def test_test_budget_is_cpu_time_not_wall_time(tmp_path):
    """A spinning mutant is cut by its CPU budget; a slow-but-idle suite (sleeping 2 s, as a loaded
    machine would make it wait) still completes: which bugs are kept must not depend on the load."""
    import time

    (tmp_path / "test_spin.py").write_text("def test_spin():\n    while True:\n        pass\n")
    t0 = time.monotonic()
    assert run_tests(tmp_path, timeout_s=1) is None
    assert time.monotonic() - t0 < 20
    (tmp_path / "test_spin.py").unlink()
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(2)\n")
    status, _ = run_tests(tmp_path, timeout_s=1)
    assert status == {"test_slow.py::test_slow": "PASSED"}
