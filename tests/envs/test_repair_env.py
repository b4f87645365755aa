"""A repair task end to end: scripted policy -> agent loop -> bwrap sandbox -> pytest -> reward.

The same code path as training: run_agent + TurnBatcher + RepairEnv + open_sandbox; only the
policy is scripted. Needs bubblewrap (or root + unshare) for isolation.
"""

import asyncio
import shutil
from pathlib import Path

import pytest

from tsrl_cli.agent.loop import AgentLimits, run_agent
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.datasets.records import RepairTask
from tsrl_cli.engines.batching import TurnBatcher
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.envs.repair import RepairEnv
from tsrl_cli.rollouts import parse_rollout

REPO = Path(__file__).parent.parent / "fixtures" / "repair_calc"
pytestmark = pytest.mark.sandboxed


def task():
    return RepairTask(
        task_id="calc__subtract", source="fixture", split="train", repo="calc", upstream_repo="tsrl/calc",
        base_ref="HEAD", ref_kind="commit", bug_patch=None, gold_patch=None, test_patch=None,
        fail_to_pass=["tests/test_calc.py::test_subtract"], pass_to_pass=["tests/test_calc.py::test_add"],
        image="local", problem_statement="subtract(5, 3) returns 8 instead of 2.", language="python",
    )


FIX = "THOUGHT: subtract adds\n```bash\nsed -i '9s/a + b/a - b/' calc.py && grep -n 'a - b' calc.py\n```"
CHEAT = "THOUGHT: edit the test\n```bash\nprintf 'def test_subtract():\\n    pass\\n' > tests/test_calc.py\n```"


def solve(script, tok, **kw):
    env = RepairEnv(task(), repo_dir=REPO, **kw)

    async def main():
        await env.start()
        batcher = TurnBatcher(ScriptedEngine(tok, script))
        try:
            return await run_agent(env, batcher.generate, ChatMLRenderer(tok), group_id="calc", sample_index=0,
                                   limits=AgentLimits(max_turns=4, tool_timeout_s=20))
        finally:
            batcher.close()
            await env.close()

    return asyncio.run(main())


def test_scripted_fix_gets_reward_1(tok):
    res = solve(lambda ctx, k: [FIX, "```bash\nsubmit\n```"][k], tok)
    assert res.exit_reason == "submitted" and res.rollout.reward == 1.0, res.reward
    assert "FAIL_TO_PASS 1/1" in res.reward.reason
    assert "9:    return a - b" in tok.decode(res.rollout.input_ids)
    parse_rollout(res.rollout.to_json(), "test")
    assert (REPO / "calc.py").read_text().count("a + b") == 2  # the task's own files are untouched


def test_no_fix_gets_reward_0(tok):
    res = solve(lambda ctx, k: "```bash\nsubmit\n```", tok)
    assert res.rollout.reward == 0.0 and "FAIL_TO_PASS 0/1" in res.reward.reason


def test_editing_the_tests_does_not_pay(tok):
    res = solve(lambda ctx, k: [CHEAT, "```bash\nsubmit\n```"][k], tok)
    assert res.rollout.reward == 0.0


def test_hanging_verifier_gives_zero_with_reason(tok):
    t = task()
    t.test_command = "sleep 30"
    env = RepairEnv(t, repo_dir=REPO, verifier_timeout_s=1.0)

    async def main():
        await env.start()
        try:
            return await env.reward()
        finally:
            await env.close()

    r = asyncio.run(main())
    assert r.reward == 0.0 and "wall_clock" in r.reason


def test_secure_tree_restores_removes_and_never_follows_a_symlink(tmp_path):
    """secure_tree on a tree an agent prepared: guarded files back to the start state, agent-added ones and
    caches gone, symlinks replaced, and the host file a symlink pointed at untouched (positive control: a
    plain copy through that symlink would have overwritten it)."""
    from tsrl_cli.envs.repair import secure_tree

    start, work = tmp_path / "start", tmp_path / "work"
    shutil.copytree(REPO, start)
    shutil.copytree(REPO, work)
    canary = tmp_path / "canary.txt"
    canary.write_text("host\n")
    (work / "tests" / "test_calc.py").unlink()
    (work / "tests" / "test_calc.py").symlink_to(canary)  # the verifier must not write through it
    (work / "tests" / "helper.py").write_text("x = 1\n")  # agent-added inside the test directory
    for name in ("conftest.py", "pytest.ini", "setup.cfg", "tox.ini", "pyproject.toml", "sitecustomize.py",
                 "usercustomize.py", "hack.pth"):
        (work / name).write_text("# agent\n")
    (work / "pkg").mkdir()
    (work / "pkg" / "conftest.py").write_text("# agent\n")
    (work / "tests" / "__pycache__").mkdir()
    (work / "tests" / "__pycache__" / "test_calc.cpython-311-pytest-9.pyc").write_bytes(b"forged")
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n")
    secure_tree(work, start, ["tests/test_calc.py"])
    assert canary.read_text() == "host\n"
    assert not (work / "tests" / "test_calc.py").is_symlink()
    assert (work / "tests" / "test_calc.py").read_text() == (REPO / "tests" / "test_calc.py").read_text()
    assert (work / "tests" / "conftest.py").read_text() == (REPO / "tests" / "conftest.py").read_text()
    left = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
    assert left == ["calc.py", "tests/conftest.py", "tests/test_calc.py"], left  # the agent's fix stays
    assert "a - b" in (work / "calc.py").read_text()
    # positive control: what a plain copy (the verifier before secure_tree) does with such a symlink
    (work / "tests" / "test_calc.py").unlink()
    (work / "tests" / "test_calc.py").symlink_to(canary)
    shutil.copyfile(REPO / "tests" / "test_calc.py", work / "tests" / "test_calc.py")
    assert canary.read_text() != "host\n"
