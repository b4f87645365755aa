"""Measure what the core's docs claim: float32 accuracy with offset rewards, and buffer memory.

Run:  .venv/bin/python experiments/numerics_and_memory.py [--seeds 0 1 2] [--json]

1. Accuracy (GRPO, token-mean, built-in tiny Qwen3, 3 groups x 8): rewards offset + 0.01*noise.
   The float64 lazy gradient of the same weights is the reference. Reported: relative error of
   the float32 lazy path, the float32 streamed path, and the naive streamed form (baseline 0),
   all from one run, as ratios to the lazy error.
2. Memory: peak bytes of open-group buffers by arrival order and --max-open-groups cap, in units
   of one parameter-sized buffer set.
3. Cost: wall time of the stream path over the lazy path (both on this CPU, one thread), which is
   the price of one backward per trajectory instead of one batched backward.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter

import torch

from tsrl_cli.config import LossConfig
from tsrl_cli.core.accumulator import RoundGradAccumulator
from tsrl_cli.policy import build_tiny_model
from tsrl_cli.rl.learner import Objective, StreamLearner
from tsrl_cli.verify import compare, lazy_and_stream, random_rollouts


def offset_round(seed: int, offset: float):
    ro = [r for r in random_rollouts(128, 3, 8, seed)]
    rng = random.Random(seed)
    for r in ro:
        r.reward = offset + 0.01 * rng.gauss(0, 1)
    return ro


def naive_stream(model, ro, obj, seed):
    learner = StreamLearner(model, obj, Counter(r.group_id for r in ro))
    learner.acc = RoundGradAccumulator(learner.params, center_on_first_reward=False)
    order = list(ro)
    random.Random(seed).shuffle(order)
    for r in order:
        learner.on_trajectory(r)
        learner.drain()  # per arrival
    return learner.close_round()


def accuracy(seeds):
    rows = []
    obj = Objective()
    for offset in (0.0, 100.0, 1e4):
        for seed in seeds:
            ro = offset_round(seed, offset)
            ref = lazy_and_stream(build_tiny_model(0, torch.float64), ro, obj).lazy
            m32 = build_tiny_model(0, torch.float32)
            pair = lazy_and_stream(m32, ro, obj, order="random", seed=seed)
            naive = naive_stream(m32, ro, obj, seed)
            errs = [compare(pair.names, ref, g)["max_rel_diff"] for g in (pair.lazy, pair.stream, naive)]
            rows.append(dict(offset=offset, seed=seed, lazy32=errs[0], stream32=errs[1], naive32=errs[2]))
    return rows


def memory_and_cost():
    model = build_tiny_model(0, torch.float32)
    ro = random_rollouts(128, 8, 8, 0)
    rows = []
    for order, cap in (("given", None), ("random", None), ("random", 4), ("random", 1), ("random", 0)):
        pair = lazy_and_stream(model, ro, Objective("grpo", LossConfig(max_open_groups=cap)), order=order, seed=0)
        acc = pair.learner.acc
        rows.append(dict(order=order, max_open_groups=cap, peak_sets=acc.peak_open_bytes / acc.param_bytes,
                         peak_mib=acc.peak_open_bytes / 2**20,
                         stream_over_lazy_time=pair.time_stream_s / pair.time_lazy_s))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    acc_rows, mem_rows = accuracy(a.seeds), memory_and_cost()
    if a.json:
        print(json.dumps({"accuracy": acc_rows, "memory": mem_rows}))
        return
    print("offset  seed  lazy32     stream32   naive32    stream/lazy  naive/lazy")
    for r in acc_rows:
        print(f"{r['offset']:>6g}  {r['seed']:>4}  {r['lazy32']:.2e}   {r['stream32']:.2e}   {r['naive32']:.2e}   "
              f"{r['stream32'] / r['lazy32']:>10.2f}  {r['naive32'] / r['lazy32']:>10.1f}")
    print("\norder   cap   peak buffer sets  peak MiB  stream/lazy time")
    for r in mem_rows:
        print(f"{r['order']:<7} {r['max_open_groups']!s:<5} {r['peak_sets']:>16.0f}  {r['peak_mib']:>8.2f}  "
              f"{r['stream_over_lazy_time']:>16.2f}")


if __name__ == "__main__":
    main()
