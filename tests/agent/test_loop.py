"""The agent loop with a scripted policy and a scripted environment (test doubles, named so)."""

import asyncio
import time

import pytest

from tsrl_cli.agent.latency import ToolLatency
from tsrl_cli.agent.loop import AgentLimits, RewardResult, ToolResult, run_agent
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.engines.batching import TurnBatcher
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.errors import UsageError
from tsrl_cli.rollouts import parse_rollout


class ScriptedEnv:
    """Answers commands from a dict; counts calls; reward from a callable (may raise)."""

    def __init__(self, answers=None, reward=lambda env: RewardResult(1.0, "ok"), delay_s=0.0):
        self.task_id, self.instruction = "t1", "Fix calc.py so that the tests pass."
        self.answers, self.calls, self._reward, self.delay_s = answers or {}, [], reward, delay_s

    async def run(self, command, timeout_s):
        self.calls.append(command)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out, code = self.answers.get(command, ("", 0))
        return ToolResult(out, code, self.delay_s)

    async def reward(self):
        return self._reward(self)

    async def close(self):
        pass


def run(env, script, tok, **kw):
    engine = ScriptedEngine(tok, script)
    batcher = TurnBatcher(engine)
    try:
        return asyncio.run(run_agent(env, batcher.generate, ChatMLRenderer(tok), group_id="g", sample_index=0, **kw))
    finally:
        batcher.close()


def valid(res):
    parse_rollout(res.rollout.to_json(), "test")
    return res


def test_submit_after_tool_call(tok):
    env = ScriptedEnv({"ls": ("calc.py", 0)})
    res = valid(run(env, lambda ctx, k: ["```bash\nls\n```", "```bash\nsubmit\n```"][k], tok))
    assert res.exit_reason == "submitted" and res.num_turns == 2 and env.calls == ["ls"]
    assert res.rollout.reward == 1.0
    kinds = [e["event"] for e in res.events]
    assert kinds == ["turn_close", "tool", "turn_close", "trajectory_end"]
    assert all(a["t"] <= b["t"] for a, b in zip(res.events, res.events[1:], strict=False))
    assert "[exit code 0]\ncalc.py" in tok.decode(res.rollout.input_ids)


def test_mini_swe_agent_submission_marker(tok):
    env = ScriptedEnv({"echo done": ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 0)})
    res = run(env, lambda ctx, k: "```bash\necho done\n```", tok)
    assert res.exit_reason == "submitted" and res.num_turns == 1


def test_max_turns_and_format_errors(tok):
    env = ScriptedEnv()
    res = valid(run(env, lambda ctx, k: "I will not use a block", tok, limits=AgentLimits(max_turns=3)))
    assert res.exit_reason == "max_turns" and res.num_turns == 3 and env.calls == []
    assert "Format error" in tok.decode(res.rollout.input_ids)


def test_token_limits(tok):
    env = ScriptedEnv()
    long = "```bash\n" + "echo a; " * 40 + "\n```"
    res = valid(run(env, lambda ctx, k: long, tok, limits=AgentLimits(max_turn_tokens=10, max_trajectory_tokens=120)))
    assert res.exit_reason in ("token_limit", "max_turns")
    assert all(e["finish_reason"] == "length" for e in res.events if e["event"] == "turn_close")
    assert all(e - s <= 10 for s, e in res.rollout.turn_spans)


def test_crashing_verifier_gives_zero_with_reason(tok):
    def boom(env):
        raise RuntimeError("pytest collection failed")

    res = run(ScriptedEnv(reward=boom), lambda ctx, k: "```bash\nsubmit\n```", tok)
    assert res.rollout.reward == 0.0 and "pytest collection failed" in res.reward.reason


def test_engine_error_ends_only_the_trajectory(tok):
    def broken(ctx, k):
        raise ValueError("engine died")

    res = run(ScriptedEnv(), broken, tok)
    assert res.exit_reason.startswith("engine_error") and res.num_turns == 0


def test_injected_latency_is_recorded_apart_from_tool_time(tok):
    env = ScriptedEnv({"ls": ("x", 0)})
    t0 = time.monotonic()
    res = run(env, lambda ctx, k: ["```bash\nls\n```", "```bash\nsubmit\n```"][k], tok,
              latency=ToolLatency.lognormal(0.2, 0.0))
    tool = [e for e in res.events if e["event"] == "tool"][0]
    assert tool["injected_latency_s"] == pytest.approx(0.2) and tool["duration_s"] == 0.0
    assert time.monotonic() - t0 >= 0.2


def test_injected_latency_is_cut_at_the_tool_timeout(tok):
    """A drawn delay longer than the tool's time limit lasts only up to that limit (as a real call would)."""
    env = ScriptedEnv({"ls": ("x", 0)}, delay_s=0.05)
    t0 = time.monotonic()
    res = run(env, lambda ctx, k: ["```bash\nls\n```", "```bash\nsubmit\n```"][k], tok,
              latency=ToolLatency.lognormal(30.0, 0.0), limits=AgentLimits(tool_timeout_s=0.3))
    tool = [e for e in res.events if e["event"] == "tool"][0]
    assert tool["latency_cut"] is True
    assert tool["duration_s"] + tool["injected_latency_s"] == pytest.approx(0.3)
    assert time.monotonic() - t0 < 5.0
    assert "[exit code 0]\nx" in tok.decode(res.rollout.input_ids)  # the output is kept


def test_latency_trace_file(tmp_path):
    p = tmp_path / "trace.txt"
    p.write_text("0.5\n\n1.5\n")
    lat = ToolLatency.from_trace(p)
    assert [lat.sample(None, i) for i in range(3)] == [0.5, 1.5, 0.5]
    p.write_text("0.5\nsoon\n")
    with pytest.raises(UsageError, match=":2:"):
        ToolLatency.from_trace(p)


def test_concurrent_sessions_are_batched(tok):
    """Eight sessions whose tools sleep: the engine sees batches of several requests."""
    class SlowScripted(ScriptedEngine):  # a busy engine: requests that arrive meanwhile must queue up
        def generate(self, requests):
            t0 = time.monotonic()  # the first call holds until it has company, or company waits behind it
            while len(batcher.batches) == 1 and batcher.batches[0] == 1 and batcher._q.qsize() < 2 \
                    and time.monotonic() - t0 < 30:
                time.sleep(0.005)
            return super().generate(requests)

    engine = SlowScripted(tok, lambda ctx, k: ["```bash\nls\n```", "```bash\nsubmit\n```"][k])
    batcher = TurnBatcher(engine, max_batch=8)

    async def main():
        envs = [ScriptedEnv({"ls": ("x", 0)}, delay_s=0.05) for _ in range(8)]
        return await asyncio.gather(*[run_agent(e, batcher.generate, ChatMLRenderer(tok), group_id="g",
                                                sample_index=i) for i, e in enumerate(envs)])

    try:
        results = asyncio.run(main())
    finally:
        batcher.close()
    assert all(r.exit_reason == "submitted" for r in results)
    assert max(batcher.batches) > 1 and sum(batcher.batches) == 16
