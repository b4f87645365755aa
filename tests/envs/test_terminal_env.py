"""A Harbor-layout terminal task end to end: scripted policy -> agent loop -> sandbox -> test.sh -> reward."""

import asyncio

import pytest
from typer.testing import CliRunner

from tsrl_cli.agent.loop import AgentLimits, run_agent
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.cli import app
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.engines.batching import TurnBatcher
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.envs.tasks import find_task, make_env

pytestmark = pytest.mark.sandboxed


@pytest.fixture(scope="module")
def ds(tmp_path_factory, prepare_fixture):
    """A Harbor task written for local runs (tests/fixtures/harbor_local), prepared like any other."""
    out = tmp_path_factory.mktemp("tb") / "tb"
    return prepare_fixture("terminal-bench", "tests/fixtures/harbor_local", out)


def play(ds, task_id, replies, tok):
    ds = open_dataset(str(ds))
    d, tasks = ds.path, ds.tasks
    env = make_env(find_task(tasks, task_id), d)

    async def main():
        await env.start()
        batcher = TurnBatcher(ScriptedEngine(tok, lambda ctx, k: replies[min(k, len(replies) - 1)]))
        try:
            return await run_agent(env, batcher.generate, ChatMLRenderer(tok), group_id=task_id, sample_index=0,
                                   limits=AgentLimits(max_turns=3))
        finally:
            batcher.close()
            await env.close()

    return asyncio.run(main())


def test_solution_gets_reward_1_and_nothing_gets_0(ds, tok):
    solve = (ds / "tasks" / "write-greeting" / "solution" / "solve.sh").read_text().strip().splitlines()[-1]
    done = play(ds, "write-greeting", [f"```bash\n{solve} && ls /tests 2>&1; pwd\n```", "```bash\nsubmit\n```"], tok)
    assert done.rollout.reward == 1.0, (solve, done.reward)
    text = tok.decode(done.rollout.input_ids)
    assert "/app" in text and "No such file or directory" in text  # works in /app; the tests are hidden
    idle = play(ds, "write-greeting", ["```bash\nsubmit\n```"], tok)
    assert idle.rollout.reward == 0.0
    wrong = play(ds, "write-greeting", ["```bash\necho hi > greeting.txt\n```", "```bash\nsubmit\n```"], tok)
    assert wrong.rollout.reward == 0.0


@pytest.mark.slow
def test_embedded_suite_solutions_pass_through_terminal_env(tmp_path, tok):
    """Families that chmod/mv/rm files the task shipped (the agent owns /app's whole tree)."""
    from tsrl_cli.embedded.terminal_suite import build_terminal_suite, solution_commands

    build_terminal_suite(tmp_path / "suite", seed=0, n_train=17, n_heldout=0)
    res = CliRunner().invoke(app, ["prepare-data", "seta-env", "--from", str(tmp_path / "suite" / "terminal" / "train"),
                                   "--out", str(tmp_path / "ds"), "--json"])
    assert res.exit_code == 0, res.output
    ds = open_dataset(str(tmp_path / "ds"))
    d, tasks = ds.path, ds.tasks
    by_family = {}
    for t in tasks:
        by_family.setdefault(t.meta.get("family") or t.task_id.rsplit("-", 1)[0], t)
    picked = [t for t in tasks if any(f in t.task_id for f in ("chmod", "rename", "delete", "replace"))][:4]
    assert picked, [t.task_id for t in tasks]
    for t in picked:
        cmds = solution_commands(d / t.task_dir)
        replies = [f"```bash\n{c}\n```" for c in cmds] + ["```bash\nsubmit\n```"]
        res = play(tmp_path / "ds", t.task_id, replies, tok)
        assert res.rollout.reward == 1.0, (t.task_id, cmds, res.reward, tok.decode(res.rollout.input_ids)[-400:])
