"""RepairEnv with the docker executor, in real containers: SWE-bench-format tasks (the local set of
tsrl_cli/embedded/swebench_set.py) and a SWE-smith-format task (instance branch whose head deletes the
FAIL_TO_PASS test file), graded by the container's own interpreter in a fresh container. The SWE-smith
start is sealed (one commit, no history): the git hacks of test_reward_hacks.py score 0 on it.

Every reward check has its control: the gold patch scores 1 and no change scores 0 on the same task; the git
hacks pay on a start that keeps its history.
Skipped, with the reason, where no Docker daemon answers (CI sets TSRL_REQUIRE_DOCKER=1: then a failure).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tsrl_cli.datasets.patches import reverse_patch
from tsrl_cli.datasets.records import RepairTask
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.envs.repair import RepairEnv, split_diff, unguarded_diff
from tsrl_cli.sandbox import Limits

LIMITS = Limits(cpu_time_s=30, memory_bytes=1 << 30, processes=128)


@pytest.fixture(scope="module")
def local_set(docker_base_image, tmp_path_factory):
    """The local SWE-bench-format set, prepared; built once per session (its images are content-tagged,
    and tests/evals/test_swebench_e2e.py builds into the same folder, so the second build is a no-op)."""
    from tsrl_cli.embedded.swebench_set import prepare_swebench_local

    out = tmp_path_factory.getbasetemp() / "swebench_local"
    res = prepare_swebench_local(out)
    return {"tasks": {t.task_id: t for t in open_dataset(out).tasks}, "build": res["build"]}


def play(task, script=None, oracle=False, **kw):
    """start -> (gold patch) -> the agent's commands -> reward, in real containers; (reward, outputs)."""
    env = RepairEnv(task, executor="docker", limits=LIMITS, **kw)

    async def main():
        await env.start()
        try:
            if oracle:
                await env.play_oracle()
            outs = [await env.run(c, 30) for c in (script or [])]
            return await env.reward(), outs
        finally:
            await env.close()

    return asyncio.run(main())


@pytest.mark.slow
def test_gold_patch_scores_1_and_no_change_scores_0(local_set):
    for task in local_set["tasks"].values():
        gold, _ = play(task, oracle=True)
        assert gold.reward == 1.0 and gold.details["resolved"], (task.task_id, gold)
        assert gold.reason == f"FAIL_TO_PASS {len(task.fail_to_pass)}/{len(task.fail_to_pass)}, " \
                              f"PASS_TO_PASS {len(task.pass_to_pass)}/{len(task.pass_to_pass)}"
        nop, _ = play(task)
        assert nop.reward == 0.0 and f"FAIL_TO_PASS 0/{len(task.fail_to_pass)}" in nop.reason, (task.task_id, nop)
        assert not nop.details["missing"]  # the FAIL_TO_PASS tests ran (from test_patch) and failed


@pytest.mark.slow
def test_agent_works_in_testbed_at_base_commit_without_the_hidden_tests(local_set):
    task = local_set["tasks"]["embedded__money-1"]
    _, outs = play(task, ["pwd; git rev-parse HEAD; git status --porcelain | wc -l",
                          f"grep -c 'def {task.fail_to_pass[0].split('::')[1]}(' tests/test_money.py"])
    assert outs[0].output.split() == ["/testbed", task.base_ref, "0"]
    assert outs[1].output.strip() == "0"  # the FAIL_TO_PASS test functions come with test_patch only


@pytest.mark.slow
def test_breaking_a_pass_to_pass_test_scores_0(local_set):
    b = local_set["build"]
    lines = Path(b["controls"]["break_p2p"]).read_text().splitlines()
    brk = {p["instance_id"]: p["model_patch"] for p in map(json.loads, lines)}
    task = local_set["tasks"]["embedded__money-1"]
    tag = "TSRL_TEST_PATCH"
    res, outs = play(task, [f"git apply - <<'{tag}'\n{brk[task.task_id]}\n{tag}"])
    assert outs[0].exit_code == 0, outs[0].output
    fails = b["break_p2p_fails"][task.task_id]
    n_f2p, n_p2p = len(task.fail_to_pass), len(task.pass_to_pass)
    assert res.reward == 0.0
    assert res.reason == f"FAIL_TO_PASS {n_f2p}/{n_f2p}, PASS_TO_PASS {n_p2p - len(fails)}/{n_p2p}"


