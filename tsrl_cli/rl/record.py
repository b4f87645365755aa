"""What a run writes about itself: each round's metrics.jsonl row and events.jsonl rows, built from the
workers' reports (rl/reports.py), and the run's summary in DONE, built from the metrics rows.

The keys are docs/run-directory.md's, which tsrl report, predict and calibrate read.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

from tsrl_cli.config import TrainConfig
from tsrl_cli.predict import streaming_of
from tsrl_cli.rl.reports import Item, RoundReports, TrajectoryItem, TurnItem, WeightSync
from tsrl_cli.rl.runlog import RunLog
from tsrl_cli.rundir import METRICS


def _stat(xs, fn, default=None):
    xs = [x for x in xs if x is not None]
    return fn(xs) if xs else default


def round_record(cfg: TrainConfig, k: int, reports: RoundReports, t0: float,
                 sync: WeightSync) -> tuple[dict, list[dict]]:
    """The metrics row and the events of round k; times relative to the round start t0. `sync`: the weight
    sync that ends the round. wall_s and core_s are left None for the orchestrator, which knows the run's."""
    ro, le, te = reports.rollout, reports.learner, reports.teacher
    ranks = le.ranks

    def rel(t):
        return None if t is None else t - t0

    step_time = sync.end - t0
    stale = [it.staleness for it in le.items]
    row = {
        "round": k, "schedule": cfg.schedule, "objective": cfg.objective, "seed": cfg.seed,
        "policy_version": ro.version, "step_time_s": step_time, "rollout_makespan_s": le.last_arrival - t0,
        "learner_busy_s": le.busy_s, "learner_idle_frac": 1.0 - le.busy_s / step_time if step_time > 0 else None,
        "last_arrival_to_step_s": le.step.end - le.last_arrival,
        "optimizer_step_s": le.step.end - le.step.start, "weight_sync_s": sync.end - sync.start,
        "staleness_mean": _stat(stale, statistics.fmean), "staleness_max": _stat(stale, max),
        # a learner group's peaks and buffers: rank 0's (every rank's below)
        "peak_mem_rollout_bytes": ro.peak_rss, "peak_mem_learner_bytes": ranks.peak_rss[0],
        "accumulator_peak_bytes": ranks.accumulator_peak_bytes[0],
        # accelerator peaks (torch.cuda.max_memory_allocated; None on CPU) and what the buffers are relative to
        "peak_device_rollout_bytes": ro.peak_device, "peak_device_learner_bytes": ranks.peak_device[0],
        "model_param_bytes": le.model_bytes, "trainable_param_bytes": le.trainable_bytes,
        "trajectories": ro.trajectories, "tokens": ro.tokens, "loss_tokens": ro.loss_tokens,
        "reward_mean": ro.reward_mean, "reward_std": ro.reward_std, "loss": ranks.round_loss,
        "env_errors": ro.env_errors,  # trajectories whose environment did not start
        # infrastructure failures (a sandbox that did not start, an engine that failed): out of the groups and the loss
        "masked_trajectories": ro.masked_trajectories,
        # model turns whose tool call could not be run (agent/toolcalls.py), and how many of each kind
        "tool_call_errors": ro.tool_call_errors, "tool_call_error_kinds": ro.tool_call_error_kinds,
        # trajectories of a round stopped midway, read back from its journal instead of generated (rl/journal.py)
        "resumed_trajectories": ro.resumed_trajectories,
        "grad_norm": le.grad_norm, "wall_s": None, "core_s": None,
        # beyond the contract's required keys
        "exact": cfg.schedule != "async", "turns_mean": ro.turns_mean, "exit_reasons": ro.exit_reasons,
        # weight_bytes: what one engine receives; weight_sync_bytes: what the bus delivered to all of them
        "weight_bytes": le.publish.bytes, "weight_sync_bytes": sync.bytes,
        "weight_sync_hosts": sync.hosts, "rollout_engine": ro.engine,
        "rollout_replicas": ro.replicas, "replica_requests": ro.replica_requests,
        **asdict(ro.batching),  # rollout_batching and the replica_* lists
        "learner_ranks": le.learners, "microbatches": le.microbatches,
        # the learner's token positions this round, padding included, and its rows' own (packing: equal)
        "learner_positions": le.work.positions, "learner_real_positions": le.work.real_positions,
        # per learner rank, in rank order (one entry on a single-device learner)
        "peak_mem_learner_rank_bytes": ranks.peak_rss, "peak_device_learner_rank_bytes": ranks.peak_device,
        "accumulator_peak_rank_bytes": ranks.accumulator_peak_bytes,
        "accumulator_set_rank_bytes": ranks.accumulator_set_bytes,  # one buffer set (S_r, S_1, R ...)
        "backwards_rank": ranks.backwards,
    }
    if te is not None:
        row["peak_mem_teacher_bytes"] = te.peak_rss
        row["peak_device_teacher_bytes"] = te.peak_device
        row["teacher_busy_s"] = te.busy_s
        row["opd_reverse_kl"] = le.opd_reverse_kl
    if le.checkpoint:
        row["checkpoint_s"] = le.checkpoint_s
    if le.verify is not None:  # a certified round (run.verify_every, rl/certificate.py)
        row["verify_rel_diff"], row["verify_s"] = le.verify.verify_rel_diff, le.verify.verify_s
    stream = cfg.schedule == "stream"
    events = [{"round": k, "event": "item", "id": it.id, "group_id": it.group_id,
               "sample_index": it.sample_index, "turn": it.turn, "finished_at_s": rel(it.finished_at),
               "backward_start_s": rel(it.backward_start), "backward_end_s": rel(it.backward_end),
               # stream: this item's share (by loss tokens) of the micro-batch it was backwarded in
               "learner_cost_s": (it.backward_end - it.backward_start) * it.share if stream else None,
               "tokens": it.tokens, "loss_tokens": it.loss_tokens, "staleness": it.staleness,
               "reward": it.reward, **_turn_timing(it, rel), **_trajectory_end(it),
               "deferred": it.deferred} for it in le.items]
    # OPD: each trajectory's end as the learner received it (GRPO's item row is its trajectory)
    events += [{"round": k, "event": "trajectory", "id": t.id, "group_id": t.group_id, "sample_index": t.sample_index,
                "tokens": t.tokens, "loss_tokens": t.loss_tokens, "staleness": t.staleness, "reward": t.reward,
                "turns": t.turns, "exit": t.exit, "finished_at_s": rel(t.finished_at)} for t in le.trajectories]
    # the rollout side's own tally: the bias audit's reference (tsrl report)
    events.append({"round": k, "event": "sampled", **asdict(ro.sampled)})
    if le.batch is not None:
        b = le.batch
        events.append({"round": k, "event": "batch_backward", "start_s": rel(b.start), "end_s": rel(b.end),
                       "items": b.items, "loss_tokens": b.loss_tokens, "padded": b.padded})
    events += [{"round": k, "event": "group_close", "group_id": g.group_id, "at_s": rel(g.at)} for g in le.group_close]
    # the rollout side's generation of this round's data (async: it starts before the round does)
    events.append({"round": k, "event": "rollout", "start_s": rel(ro.gen_start), "end_s": rel(ro.gen_end)})
    events.append({"round": k, "event": "step", "start_s": rel(le.step.start), "end_s": rel(le.step.end)})
    events.append({"round": k, "event": "weight_sync", "start_s": rel(sync.start), "end_s": rel(sync.end)})
    events.append({"round": k, "event": "learner_work", "backwards": ranks.backwards[0],
                   "microbatches": le.microbatches, **asdict(le.work)})
    if te is not None:
        events.append({"round": k, "event": "teacher", "busy_s": te.busy_s, "busy_cpu_s": te.busy_cpu_s,
                       "turns": te.turns, "positions": te.positions})
    events.append({"round": k, "event": "round_end", "at_s": step_time, "learners": le.learners})
    return row, events


