"""Prompt draw, the builtin echo environment, and run_agent's per-turn callback (OPD's hook)."""

import asyncio

from tsrl_cli.rl.tasks import draw_prompts, load_task_table, plan_round
from tsrl_cli.rl.toy import EchoEnv, EchoTask, parse_toy_spec


def test_draw_is_a_function_of_seed_and_round():
    keys = [f"d/t{i}" for i in range(10)]
    assert draw_prompts(keys, 0, 1, 4) == draw_prompts(keys, 0, 1, 4)
    assert draw_prompts(keys, 0, 1, 4) != draw_prompts(keys, 0, 2, 4)
    assert draw_prompts(keys, 0, 1, 4) != draw_prompts(keys, 1, 1, 4)
    assert len(set(draw_prompts(keys, 0, 1, 10))) == 10  # a permutation: no repeats within the table


def test_plan_group_ids_unique_when_tasks_repeat():
    plan = plan_round(["d/a", "d/b"], seed=0, round_=3, prompts=5, group_size=2, save_checkpoint=True)
    ids = [g.group_id for g in plan.groups]
    assert len(set(ids)) == 5 and plan.num_trajectories == 10 and plan.save_checkpoint
    assert sum("#" in i for i in ids) == 3


def test_echo_env_rewards_similarity():
    async def go(commands):
        env = EchoEnv(EchoTask("echo-apple", "apple"))
        outs = [await env.run(c, 1.0) for c in commands]
        return outs, (await env.reward()).reward

    outs, r = asyncio.run(go(["ls", "echo aple", "echo 'apple'"]))
    assert outs[0].exit_code == 127 and outs[2].output == "apple\n" and r == 1.0
    assert 0 < asyncio.run(go(["echo aple"]))[1] < 1
    assert asyncio.run(go(["ls"]))[1] == 0.0


def test_echo_table_and_toy_specs():
    table = load_task_table(("builtin:echo",), limit=3)
    assert list(table) == ["echo/echo-apple", "echo/echo-river", "echo/echo-stone"]
    assert parse_toy_spec("builtin:toy") == (32, 2, False)
    assert parse_toy_spec("builtin:toy:h64:l3:teacher") == (64, 3, True)


def test_run_agent_on_turn_sees_each_closed_turn(tok):
    from tsrl_cli.agent.loop import run_agent
    from tsrl_cli.agent.renderer import ChatMLRenderer
    from tsrl_cli.engines.batching import TurnBatcher
    from tsrl_cli.engines.scripted import ScriptedEngine

    seen = []

    def on_turn(traj, k, last):  # a copy: the trajectory keeps growing after the callback
        seen.append((k, list(traj.input_ids), list(traj.turn_spans), last))

    batcher = TurnBatcher(ScriptedEngine(tok, lambda ctx, k: ["```bash\necho aple\n```", "```bash\nsubmit\n```"][k]))
    try:
        res = asyncio.run(run_agent(EchoEnv(EchoTask("echo-apple", "apple")), batcher.generate, ChatMLRenderer(tok),
                                    group_id="g", sample_index=0, on_turn=on_turn))
    finally:
        batcher.close()
    r = res.rollout
    assert [k for k, _, _, _ in seen] == [0, 1] and res.num_turns == 2
    assert [last for *_, last in seen] == [False, True]  # the second turn submits: nothing can follow it
    for k, ids, spans, _ in seen:
        end = r.turn_spans[k][1]
        assert spans == r.turn_spans[: k + 1] and ids == r.input_ids[:end]


def test_run_agent_marks_the_max_turns_turn_last(tok):
    """At rollout.max_turns the last turn is marked as it closes, though it does not submit: no turn can follow.
    Control: the same agent with one more turn allowed marks none of the first two."""
    from tsrl_cli.agent.loop import AgentLimits, run_agent
    from tsrl_cli.agent.renderer import ChatMLRenderer
    from tsrl_cli.engines.batching import TurnBatcher
    from tsrl_cli.engines.scripted import ScriptedEngine

    def lasts(max_turns: int) -> list[bool]:
        seen = []
        batcher = TurnBatcher(ScriptedEngine(tok, lambda ctx, k: "```bash\necho aple\n```"))
        try:
            res = asyncio.run(run_agent(EchoEnv(EchoTask("echo-apple", "apple")), batcher.generate,
                                        ChatMLRenderer(tok), group_id="g", sample_index=0,
                                        limits=AgentLimits(max_turns=max_turns),
                                        on_turn=lambda traj, k, last: seen.append(last)))
        finally:
            batcher.close()
        assert res.exit_reason == "max_turns"
        return seen

    assert lasts(2) == [False, True]
    assert lasts(3) == [False, False, True]
