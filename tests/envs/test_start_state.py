"""A SWE-smith task's start state with the local executor, from a real-format row (the columns of
`SWE-bench/SWE-smith`, normalized by tsrl_cli/datasets/swe_smith.py) and a small git repository
built here the way SWE-smith's mirrors are: `main` holds the clean code; the instance branch has
"Bug Patch" (the row's `patch`) and then "Remove F2P Tests".

Paths: the branch when the repository has it; else the bug patch applied to the clean checkout; neither
is an env_error naming the task. Then the FAIL_TO_PASS tests run once: a task where they already pass is
refused. Every refusal has its control: the same repository with the real bug starts, and its tests fail.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tsrl_cli.datasets.swe_smith import normalize
from tsrl_cli.envs.repair import RepairEnv
from tsrl_cli.envs.start_state import StartStateError, start_script

pytestmark = pytest.mark.sandboxed

IID = "tsrl__calc.0a1b2c3d.func_pm_op_swap__k2"
CLEAN = "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n"
BUG = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -4,3 +4,3 @@ def add(a, b):\n \n"
       " def subtract(a, b):\n-    return a - b\n+    return a + b\n")
# a "bug" that breaks nothing the tests check: its FAIL_TO_PASS tests pass at the start
HARMLESS = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,3 +1,3 @@\n"
            " def add(a, b):\n-    return a + b\n+    return b + a\n \n")
ROW = {  # the dataset's columns, as `datasets` yields them
    "instance_id": IID, "repo": "swesmith/tsrl__calc.0a1b2c3d", "patch": BUG,
    "FAIL_TO_PASS": ["tests/test_subtract.py::test_subtract"], "PASS_TO_PASS": ["tests/test_add.py::test_add"],
    "image_name": "swebench/swesmith.x86_64.tsrl_1776_calc.0a1b2c3d", "problem_statement": "subtract adds.",
    "created_at": "2025-04-01T00:00:00",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def make_repo(root: Path, *, branch: bool) -> Path:
    """A clean checkout on main; with branch=True also the instance branch as SWE-smith's mirror has it."""
    repo = root / ("with_branch" if branch else "clean")
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CLEAN)
    (repo / "tests" / "test_add.py").write_text(
        "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (repo / "tests" / "test_subtract.py").write_text(
        "from calc import subtract\n\n\ndef test_subtract():\n    assert subtract(5, 3) == 2\n")
    (repo / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Initial commit")
    if branch:
        git(repo, "checkout", "-q", "-b", IID)
        (repo / "calc.py").write_text(CLEAN.replace("return a - b", "return a + b"))
        git(repo, "commit", "-q", "-am", "Bug Patch")
        git(repo, "rm", "-q", "tests/test_subtract.py")
        git(repo, "commit", "-q", "-m", "Remove F2P Tests")
        git(repo, "checkout", "-q", "main")
    return repo


def play(task, repo: Path, commands=(), oracle=False):
    """start -> (gold patch) -> commands -> reward: (env, outputs, reward)."""
    env = RepairEnv(task, repo_dir=repo)

    async def main():
        await env.start()
        try:
            if oracle:
                await env.play_oracle()
            outs = [await env.run(c, 30) for c in commands]
            return outs, await env.reward()
        finally:
            await env.close()

    outs, reward = asyncio.run(main())
    return env, outs, reward


LOOK = ("git log --format=%s; ls tests; grep -c 'return a + b' calc.py; git status --porcelain | wc -l; "
        "git rev-parse HEAD")
# sealed: one commit, the bug in place, the F2P file hidden, a clean tree, at the recorded start commit
SEALED = ["Initial", "commit", "test_add.py", "2", "0"]


def test_the_row_is_a_branch_task_with_its_bug_patch():
    t = normalize(ROW)
    assert (t.ref_kind, t.base_ref, t.bug_patch) == ("branch", IID, BUG)  # `patch` introduces the bug


def test_branch_present_is_checked_out_and_its_tests_fail_at_the_start(tmp_path):
    repo = make_repo(tmp_path, branch=True)
    env, outs, nop = play(normalize(ROW), repo, [LOOK])
    assert env.start_state["path"] == "branch"
    assert outs[0].output.split() == [*SEALED, env.start_state["sha"]]
    assert env.start_state["fail_to_pass_passing"] == 0 and env.start_state["check"] == "FAIL_TO_PASS 0/1"
    assert nop.reward == 0.0 and nop.reason.startswith("FAIL_TO_PASS 0/1") and nop.details["start_state"] == "branch"
    _, _, gold = play(normalize(ROW), repo, oracle=True)  # the hidden tests come back for the verifier
    assert gold.reward == 1.0 and gold.reason == "FAIL_TO_PASS 1/1, PASS_TO_PASS 1/1", gold
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"  # the task's own folder is untouched


def test_branch_absent_gets_the_bug_patch_committed_on_the_clean_checkout(tmp_path):
    repo = make_repo(tmp_path, branch=False)
    env, outs, nop = play(normalize(ROW), repo, [LOOK, "ls .git/tsrl-bug.diff"])
    assert env.start_state["path"] == "bug_patch"
    # the same layout as the branch: the bug committed (not an uncommitted diff `git checkout .` would undo)
    assert outs[0].output.split() == [*SEALED, env.start_state["sha"]]
    assert outs[1].exit_code != 0  # the patch file is not left where the agent works
    assert env.start_state["fail_to_pass_passing"] == 0 and nop.reward == 0.0 and "FAIL_TO_PASS 0/1" in nop.reason
    assert nop.details["start_state"] == "bug_patch"
    _, _, gold = play(normalize(ROW), repo, oracle=True)
    assert gold.reward == 1.0, gold
    # a fix the agent writes pays too (not only the oracle's patch)
    _, _, fixed = play(normalize(ROW), repo, ["sed -i '6s/a + b/a - b/' calc.py"])
    assert fixed.reward == 1.0, fixed
    assert (repo / "calc.py").read_text() == CLEAN and git(repo, "branch", "--list", IID) == ""


def set_up(base: Path, dest: Path, seal: bool = True) -> str:
    """start_script run on a copy of base (as every container of one image has it) -> the start commit it names."""
    shutil.copytree(base, dest, symlinks=True)
    (dest / ".git" / "bug.diff").write_text(BUG)
    res = subprocess.run(["bash", "-c", start_script(normalize(ROW), ".git/bug.diff", seal=seal)], cwd=dest,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (dest / ".git" / "bug.diff").unlink()
    return res.stdout.split()[-1]


def test_the_rebuilt_start_state_is_one_commit(tmp_path):
    """Fixed author and dates: two setups of the same clean checkout give the same commit (what lets the
    docker verifier rebuild the agent's start state in a fresh container); the history the verifier rebuilds
    (seal=False) and the instance branch seal to it too."""
    clean, branch = make_repo(tmp_path, branch=False), make_repo(tmp_path, branch=True)
    shas = []
    for k in range(2):
        shas.append(set_up(clean, tmp_path / str(k)))
        time.sleep(1.1)  # a clock-dated commit would differ now
    assert shas[0] == shas[1] and len(shas[0]) == 40
    assert git(tmp_path / "0", "rev-parse", "HEAD") == shas[0]  # the sealed start is checked out
    for name, base in (("patch_history", clean), ("branch", branch), ("branch_history", branch)):
        assert set_up(base, tmp_path / name, seal="history" not in name) == shas[0], name
    assert git(tmp_path / "branch", "rev-parse", "HEAD") == shas[0]
    history = git(tmp_path / "patch_history", "rev-parse", "HEAD")  # kept for the verifier: not the start commit
    assert history != shas[0] and git(tmp_path / "patch_history", "rev-parse", "HEAD^{tree}") == \
        git(tmp_path / "0", "rev-parse", "HEAD^{tree}")


def test_the_sealed_start_holds_no_object_of_the_fixed_code(tmp_path):
    """After the seal: one commit, one ref, no reflog, no object beyond that commit's own, and a sound
    repository. Control: the history kept (seal=False, as before sealing) holds the clean calc.py."""
    clean_blob = subprocess.run(["git", "hash-object", "--stdin"], input=CLEAN, capture_output=True, text=True,
                                check=True).stdout.strip()
    for branch in (True, False):
        base = make_repo(tmp_path / str(branch), branch=branch)
        git(base, "tag", "v0", "main")
        for seal in (True, False):
            repo = tmp_path / f"{branch}-{seal}"
            set_up(base, repo, seal=seal)
            objects = set(git(repo, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split())
            state = {"commits": git(repo, "rev-list", "--all", "--reflog", "--count"),
                     "refs": git(repo, "for-each-ref", "--format=%(refname)"), "reflog": git(repo, "reflog"),
                     "clean calc.py": clean_blob in objects}
            if seal:
                assert state == {"commits": "1", "refs": f"refs/heads/{IID}", "reflog": "", "clean calc.py": False}
                assert objects == set(git(repo, "rev-list", "--objects", "--no-object-names", "HEAD").split())
                git(repo, "fsck", "--full", "--strict")  # nothing missing: the agent's git works as usual
                assert git(repo, "status", "--porcelain") == ""
            else:
                assert int(state["commits"]) >= 3 and "refs/heads/main" in state["refs"] and state["clean calc.py"]


def test_neither_branch_nor_patch_is_an_env_error_naming_the_task(tmp_path):
    repo = make_repo(tmp_path, branch=False)
    task = replace(normalize(ROW), task_id=IID + ".nopatch", bug_patch=None)
    with pytest.raises(StartStateError) as e:
        play(task, repo)
    msg = str(e.value)
    assert f"task {IID}.nopatch:" in msg and "no branch" in msg and "no bug patch" in msg and "\n" not in msg
    # control: the same folder and task with its bug patch starts
    env, _, _ = play(replace(task, task_id=IID + ".withpatch", bug_patch=BUG), repo)
    assert env.start_state["path"] == "bug_patch"


def test_a_patch_that_does_not_apply_is_an_env_error(tmp_path):
    repo = make_repo(tmp_path, branch=False)
    task = replace(normalize(ROW), task_id=IID + ".stale", bug_patch=BUG.replace("return a - b", "return a * b"))
    with pytest.raises(StartStateError, match=f"task {IID}.stale: .*the bug patch does not apply"):
        play(task, repo)


def test_fail_to_pass_already_passing_is_refused_not_scored(tmp_path):
    repo = make_repo(tmp_path, branch=False)
    task = replace(normalize(ROW), task_id=IID + ".harmless", bug_patch=HARMLESS)
    with pytest.raises(StartStateError) as e:
        play(task, repo)
    assert str(e.value).startswith(f"task {IID}.harmless: FAIL_TO_PASS already pass at the start state (1/1 on "
                                   "bug_patch "), e.value
    with pytest.raises(StartStateError, match="already pass"):  # the verdict is kept: the same refusal again
        play(task, repo)
    # control: the real bug in the same folder starts, with its FAIL_TO_PASS test failing
    env, _, nop = play(normalize(ROW), repo)
    assert env.start_state["fail_to_pass_passing"] == 0 and nop.reward == 0.0


def test_the_eval_runner_records_the_refusal_as_env_error(tmp_path):
    from tsrl_cli.evals.runner import Job, run_jobs

    repo = make_repo(tmp_path, branch=True)
    good = normalize(ROW)
    passing = replace(good, task_id=IID + ".passing", base_ref=IID + ".passing", bug_patch=HARMLESS)
    jobs = [Job("local", None, t, 0, 0) for t in (good, passing)]
    recs = {r["instance_id"]: r for r in run_jobs(None, None, jobs, make_env=lambda j: RepairEnv(j.task, repo_dir=repo),
                                                   agent="oracle")}
    assert recs[good.task_id]["reward"] == 1.0 and not recs[good.task_id]["error"]
    bad = recs[passing.task_id]
    assert bad["exit_reason"] == "env_error" and bad["reward"] is None
    assert bad["failure"].startswith(f"env_error: StartStateError: task {passing.task_id}: FAIL_TO_PASS already pass")