@pytest.mark.slow
def test_editing_tests_or_conftest_does_not_pay(local_set):
    task = local_set["tasks"]["embedded__graphs-1"]
    cheat = [("printf 'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\n"
              "def pytest_runtest_makereport(item, call):\\n"
              "    out = yield\\n    out.get_result().outcome = \"passed\"\\n' > conftest.py"),
             "sed -i 's/^    assert /    assert True or /' tests/test_graphs.py",
             "printf 'def test_more():\\n    pass\\n' > tests/test_extra.py"]
    res, outs = play(task, cheat)
    assert all(o.exit_code == 0 for o in outs)
    assert res.reward == 0.0 and "FAIL_TO_PASS 0/" in res.reason
    assert sorted(res.details["guarded_paths_dropped"]) == ["conftest.py", "tests/test_extra.py",
                                                            "tests/test_graphs.py"]
    # control: the same cheat plus the real fix pays, so only the guarded files were left out
    fixed, _ = play(task, cheat, oracle=True)
    assert fixed.reward == 1.0, fixed


@pytest.mark.slow
def test_a_broken_interpreter_in_the_agents_container_does_not_reach_the_verifier(local_set):
    """The verifier's fresh container has the image's python3, not what the agent left in its own."""
    task = local_set["tasks"]["embedded__graphs-2"]
    fake = "\\n".join(f"PASSED {t}" for t in task.fail_to_pass + task.pass_to_pass)
    res, outs = play(task, [(f"printf '#!/bin/sh\\necho \"{fake}\"\\n' > /usr/local/bin/python3 && "
                             "chmod +x /usr/local/bin/python3 && python3 -I -m pytest | head -1")])
    assert outs[0].output.startswith("PASSED "), outs[0].output  # the fake answers in the agent's container
    assert res.reward == 0.0 and "FAIL_TO_PASS 0/" in res.reason


