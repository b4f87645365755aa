"""The rollout process: many concurrent agent sessions and their environments, over an engine pool.

The pool (rl/replicas.py) is the engine in this process, N engine replica processes, or remote
servers; new weights reach every engine over the weight bus (rl/weightbus.py), never a queue.

Per round: take the newest weights allowed (on-policy schedules wait for exactly the previous
round's; `async` takes whatever is newest, waiting only past `max_staleness`), freeze the version,
run every (group, sample) as an asyncio session. Each finished trajectory (GRPO), or each closed
model turn (OPD, to the teacher), leaves on a queue the moment it exists. In a round after a checkpoint
each ended trajectory is first appended to the run directory's journal, fsynced (rl/journal.py); the
first round of a resumed run sends the journal's trajectories again and generates only the missing ones.

A rollout is a pure function of (weights, seed, round, task, sample): the prompts come from the
round plan and every request's sampling seed from request_seed(seed, round, group, sample, turn).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from tsrl_cli.agent.latency import ToolLatency
from tsrl_cli.agent.loop import AgentLimits, run_agent
from tsrl_cli.agent.oracle import OracleSession
from tsrl_cli.agent.template import make_renderer
from tsrl_cli.config import TrainConfig, parse_base_images
from tsrl_cli.engines.base import SamplingParams
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.policy import load_tokenizer
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
    sigterm_raises,
)
from tsrl_cli.rl.journal import Journal, closed_turns
from tsrl_cli.rl.replicas import make_pool
from tsrl_cli.rl.tasks import load_task_table, make_task_env
from tsrl_cli.rl.types import GroupSpec, RoundPlan, TrajectoryDone, TurnClosed
from tsrl_cli.rollouts import Rollout

# Tests that kill or stop a run mid-round (tests/rl/test_faults.py) set TSRL_HOLD_ROLLOUT_AT_ROUND=K:PATH: the
# rollout process, once it holds round K's weights and before its first trajectory, creates PATH and waits
# while PATH exists. The signal then lands mid-round by construction, not by a poll that a loaded machine
# can make late (the run finishing first). TSRL_HOLD_ROLLOUT_AFTER_TRAJECTORIES=K:N:PATH holds the same way once
# N trajectories of round K have ended (each in the journal and on its way to the learner): a strike then lands
# mid-round with exactly N of its trajectories done, since the hold stops the whole event loop. Unset in every
# other use.
HOLD_ENV = "TSRL_HOLD_ROLLOUT_AT_ROUND"
HOLD_AFTER_ENV = "TSRL_HOLD_ROLLOUT_AFTER_TRAJECTORIES"


def _hold(env: str, at: tuple[int, ...], example: str) -> None:
    spec = os.environ.get(env)
    if not spec:
        return
    *numbers, path = spec.split(":", len(at))
    if not (len(numbers) == len(at) and all(n.isdigit() for n in numbers) and path):
        raise UsageError(f"{env}={spec!r}: expected {example}")
    if tuple(int(n) for n in numbers) == at:
        Path(path).touch()
        while os.path.exists(path):
            time.sleep(0.05)


def hold_if_asked(round_: int) -> None:
    _hold(HOLD_ENV, (round_,), "ROUND:PATH, e.g. 2:/tmp/held")


def hold_after_if_asked(round_: int, ended: int) -> None:
    _hold(HOLD_AFTER_ENV, (round_, ended), "ROUND:N:PATH, e.g. 3:3:/tmp/held")


# metrics.jsonl's per-replica batching keys, from each replica batcher's take_stats() (engines/base.py BatchingStats)
BATCHING_METRICS = {"generated_tokens": "replica_generated_tokens", "tokens_per_s": "replica_tokens_per_s",
                    "queue_wait_mean_s": "replica_queue_wait_mean_s", "queue_wait_p95_s": "replica_queue_wait_p95_s",
                    "running_mean": "replica_running_mean", "steps": "replica_engine_steps"}


def batching_metrics(per_replica: list[dict] | None) -> dict:
    """The round's batching metrics: `rollout_batching` (continuous | static) and one list per figure, an entry
    per replica in replica order; all None for remote servers (rollout.engine openai), which batch for themselves."""
    if per_replica is None:
        return {"rollout_batching": None, **dict.fromkeys(BATCHING_METRICS.values())}
    return {"rollout_batching": per_replica[0]["batching"],
            **{key: [r[figure] for r in per_replica] for figure, key in BATCHING_METRICS.items()}}


class EnvironmentFailed(OperationFailed):
    """More trajectories of a round could not start their environment than rollout.max_env_error_frac allows."""


class RolloutWorker:
    """want_q: (need, have) requests to the learner's publisher for a weight-bus sync, None at the end;
    replica_qs: the replica processes' (request queues, reply queue) when devices.rollout names several;
    run_dir: where journaled rounds' trajectories are written as they end (rl/journal.py; None: nowhere);
    resumed: a resumed run's journaled trajectories of its first round, sent again instead of generated."""

    def __init__(self, cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, out_q, want_q,
                 report_q, bus_addr, replica_qs=None, run_dir: str | None = None,
                 resumed: list[TrajectoryDone] | tuple = ()):
        self.cfg, self.out_q, self.want_q, self.report_q = cfg, out_q, want_q, report_q
        self.journal = Journal(run_dir) if run_dir is not None else None
        self.resumed = list(resumed)
        ro = cfg.rollout
        self.pool = make_pool(cfg, init_dir, policy_dir, start_version, bus_addr, replica_qs,
                              log=lambda line: report_q.put(("log", "rollout", line)))
        self.device = self.pool.device  # where this process's own engine is, if it has one
        self.renderer = make_renderer(load_tokenizer(init_dir), cfg.model.chat_template, ro.thinking)
        if ro.engine == "openai":  # remote servers hold whatever they loaded: start them on the run's weights
            self._sync(start_version, -1)
        self.tasks = load_task_table(cfg.data.train, cfg.data.limit)
        self.base_images = parse_base_images(cfg.docker.base_images)  # the images train() built are tagged by it
        self.sampling = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, seed=cfg.seed)
        self.limits = AgentLimits(max_turns=ro.max_turns, max_turn_tokens=ro.max_turn_tokens,
                                  max_trajectory_tokens=ro.max_trajectory_tokens, tool_timeout_s=ro.tool_timeout_s,
                                  wall_clock_s=ro.wall_clock_s)
        self.latency = (ToolLatency.lognormal(ro.tool_latency_median_s, ro.tool_latency_sigma)
                        if ro.tool_latency_median_s > 0 else ToolLatency())
        self.on_policy = cfg.schedule != "async"
        self.max_staleness = 0 if self.on_policy else cfg.offpolicy.max_staleness

    # ---- weights ------------------------------------------------------------------------------
    def take_weights(self, need: int) -> None:
        """Hold weights of version >= need, over the weight bus (rl/weightbus.py).

        On-policy schedules need exactly the previous round's weights (need = round - 1) and ask only
        when they lack them. `async` asks every round and gets the newest published version (the
        learner's publisher waits only when even that is older than `need`), or nothing newer.
        """
        have = self.pool.version
        if self.on_policy and need <= have:
            return
        info = self._sync(need, have)
        if info is not None:
            self.report_q.put(("weights_applied", info["version"], info))

    def _sync(self, need: int, have: int) -> dict | None:
        """Ask the learner's publisher for version >= need and take it into every engine."""
        self.want_q.put(self.pool.want(need, have))
        return self.pool.sync()

    # ---- one round ----------------------------------------------------------------------------
    async def generate_round(self, plan: RoundPlan) -> dict:
        version = self.pool.version  # frozen for the whole round: weights change only between rounds
        sem = asyncio.Semaphore(self.cfg.rollout.concurrency)
        done: list[TrajectoryDone] = []
        started = 0
        env_errors: list[TrajectoryDone] = []
        allowed = self.cfg.rollout.max_env_error_frac * plan.num_trajectories

        async def one(spec: GroupSpec, i: int) -> None:
            nonlocal started
            async with sem:
                started += 1
                msg = await self.run_one(plan.round, version, spec, i)
            if msg.exit_reason.startswith("env_error"):
                env_errors.append(msg)
                if len(env_errors) > allowed:  # before the learner sees it: no step on a broken environment
                    raise EnvironmentFailed(
                        f"round {plan.round}: {len(env_errors)} of {plan.num_trajectories} trajectories could not start "
                        f"their environment (first: task {env_errors[0].task_key}: "
                        f"{env_errors[0].exit_reason.removeprefix('env_error: ')}); rollout.max_env_error_frac is "
                        f"{self.cfg.rollout.max_env_error_frac:g}: check the task with `tsrl env exec`, or raise it")
            if plan.journal and self.journal is not None:  # durable before the learner sees it
                self.journal.write(msg)
            self.out_q.put(msg)
            done.append(msg)
            self.report_q.put(("progress", "rollout", {"round": plan.round, "done": len(done),
                                                       "in_flight": started - len(done),
                                                       "total": plan.num_trajectories}))
            hold_after_if_asked(plan.round, len(done))

        start = time.monotonic()
        replayed = self.replay(plan.round)  # a resumed round: what the journal holds, sent again
        done += replayed
        env_errors += [m for m in replayed if m.exit_reason.startswith("env_error")]
        have = {m.rollout.key for m in replayed}
        await asyncio.gather(*(one(g, i) for g in plan.groups for i in range(g.size) if (g.group_id, i) not in have))
        end = time.monotonic()
        stats = self.pool.stats()
        rewards = [m.rollout.reward for m in done]
        report = {
            "version": version, "gen_start": start, "gen_end": end,
            "last_finished": max(m.finished_at for m in done),
            "trajectories": len(done),
            "tokens": sum(len(m.rollout.input_ids) for m in done),
            "loss_tokens": sum(m.rollout.num_loss_tokens for m in done),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "turns_mean": statistics.fmean(m.num_turns for m in done),
            "exit_reasons": dict(Counter(m.exit_reason.split(":")[0] for m in done)),
            "env_errors": len(env_errors), "resumed_trajectories": len(replayed),
            "tool_call_errors": sum(len(m.tool_call_errors) for m in done),
            "tool_call_error_kinds": dict(Counter(k for m in done for k in m.tool_call_errors)),
            # what this side sampled, per trajectory in key order (events.jsonl `sampled`: the bias audit's reference)
            "sampled": {"tasks": dict(Counter(m.task_key for m in done)),
                        "tokens": [len(m.rollout.input_ids) for m in sorted(done, key=lambda m: m.rollout.key)],
                        "turns": [m.num_turns for m in sorted(done, key=lambda m: m.rollout.key)]},
            "tool_s": sum(m.tool_s for m in done), "injected_s": sum(m.injected_s for m in done),
            "engine": self.pool.name, **stats, "batching": batching_metrics(stats["batching"]),
        }
        if self.cfg.run.save_rollouts:
            report["rollouts"] = [{**m.rollout.to_json(), "round": plan.round, "policy_version": m.policy_version}
                                  for m in sorted(done, key=lambda m: m.rollout.key)]
        return report

    def replay(self, round_: int) -> list[TrajectoryDone]:
        """The resumed trajectories of this round, sent as they were when they ended (OPD: their closed turns
        first, which the teacher scores again), stamped now: the learner's work on them is this round's."""
        out = []
        for m in (m for m in self.resumed if m.round == round_):
            t = time.monotonic()
            if self.cfg.objective == "opd":
                for turn in closed_turns(m, t):
                    self.out_q.put(turn)
            m = dataclasses.replace(m, finished_at=t)
            self.out_q.put(m)
            out.append(m)
        return out

    async def run_one(self, round_: int, version: int, spec: GroupSpec, i: int) -> TrajectoryDone:
        opd = self.cfg.objective == "opd"

        def on_turn(traj, k: int, last: bool) -> None:  # OPD: the turn goes to the teacher as it closes
            end = traj.turn_spans[k][1]
            self.out_q.put(TurnClosed(round_, version, spec.group_id, i, k, traj.input_ids[:end],
                                      traj.loss_mask[:end], list(traj.turn_spans), time.monotonic(), last))

        env = make_task_env(self.tasks[spec.task_key], self.cfg.rollout.executor, self.base_images)
        generate = self.pool.generate
        if self.cfg.rollout.agent == "oracle":  # the task's reference solution as the model's turns
            generate = OracleSession(self.renderer, env.oracle_command(), version, spec.task_key).generate
        try:
            try:
                await env.start()
            except Exception as e:  # noqa: BLE001 - a sandbox that cannot start: counted, and over the cap the run stops
                ids = self.renderer.prompt(self.renderer.system_prompt, env.instruction)
                ro = Rollout(spec.group_id, i, ids, [0] * len(ids), 0.0, [], behavior_logprobs=[0.0] * len(ids))
                return TrajectoryDone(round_, version, ro, spec.task_key, f"env_error: {type(e).__name__}: {e}", 0,
                                      time.monotonic())
            res = await run_agent(env, generate, self.renderer, group_id=spec.group_id, sample_index=i,
                                  sampling=self.sampling, limits=self.limits, seed_key=(round_, spec.group_id, i),
                                  latency=self.latency, on_turn=on_turn if opd else None)
        finally:
            await env.close()
        if any(v != version for v in res.policy_versions):
            raise RuntimeError(f"policy version changed inside round {round_}: {set(res.policy_versions)} != {version}")
        tools = [e for e in res.events if e["event"] == "tool"]
        rollout = res.rollout
        if self.cfg.rollout.unsubmitted_reward is not None and res.exit_reason != "submitted":
            rollout = dataclasses.replace(rollout, reward=float(self.cfg.rollout.unsubmitted_reward))
        return TrajectoryDone(round_, version, rollout, spec.task_key, res.exit_reason, res.num_turns,
                              time.monotonic(), sum(e["duration_s"] for e in tools),
                              sum(e["injected_latency_s"] for e in tools), tuple(res.tool_call_errors))

    def run(self, plans: list[RoundPlan]) -> None:
        for plan in plans:
            self.take_weights(need=plan.round - 1 - self.max_staleness)
            hold_if_asked(plan.round)
            reset_peak_rss()
            reset_peak_device(self.device)
            report = asyncio.run(self.generate_round(plan))
            report["peak_rss"] = peak_rss_bytes()
            report["peak_device"] = peak_device_bytes(self.device)
            self.report_q.put(("rollout_round", plan.round, report))
        # The last round ends with its weight sync (on-policy); async leaves the newest weights unused.
        if self.on_policy:
            self.take_weights(need=plans[-1].round)
        self.want_q.put(None)  # the learner's publisher may stop
        self.pool.close()


def rollout_main(cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, plans, out_q, want_q,
                 report_q, go, bus_addr, replica_qs=None, run_dir=None, resumed=()) -> None:
    """`go` (an Event) is set once every process is ready, so round 1 measures no start-up."""
    init_worker()
    worker = RolloutWorker(cfg, init_dir, policy_dir, start_version, out_q, want_q, report_q, bus_addr, replica_qs,
                           run_dir, resumed)
    report_q.put(("ready", "rollout", None))
    go.wait()
    with sigterm_raises():  # failed or terminated: the engine's own processes (vLLM) still end
        try:
            worker.run(plans)
        finally:
            worker.pool.end()
