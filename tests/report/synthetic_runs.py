"""A synthetic results tree in the run-directory format (docs/run-directory.md), made in the test.

Each round: `items` arrivals at lognormal times (sigma = the experiment's spread), each costing
`cost_s` of learner work; sync does one batch backward after the last arrival, stream runs each
item on arrival (FIFO, one learner). A fixed 2 % overhead on the measured step time keeps
predicted and measured apart by a known amount.
"""

import json
import math
import random

OVERHEAD = 1.02
STEP_S, SYNC_S = 0.05, 0.02
MODEL, TASKS = "builtin:toy", "builtin:echo"  # what config.yaml names: the report's setup label reads them


def _round(rng, sigma, items, cost_s, schedule, rnd):
    arrivals = sorted(math.exp(sigma * rng.gauss(0, 1)) for _ in range(items))
    tokens = [rng.randint(50, 150) for _ in range(items)]
    ev, t = [], 0.0
    for k, (a, tok) in enumerate(zip(arrivals, tokens, strict=True)):
        row = {"round": rnd, "event": "item", "id": f"r{rnd}-{k}", "group_id": f"g{rnd}", "sample_index": k,
               "turn": None,
               "finished_at_s": a, "tokens": 2 * tok, "loss_tokens": tok, "staleness": 0, "reward": 1.0,
               "backward_start_s": None, "backward_end_s": None, "learner_cost_s": None}
        if schedule == "stream":
            start = max(a, t)
            t = start + cost_s * tok / 100
            row.update(backward_start_s=start, backward_end_s=t, learner_cost_s=t - start)
        ev.append(row)
    if schedule == "sync":
        start = arrivals[-1]
        t = start + sum(cost_s * tok / 100 for tok in tokens)
        ev.append({"round": rnd, "event": "batch_backward", "start_s": start, "end_s": t, "items": items,
                   "loss_tokens": sum(tokens)})
    ev.append({"round": rnd, "event": "group_close", "group_id": f"g{rnd}", "at_s": arrivals[-1]})
    ev.append({"round": rnd, "event": "step", "start_s": t, "end_s": t + STEP_S})
    ev.append({"round": rnd, "event": "weight_sync", "start_s": t + STEP_S, "end_s": t + STEP_S + SYNC_S})
    step_time = (t + STEP_S + SYNC_S) * OVERHEAD
    ev.append({"round": rnd, "event": "round_end", "at_s": step_time, "learners": 1})
    busy = sum(cost_s * tok / 100 for tok in tokens) + STEP_S
    return ev, arrivals[-1], busy, step_time


def make_run(d, experiment, schedule, seed, sigma, rounds=8, items=6, cost_s=0.3, done=True, rollout="cpu",
             learner="cpu", model=MODEL):
    """One run directory; rollout/learner are its config's device specs (core_s always counts 2 processes)."""
    d.mkdir(parents=True)
    rng = random.Random(seed * 1000 + int(sigma * 100))  # same workload for sync and stream of a seed
    (d / "config.yaml").write_text(f"name: {experiment}\nobjective: grpo\nschedule: {schedule}\nseed: {seed}\n"
                                   f"model:\n  policy: {model}\ndata:\n  train: [{TASKS}]\n"
                                   f"rollout:\n  tool_latency_sigma: {sigma}\n  group_size: {items}\n"
                                   f"devices:\n  rollout: '{rollout}'\n  learner: '{learner}'\n  teacher: null\n")
    metrics, events, wall = [], [], 0.0
    for rnd in range(1, rounds + 1):
        ev, makespan, busy, step_time = _round(rng, sigma, items, cost_s, schedule, rnd)
        events += ev
        wall += step_time
        reward = min(1.0, 0.1 + 0.08 * rnd + 0.02 * rng.random())
        metrics.append({
            "round": rnd, "schedule": schedule, "objective": "grpo", "seed": seed, "policy_version": rnd - 1,
            "step_time_s": step_time, "rollout_makespan_s": makespan, "learner_busy_s": busy,
            "learner_idle_frac": 1 - busy / step_time,
            "last_arrival_to_step_s": step_time / OVERHEAD - makespan - SYNC_S,
            "optimizer_step_s": STEP_S, "weight_sync_s": SYNC_S, "staleness_mean": 0.0, "staleness_max": 0,
            "peak_mem_rollout_bytes": 2_000_000_000, "peak_mem_learner_bytes":
                3_000_000_000 + (150_000_000 if schedule == "stream" else 0) + seed * 1000,
            "accumulator_peak_bytes": 150_000_000 if schedule == "stream" else 0, "trajectories": items,
            "tokens": 1000, "loss_tokens": 500, "reward_mean": reward, "reward_std": 0.1, "loss": 0.5,
            "grad_norm": 1.0, "wall_s": wall, "core_s": 2 * wall,
        })
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if done:
        (d / "DONE").write_text(json.dumps({"rounds": rounds}))


def make_tree(root, experiments=(("spread_low", 0.2), ("spread_high", 1.0)), schedules=("sync", "stream"),
              seeds=(42, 43, 44), rounds=8, **run):
    for exp, sigma in experiments:
        for sched in schedules:
            for seed in seeds:
                make_run(root / exp / sched / f"seed{seed}", exp, sched, seed, sigma, rounds, **run)
    return root