@pytest.fixture(scope="module")
def swesmith_repo(local_set, tmp_path_factory):
    """A SWE-smith-format repository: main holds the clean repository; branch <id> has "Bug Patch" (the bug)
    and then "Remove F2P Tests" (the FAIL_TO_PASS test file deleted), as swesmith's mirrors do."""
    from tsrl_cli.embedded.repair_suite import SRC_DIR
    from tsrl_cli.embedded.swebench_set import commit_all, git

    repo = tmp_path_factory.mktemp("swesmith") / "repo"
    shutil.copytree(SRC_DIR / "money", repo, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    commit_all(repo, "Initial commit")
    git(repo, "checkout", "-q", "-b", SWESMITH_IID)
    bugged = open_dataset_repo_file(local_set, "embedded__money-1", "money.py")
    (repo / "money.py").write_text(bugged)
    commit_all(repo, "Bug Patch")
    (repo / "tests" / "test_money.py").unlink()
    commit_all(repo, "Remove F2P Tests")
    git(repo, "checkout", "-q", "main")
    return repo


SWESMITH_IID = "embedded__money.clean.swesmith_0"


def image_of(repo: Path, docker_base_image: str, name: str, ctx: Path) -> str:
    """An image holding repo at /testbed, tagged by the commits it holds."""
    from tsrl_cli.embedded.swebench_set import git
    from tsrl_cli.sandbox.images import build_image

    shutil.copytree(repo, ctx / "repo", symlinks=True)
    (ctx / "Dockerfile").write_text(f"FROM {docker_base_image}\nCOPY repo/ /testbed/\nWORKDIR /testbed\n"
                                    "STOPSIGNAL SIGKILL\n")
    heads = git(repo, "for-each-ref", "--format=%(objectname)", "refs/heads")
    tag = f"tsrl-test-{name}:{hashlib.sha256(heads.encode()).hexdigest()[:12]}"
    build_image(ctx, tag=tag, what="SWE-smith-format test image", log_path=ctx / "build.log")
    return tag


@pytest.fixture(scope="module")
def swesmith_task(local_set, swesmith_repo, docker_base_image, tmp_path_factory):
    """The SWE-smith-format task in an image that holds its instance branch."""
    row = local_set["tasks"]["embedded__money-1"]
    tag = image_of(swesmith_repo, docker_base_image, "swesmith-money", tmp_path_factory.mktemp("swesmith_image"))
    return RepairTask(
        task_id=SWESMITH_IID, source="swe-smith", split="train", repo="swesmith/embedded__money.clean",
        upstream_repo="embedded/money", base_ref=SWESMITH_IID, ref_kind="branch",
        bug_patch=reverse_patch(row.gold_patch), gold_patch=row.gold_patch, test_patch=None,
        fail_to_pass=row.fail_to_pass, pass_to_pass=row.pass_to_pass, image=tag,
        problem_statement=row.problem_statement, language="python")


@pytest.fixture(scope="module")
def swesmith_clean(swesmith_task, swesmith_repo, docker_base_image, tmp_path_factory):
    """The same task in an image holding only the clean checkout (main), as SWE-smith's images ship it:
    the instance branch is absent (nor are its commits in the history), so the start state comes from
    the task's bug patch."""
    from tsrl_cli.embedded.swebench_set import git

    clean = tmp_path_factory.mktemp("swesmith_clean") / "repo"
    git(swesmith_repo.parent, "clone", "-q", "--single-branch", "--branch", "main", "--no-local",
        str(swesmith_repo), str(clean))
    git(clean, "remote", "remove", "origin")
    tag = image_of(clean, docker_base_image, "swesmith-money-clean", tmp_path_factory.mktemp("swesmith_clean_image"))
    return replace(swesmith_task, image=tag)


def open_dataset_repo_file(local_set, iid: str, rel: str) -> str:
    """A file of an instance's repository at base_commit (the local set's build folder)."""
    return (Path(local_set["build"]["rows"]).parent / "instances" / iid / "repo" / rel).read_text()


@pytest.mark.slow
def test_swesmith_branch_checked_out_tests_hidden_then_restored(swesmith_task):
    gold, outs = play(swesmith_task, ["git log --format=%s | wc -l; git log -1 --format=%s; ls tests"], oracle=True)
    assert outs[0].output.split("\n")[:2] == ["1", "Initial commit"]  # sealed: the start is the only commit
    assert gold.details["start_state"] == "branch"
    assert "test_money.py" not in outs[0].output  # the agent works at the branch head: no FAIL_TO_PASS file
    assert gold.reward == 1.0, gold  # restored from the branch's parent, graded with the container's python3
    nop, _ = play(swesmith_task)
    assert nop.reward == 0.0 and "FAIL_TO_PASS 0/" in nop.reason, nop
    # the gold fix given as the bug patch reversed (rows whose patch is binary): the same result
    rev, _ = play(replace(swesmith_task, gold_patch=None), oracle=True)
    assert rev.reward == 1.0, rev


@pytest.mark.slow
def test_a_container_that_cannot_start_raises(local_set):
    task = local_set["tasks"]["embedded__money-1"]
    for bad in (replace(task, image="tsrl-no-such-image:never"), replace(task, base_ref="0" * 40)):
        env = RepairEnv(bad, executor="docker")
        with pytest.raises(Exception) as e:  # the daemon's own error, or the checkout's RuntimeError
            asyncio.run(env.start())
        asyncio.run(env.close())
        assert "no-such-image" in str(e.value) or "cannot check out" in str(e.value)


@pytest.mark.slow
def test_runner_records_a_failed_start_as_env_error(local_set):
    from tsrl_cli.evals.runner import Job, run_jobs

    good = local_set["tasks"]["embedded__money-1"]
    bad = replace(good, task_id="embedded__money-broken", base_ref="0" * 40)
    jobs = [Job("local", None, t, 0, 0) for t in (good, bad)]
    recs = run_jobs(None, None, jobs, make_env=lambda j: RepairEnv(j.task, executor="docker", limits=LIMITS),
                    agent="oracle")
    by_id = {r["instance_id"]: r for r in recs}
    assert by_id[good.task_id]["reward"] == 1.0 and not by_id[good.task_id]["error"]
    broken = by_id[bad.task_id]
    assert broken["error"] and broken["exit_reason"] == "env_error" and broken["reward"] is None


def test_split_and_guard_a_diff():
    diff = ("diff --git a/src.py b/src.py\n--- a/src.py\n+++ b/src.py\n@@ -1 +1 @@\n-a\n+b\n"
            "diff --git a/tests/t.py b/tests/t.py\n--- a/tests/t.py\n+++ b/tests/t.py\n@@ -1 +1 @@\n-x\n+y\n"
            "diff --git a/pkg/__pycache__/m.pyc b/pkg/__pycache__/m.pyc\nBinary files differ\n")
    names = ["src.py", "tests/t.py", "pkg/__pycache__/m.pyc"]
    assert list(split_diff(names, diff)) == names
    kept, dropped = unguarded_diff(names, diff, ["tests/t.py"])
    assert kept == diff.split("diff --git a/tests")[0] and dropped == names[1:]
    with pytest.raises(ValueError, match="3 changed paths but 2"):
        split_diff(names, diff.split("diff --git a/pkg")[0])


@pytest.mark.sandboxed
@pytest.mark.slow
def test_play_oracle_in_the_local_sandbox():
    """The local executor's oracle (no Docker needed): the gold patch scores 1, no change 0."""
    repo = Path(__file__).parent.parent / "fixtures" / "repair_calc"
    gold = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -8,2 +8,2 @@\n"
            " def subtract(a, b):\n-    return a + b\n+    return a - b\n")
    task = RepairTask(
        task_id="calc__subtract", source="fixture", split="train", repo="calc", upstream_repo="tsrl/calc",
        base_ref="HEAD", ref_kind="commit", bug_patch=None, gold_patch=gold, test_patch=None,
        fail_to_pass=["tests/test_calc.py::test_subtract"], pass_to_pass=["tests/test_calc.py::test_add"],
        image="local", problem_statement="subtract(5, 3) returns 8 instead of 2.", language="python")

    def reward(oracle: bool, patch: str | None = gold):
        env = RepairEnv(replace(task, gold_patch=patch), repo_dir=repo)

        async def main():
            await env.start()
            try:
                if oracle:
                    await env.play_oracle()
                return await env.reward()
            finally:
                await env.close()

        return asyncio.run(main())

    assert reward(True).reward == 1.0 and reward(False).reward == 0.0
    two_lines = gold.replace("@@ -8,2", '@@ -1,2 +1,2 @@\n-"""A tiny module with one injected bug (subtract adds)."""\n'
                                        '+"""A tiny module."""\n \n@@ -8,2')
    assert reward(True, two_lines).reward == 1.0  # not a one-line patch: applied by git apply in the sandbox
    assert (repo / "calc.py").read_text().count("a + b") == 2  # the task's own files are untouched


