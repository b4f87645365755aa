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
import statistics
import time
from collections import Counter
from dataclasses import dataclass

from tsrl_cli.agent.latency import ToolLatency
from tsrl_cli.agent.loop import AgentLimits, run_agent
from tsrl_cli.agent.oracle import OracleSession
from tsrl_cli.agent.template import make_renderer
from tsrl_cli.config import TrainConfig, parse_base_images
from tsrl_cli.engines.protocol import SamplingParams
from tsrl_cli.errors import OperationFailed
from tsrl_cli.policy import load_tokenizer
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
    sigterm_raises,
)
from tsrl_cli.rl.faults import fail_start_if_asked, hold_after_if_asked, hold_if_asked
from tsrl_cli.rl.journal import Journal, closed_turns
from tsrl_cli.rl.placement import Placement
from tsrl_cli.rl.replicas import make_pool
from tsrl_cli.rl.reports import Batching, Report, RolloutReport, Sampled, WeightSync
from tsrl_cli.rl.tasks import load_task_table, make_task_env
from tsrl_cli.rl.types import GroupSpec, RoundPlan, TrajectoryDone, TurnClosed
from tsrl_cli.rollouts import Rollout


class EnvironmentFailed(OperationFailed):
    """More trajectories of a round could not start their environment than rollout.max_env_error_frac allows."""