def _trajectory_end(it: Item) -> dict:
    """GRPO items (whole trajectories): their model turns and why they ended. Absent on OPD turn items."""
    return {"turns": it.turns, "exit": it.exit} if isinstance(it, TrajectoryItem) else {}


def _turn_timing(it: Item, rel) -> dict:
    """OPD turn items: when the rollout closed the turn, when the teacher started scoring it (its scores
    arrived at finished_at_s), the prefix its backward row covers, and whether it was known to be its
    trajectory's last as it closed. Absent on GRPO items."""
    if not isinstance(it, TurnItem):
        return {}
    return {"closed_at_s": rel(it.closed_at), "teacher_start_s": rel(it.teacher_start),
            "prefix_tokens": it.prefix_tokens, "last": it.last}


def certificate_summary(rows: list[dict]) -> dict:
    """The exactness certificate over a run's rows: rounds certified, the largest verify_rel_diff, and
    verify_s as a share of learner busy time over those rounds (None without certified rounds)."""
    done = [r for r in rows if r.get("verify_rel_diff") is not None]
    busy = sum(r["learner_busy_s"] for r in done)
    return {"verify_rounds": len(done), "verify_rel_diff_max": _stat([r["verify_rel_diff"] for r in done], max),
            "verify_share_of_learner": sum(r["verify_s"] for r in done) / busy if done and busy > 0 else None}


def summarize(cfg: TrainConfig, run: RunLog) -> dict:
    """The run's summary (DONE) from its metrics rows."""
    rows = run.rows(METRICS)
    warm = rows[1:] if len(rows) > 1 else rows  # round 1 pays one-off costs (first batches, allocator)
    ckpts = run.checkpoints()
    return {
        "run_dir": str(run.root), "name": cfg.name, "objective": cfg.objective, "schedule": cfg.schedule,
        "seed": cfg.seed, "rounds": len(rows), "exact": cfg.schedule != "async",
        "step_time_median_s": _stat([r["step_time_s"] for r in warm], statistics.median),
        "step_time_mean_s": _stat([r["step_time_s"] for r in warm], statistics.fmean),
        "learner_idle_frac_mean": _stat([r["learner_idle_frac"] for r in warm], statistics.fmean),
        "rollout_makespan_median_s": _stat([r["rollout_makespan_s"] for r in warm], statistics.median),
        "reward_first": rows[0]["reward_mean"] if rows else None,
        "reward_last": rows[-1]["reward_mean"] if rows else None,
        "reward_mean": _stat([r["reward_mean"] for r in rows], statistics.fmean),
        "staleness_max": _stat([r["staleness_max"] for r in rows], max),
        "peak_mem_learner_bytes": _stat([r["peak_mem_learner_bytes"] for r in rows], max),
        "accumulator_peak_bytes": _stat([r["accumulator_peak_bytes"] for r in rows], max),
        **certificate_summary(rows),
        "wall_s": rows[-1]["wall_s"] if rows else 0.0, "core_s": rows[-1]["core_s"] if rows else 0.0,
        "checkpoint": str(ckpts[max(ckpts)]) if ckpts else None,
        # what streaming bought (or would buy): the event model on this run's own trace
        "streaming": streaming_of(run.root),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