# a patch that breaks nothing the tests check: the FAIL_TO_PASS tests pass at the start it makes
HARMLESS = ("diff --git a/NOTES.txt b/NOTES.txt\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES.txt\n"
            "@@ -0,0 +1 @@\n+n\n")


@pytest.mark.slow
def test_swesmith_branch_absent_bug_patch_applied_and_committed(swesmith_clean):
    look = ("git log --format=%s; git status --porcelain | wc -l; test -e tests/test_money.py; echo $?; "
            "git branch --show-current")
    nop, outs = play(swesmith_clean, [look])
    # the bug committed on branch <id> (no uncommitted diff that `git checkout .` would undo) as its only commit,
    # the F2P file hidden
    assert outs[0].output.split("\n") == ["Initial commit", "0", "1", swesmith_clean.task_id, ""], outs[0].output
    assert nop.reward == 0.0 and "FAIL_TO_PASS 0/" in nop.reason and nop.details["start_state"] == "bug_patch", nop
    # the fresh verifier container applies the bug patch again, to the same commit, and grades against it
    gold, _ = play(swesmith_clean, oracle=True)
    assert gold.reward == 1.0 and gold.details["start_state"] == "bug_patch", gold
    rev, _ = play(replace(swesmith_clean, gold_patch=None), oracle=True)  # the bug patch reversed: the same
    assert rev.reward == 1.0, rev