class RolloutWorker:
    """want_q: (need, have) requests to the learner's publisher for a weight-bus sync, None at the end;
    placement: the run's (rl/placement.py; None: this config's, without a weight bus);
    replica_qs: the replica processes' (request queues, reply queue) when devices.rollout names several;
    run_dir: where journaled rounds' trajectories are written as they end (rl/journal.py; None: nowhere);
    resumed: a resumed run's journaled trajectories of its first round, sent again instead of generated."""

    def __init__(self, cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, out_q, want_q,
                 report_q, placement: Placement | None = None, replica_qs=None, run_dir: str | None = None,
                 resumed: list[TrajectoryDone] | tuple = ()):
        self.cfg, self.out_q, self.want_q, self.report_q = cfg, out_q, want_q, report_q
        self.journal = Journal(run_dir) if run_dir is not None else None
        self.resumed = list(resumed)
        ro = cfg.rollout
        self.pool = make_pool(cfg, placement or Placement.of(cfg), init_dir, policy_dir, start_version, replica_qs,
                              log=lambda line: report_q.put((Report.log, "rollout", line)))
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
            self.report_q.put((Report.weights_applied, info["version"],
                               WeightSync(info["start"], info["end"], info["bytes"], info["hosts"])))

    def _sync(self, need: int, have: int) -> dict | None:
        """Ask the learner's publisher for version >= need and take it into every engine."""
        self.want_q.put(self.pool.want(need, have))
        return self.pool.sync()

    # ---- one round ----------------------------------------------------------------------------
    async def generate_round(self, plan: RoundPlan) -> RolloutReport:
        version = self.pool.version  # frozen for the whole round: weights change only between rounds
        sem = asyncio.Semaphore(self.cfg.rollout.concurrency)
        done: list[TrajectoryDone] = []
        started = 0
        failed: list[TrajectoryDone] = []  # infrastructure failures: masked out of their groups and the loss
        allowed = self.cfg.rollout.max_env_error_frac * plan.num_trajectories

        async def one(k: int, spec: GroupSpec, i: int) -> None:
            nonlocal started
            async with sem:
                started += 1
                msg = await self.run_one(plan.round, version, spec, i, group_index=k)
            if msg.rollout.masked:
                failed.append(msg)
                if len(failed) > allowed:  # before the learner sees it: no step on a broken infrastructure
                    first = failed[0].exit_reason.split(": ", 1)
                    raise EnvironmentFailed(
                        f"round {plan.round}: {len(failed)} of {plan.num_trajectories} trajectories failed for their "
                        f"infrastructure (first: task {failed[0].task_key}: {first[0]}: {first[-1]}); "
                        f"rollout.max_env_error_frac is {self.cfg.rollout.max_env_error_frac:g}: check the task with "
                        "`tsrl env exec` (and the engines), or raise it")
            if plan.journal and self.journal is not None:  # durable before the learner sees it
                self.journal.write(msg)
            self.out_q.put(msg)
            done.append(msg)
            self.report_q.put((Report.progress, "rollout", {"round": plan.round, "done": len(done),
                                                            "in_flight": started - len(done),
                                                            "total": plan.num_trajectories}))
            hold_after_if_asked(plan.round, len(done))

        start = time.monotonic()
        replayed = self.replay(plan.round)  # a resumed round: what the journal holds, sent again
        done += replayed
        failed += [m for m in replayed if m.rollout.masked]
        have = {m.rollout.key for m in replayed}
        await asyncio.gather(*(one(k, g, i) for k, g in enumerate(plan.groups) for i in range(g.size)
                               if (g.group_id, i) not in have))
        end = time.monotonic()
        stats = self.pool.stats()
        rewards = [m.rollout.reward for m in done]
        in_order = sorted(done, key=lambda m: m.rollout.key)
        return RolloutReport(
            version=version, gen_start=start, gen_end=end, last_finished=max(m.finished_at for m in done),
            trajectories=len(done), tokens=sum(len(m.rollout.input_ids) for m in done),
            loss_tokens=sum(m.rollout.num_loss_tokens for m in done), reward_mean=statistics.fmean(rewards),
            reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            turns_mean=statistics.fmean(m.num_turns for m in done),
            exit_reasons=dict(Counter(m.exit_reason.split(":")[0] for m in done)),
            env_errors=sum(m.exit_reason.startswith("env_error") for m in done), masked_trajectories=len(failed),
            resumed_trajectories=len(replayed),
            tool_call_errors=sum(len(m.tool_call_errors) for m in done),
            tool_call_error_kinds=dict(Counter(k for m in done for k in m.tool_call_errors)),
            # what this side sampled, per trajectory in key order (events.jsonl `sampled`: the bias audit's reference)
            sampled=Sampled(tasks=dict(Counter(m.task_key for m in done)),
                            tokens=[len(m.rollout.input_ids) for m in in_order], turns=[m.num_turns for m in in_order]),
            tool_s=sum(m.tool_s for m in done), injected_s=sum(m.injected_s for m in done),
            engine=self.pool.name, replicas=stats["replicas"], batching=Batching.of(stats["batching"]),
            replica_requests=stats.get("replica_requests"), peak_rss_replicas=stats.get("peak_rss_replicas"),
            peak_device_replicas=stats.get("peak_device_replicas"),
            rollouts=[{**m.rollout.to_json(), "round": plan.round, "policy_version": m.policy_version}
                      for m in in_order] if self.cfg.run.save_rollouts else None)

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

    async def run_one(self, round_: int, version: int, spec: GroupSpec, i: int, group_index: int = 0) -> TrajectoryDone:
        """Sample i of group `spec`. A sandbox that does not start, or an engine that fails, ends it as an
        infrastructure failure (Rollout.masked, exit env_error / engine_error): out of its group and the loss."""
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
                fail_start_if_asked(round_, group_index, i)
                await env.start()
            except Exception as e:  # noqa: BLE001 - a sandbox that cannot start: masked, and over the cap the run stops
                ids = self.renderer.prompt(self.renderer.system_prompt, env.instruction)
                ro = Rollout(spec.group_id, i, ids, [0] * len(ids), 0.0, [], behavior_logprobs=[0.0] * len(ids),
                             masked=True)
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
        if res.exit_reason.startswith("engine_error"):  # the engine failed, not the agent
            rollout = dataclasses.replace(rollout, masked=True)
        elif self.cfg.rollout.unsubmitted_reward is not None and res.exit_reason != "submitted":
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
            report.peak_rss, report.peak_device = peak_rss_bytes(), peak_device_bytes(self.device)
            self.report_q.put((Report.rollout_round, plan.round, report))
        # The last round ends with its weight sync (on-policy); async leaves the newest weights unused.
        if self.on_policy:
            self.take_weights(need=plans[-1].round)
        self.want_q.put(None)  # the learner's publisher may stop
        self.pool.close()


@dataclass(frozen=True)
class RolloutArgs:
    """What the rollout process starts from (rl/train.py Workers)."""

    cfg: TrainConfig
    placement: Placement
    init_dir: str
    policy_dir: str
    start_version: int
    plans: list[RoundPlan]
    out_q: object  # trajectories (GRPO) or closed turns (OPD) leave here
    want_q: object  # sync requests to the learner's publisher
    report_q: object
    go: object  # an Event, set once every process is ready: round 1 measures no start-up
    replica_qs: tuple | None = None  # the replica processes' (request queues, reply queue)
    run_dir: str | None = None
    resumed: tuple[TrajectoryDone, ...] = ()


def rollout_main(args: RolloutArgs) -> None:
    init_worker()
    worker = RolloutWorker(args.cfg, args.init_dir, args.policy_dir, args.start_version, args.out_q, args.want_q,
                           args.report_q, args.placement, args.replica_qs, args.run_dir, args.resumed)
    args.report_q.put((Report.ready, "rollout", None))
    args.go.wait()
    with sigterm_raises():  # failed or terminated: the engine's own processes (vLLM) still end
        try:
            worker.run(args.plans)
        finally:
            worker.pool.end()
