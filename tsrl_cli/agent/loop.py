"""One trajectory: the model acts in an environment until it submits or a limit fires.

The same function runs in training, evaluation and tests; only the engine (a real policy or a
scripted one) and the environment (a sandboxed task) change. Every turn close, tool call and the
trajectory end is an event with a timestamp (seconds on the caller's clock).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from tsrl_cli.agent.actions import SYSTEM_PROMPT, submitted_by_output  # noqa: F401 - SYSTEM_PROMPT imported from here
from tsrl_cli.agent.latency import ToolLatency
from tsrl_cli.agent.renderer import ChatMLRenderer, TokenTrajectory
from tsrl_cli.agent.template import TemplateRenderer
from tsrl_cli.engines.protocol import SamplingParams, TurnOutput, TurnRequest, request_seed
from tsrl_cli.rollouts import Rollout


@dataclass
class ToolResult:
    output: str  # stdout then stderr, already capped by the sandbox
    exit_code: int | None
    duration_s: float
    limit: str | None = None  # which sandbox limit fired, if any


@dataclass
class RewardResult:
    reward: float
    reason: str = ""  # e.g. "tests passed 3/3", "verifier timed out"
    details: dict = field(default_factory=dict)


class AgentEnv(Protocol):
    task_id: str
    instruction: str

    async def run(self, command: str, timeout_s: float) -> ToolResult: ...

    async def reward(self) -> RewardResult: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 8
    max_turn_tokens: int = 128
    max_trajectory_tokens: int = 2048  # whole trajectory: prompt, turns and observations
    tool_timeout_s: float = 10.0
    wall_clock_s: float = 600.0
    max_observation_chars: int = 2000


@dataclass
class AgentResult:
    rollout: Rollout
    exit_reason: str  # submitted | max_turns | token_limit | wall_clock | engine_error
    reward: RewardResult
    events: list[dict]
    num_turns: int
    policy_versions: list[int]
    tool_call_errors: list[str] = field(default_factory=list)  # the kind of each turn whose call could not run


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + f"\n[... {len(text) - n} characters cut ...]\n" + text[-n // 2:]


def observation_text(output: str, exit_code: int | None, limit: str | None, max_chars: int) -> str:
    """What the model sees after a tool call: exit code, the limit that fired, the clipped output."""
    head = f"[exit code {exit_code}]" + (f" [limit: {limit}]" if limit else "")
    return f"{head}\n{_clip(output, max_chars)}"


async def run_agent(
    env: AgentEnv,
    generate: Callable[[TurnRequest], Awaitable[TurnOutput]],
    renderer: ChatMLRenderer | TemplateRenderer,
    *,
    group_id: str,
    sample_index: int,
    sampling: SamplingParams = SamplingParams(),
    limits: AgentLimits = AgentLimits(),
    seed_key: tuple = (),
    latency: ToolLatency = ToolLatency(),
    clock: Callable[[], float] = time.monotonic,
    on_event: Callable[[dict], None] | None = None,
    system_prompt: str | None = None,
    on_turn: Callable[[TokenTrajectory, int, bool], None] | None = None,
) -> AgentResult:
    """Run one trajectory. `seed_key` (round, task, sample...) makes every turn's seed unique and stable.

    `renderer` (agent/template.py make_renderer) is the chat format: the prompt, the parse of each turn, the
    observations; `system_prompt` None is the renderer's own. `on_turn(traj, k, last)` is called at each turn
    close with the live token trajectory (its last span is turn k): what a per-turn consumer (the OPD teacher)
    needs. Copy what you keep; it grows. `last` is True when no model turn can follow (the turn submits, or
    it is the max_turns-th); an end learned later (a token or wall-clock limit, a submit printed by a tool)
    is told by the trajectory's end only.
    """
    events: list[dict] = []

    def emit(kind: str, **kw) -> None:
        ev = {"event": kind, "t": clock(), "group_id": group_id, "sample_index": sample_index, **kw}
        events.append(ev)
        if on_event is not None:
            on_event(ev)

    start = time.monotonic()
    traj = TokenTrajectory()
    traj.append(renderer.prompt(renderer.system_prompt if system_prompt is None else system_prompt, env.instruction), 0)
    lat_rng = random.Random(request_seed(sampling.seed, *seed_key, "latency"))
    exit_reason, versions, n_tool, call_errors = "max_turns", [], 0, []
    for turn in range(limits.max_turns):
        budget = limits.max_trajectory_tokens - len(traj.input_ids)
        if budget <= 0:
            exit_reason = "token_limit"
            break
        if time.monotonic() - start >= limits.wall_clock_s:
            exit_reason = "wall_clock"
            break
        params = replace(sampling, max_tokens=min(limits.max_turn_tokens, budget),
                         stop_token_ids=renderer.stop_token_ids, seed=request_seed(sampling.seed, *seed_key, turn))
        try:
            out = await generate(TurnRequest(list(traj.input_ids), params))
        except Exception as e:  # noqa: BLE001 - an engine failure ends this trajectory, not the run
            exit_reason = f"engine_error: {type(e).__name__}: {e}"
            break
        versions.append(out.policy_version)
        span = traj.append(out.token_ids, 1, out.logprobs)
        traj.turn_spans.append(span)
        action = renderer.parse(out.token_ids)
        if action.kind == "format_error":
            call_errors.append(action.error)
        emit("turn_close", turn=turn, span=list(span), tokens=len(out.token_ids), finish_reason=out.finish_reason,
             policy_version=out.policy_version, tool_call_error=action.error or None)
        if on_turn is not None:
            on_turn(traj, turn, action.kind == "submit" or turn == limits.max_turns - 1)
        if out.finish_reason != "stop":  # cut by max_tokens: close the turn for the template (not trained on)
            traj.append([renderer.end_of_turn], 0)
        if action.kind == "submit":
            exit_reason = "submitted"
            break
        if action.kind == "format_error":
            traj.append(renderer.feedback(renderer.error_text(action)), 0)
        else:
            remaining = limits.wall_clock_s - (time.monotonic() - start)
            t0 = clock()
            tool_limit_s = max(0.0, min(limits.tool_timeout_s, remaining))
            res = await env.run(action.command, tool_limit_s)
            # The injected latency models the tool's own run time, so the tool's time limit bounds it
            # as it bounds a real call (a 23 s draw under a 10 s timeout took 10 s, not 23). Only
            # the time is modelled: the command's real output is kept.
            drawn = latency.sample(lat_rng, n_tool)
            delay = min(drawn, max(0.0, tool_limit_s - res.duration_s))
            if delay > 0:
                await asyncio.sleep(delay)
            n_tool += 1
            emit("tool", turn=turn, t_start=t0, duration_s=res.duration_s, injected_latency_s=delay,
                 latency_cut=drawn > delay,
                 exit_code=res.exit_code, limit=res.limit, command=action.command[:200])
            if res.exit_code == 0 and submitted_by_output(res.output):
                exit_reason = "submitted"
                break
            observation = observation_text(res.output, res.exit_code, res.limit, limits.max_observation_chars)
            traj.append(renderer.observation(observation), 0)
    try:
        reward = await env.reward()
    except Exception as e:  # noqa: BLE001 - a crashing verifier gives reward 0, never a crashed run
        reward = RewardResult(0.0, f"verifier error: {type(e).__name__}: {e}")
    rollout = Rollout(group_id, sample_index, traj.input_ids, traj.loss_mask, float(reward.reward),
                      list(traj.turn_spans), behavior_logprobs=traj.behavior_logprobs)
    emit("trajectory_end", reason=exit_reason, reward=reward.reward, reward_reason=reward.reason,
         turns=len(traj.turn_spans), tokens=len(traj.input_ids), loss_tokens=sum(traj.loss_mask),
         tool_call_errors=len(call_errors))
    return AgentResult(rollout, exit_reason, reward, events, len(traj.turn_spans), versions, call_errors)