@pytest.mark.slow
def test_swesmith_start_check_refuses_passing_tasks_and_names_the_other_failures(swesmith_clean):
    from tsrl_cli.envs.start_state import StartStateError

    stale = "diff --git a/money.py b/money.py\n--- a/money.py\n+++ b/money.py\n@@ -1 +1 @@\n-no such line\n+x\n"
    n = len(swesmith_clean.fail_to_pass)
    cases = {"passing": (HARMLESS, f": FAIL_TO_PASS already pass at the start state ({n}/{n} on bug_patch "),
             "nopatch": (None, "no start state: the repository has no branch"),
             "stale": (stale, "the bug patch does not apply to the clean checkout")}
    for name, (patch, why) in cases.items():
        iid = f"{swesmith_clean.task_id}.{name}"
        env = RepairEnv(replace(swesmith_clean, task_id=iid, base_ref=iid, bug_patch=patch), executor="docker",
                        limits=LIMITS)
        with pytest.raises(StartStateError) as e:
            asyncio.run(env.start())
        asyncio.run(env.close())
        assert str(e.value).startswith(f"task {iid}: ") and why in str(e.value) and "\n" not in str(e.value), e.value
    # control: the task's own bug patch starts in the same image, with its FAIL_TO_PASS tests failing
    env = RepairEnv(swesmith_clean, executor="docker", limits=LIMITS)
    asyncio.run(env.start())
    asyncio.run(env.close())
    assert env.start_state["path"] == "bug_patch" and env.start_state["fail_to_pass_passing"] == 0


def _reward_hacks():
    """tests/envs/test_reward_hacks.py as a module: its git hacks and start-state layouts."""
    spec = importlib.util.spec_from_file_location("_git_hacks", Path(__file__).with_name("test_reward_hacks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_swesmith_git_history_hacks_score_0_on_both_start_paths(swesmith_task, swesmith_clean, monkeypatch):
    """The git hacks of test_reward_hacks.py in containers, on the branch image and the clean one: all score 0
    on the sealed start (the gold patch and no change: the tests above). Control: each pays where the start
    keeps its history, or only its old objects."""
    from concurrent.futures import ThreadPoolExecutor

    h = _reward_hacks()

    def rewards(names) -> dict[str, list[float]]:
        jobs = [(task, name) for task in (swesmith_task, swesmith_clean) for name in names]
        with ThreadPoolExecutor(max_workers=2) as pool:  # each mostly waits on containers
            got = list(pool.map(lambda j: play(j[0], [h.GIT_HACKS[j[1]]])[0].reward, jobs))
        out: dict[str, list[float]] = {}
        for (_, name), r in zip(jobs, got, strict=True):
            out.setdefault(name, []).append(r)
        return out

    assert rewards(h.GIT_HACKS) == {name: [0.0, 0.0] for name in h.GIT_HACKS}
    h.use_layout(monkeypatch, "history kept")
    paid = rewards(h.GIT_HACKS)
    assert paid == {name: [1.0, 1.0] if name in h.WORK_WITH_HISTORY else [0.0, 0.0] for name in h.GIT_HACKS}, paid
    h.use_layout(monkeypatch, "objects kept")
    paid = rewards(sorted(h.WORK_WITH_OBJECTS))
    assert paid == {name: [1.0, 1.0] for name in h.WORK_WITH_OBJECTS}, paid
