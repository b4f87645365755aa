"""The shared-prompt cut (learner.prefix_cut, rl/prefix.py) against whole rows, on this machine: the learner's
positions, LM-head rows and time for GRPO rounds whose groups share long prompts, medians of `--repeats` alternated
runs (float32, a Qwen3-shaped tiny model, one torch thread).

    .venv/bin/python experiments/prefix_cut.py [--hidden 256] [--layers 4] [--vocab 151936] [--repeats 3] [--json]

Two workloads:
  one-group   8 members sharing a 1,000-token prompt, 180-220-token completions, the sync lazy batch (one
              micro-batch per group)
  four-groups 4 groups x 8 members, 500-560-token prompts, 60-140-token completions, as the streamed learner
              runs them one arrival at a time (arrivals shuffled, a drain after each)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tsrl_cli.core import losses
from tsrl_cli.policy import build_tiny_model
from tsrl_cli.rl.learner import Objective, StreamLearner
from tsrl_cli.rollouts import Rollout

WORKLOADS = {"one-group": dict(groups=1, prompt=(1000, 1000), completion=(180, 220), per_item=False),
             "four-groups": dict(groups=4, prompt=(500, 560), completion=(60, 140), per_item=True)}


def rollouts(rng: random.Random, vocab: int, groups: int, prompt, completion) -> list[Rollout]:
    out = []
    for g in range(groups):
        head = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        for i in range(8):
            n = rng.randint(*completion)
            ids = head + [rng.randrange(vocab) for _ in range(n)]
            out.append(Rollout(f"g{g}", i, ids, [0] * len(head) + [1] * n, float(rng.random() < 0.5),
                               [(len(head), len(ids))]))
    return out


def one_round(model, ro, cut: bool, per_item: bool, seed: int) -> dict:
    rows = []
    real_apply = losses._ChunkedHead.apply
    losses._ChunkedHead.apply = lambda h, *a: rows.append(h.shape[0]) or real_apply(h, *a)
    try:
        sl = StreamLearner(model, Objective("grpo"), {r.group_id: 8 for r in ro}, prefix_cut=cut,
                           max_items=1 if per_item else None)
        t0 = time.perf_counter()
        for r in (random.Random(seed).sample(ro, len(ro)) if per_item else ro):
            sl.on_trajectory(r)
            if per_item:
                sl.drain()
        sl.drain()
        sl.close_round()
        dt = time.perf_counter() - t0
    finally:
        losses._ChunkedHead.apply = real_apply
    return {"s": dt, "positions": sum(b.tokens for b in sl.batches), "real": sum(b.real_tokens for b in sl.batches),
            "head_rows": sum(rows), "backwards": sl.backwards}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)  # one thread per process (two beside a busy process ran far slower here)
    model = build_tiny_model(0, torch.float32, hidden=a.hidden, layers=a.layers, vocab_size=a.vocab,
                             max_positions=2048)
    out = {}
    for name, w in WORKLOADS.items():
        ro = rollouts(random.Random(0), a.vocab, w["groups"], w["prompt"], w["completion"])
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for k in range(a.repeats):
            for cut in (False, True):  # alternated, so the machine's load falls on both
                runs[cut].append(one_round(model, ro, cut, w["per_item"], seed=k))
        res = {}
        for cut, rs in runs.items():
            res["cut" if cut else "whole"] = {**{k: rs[0][k] for k in ("positions", "real", "head_rows", "backwards")},
                                              "median_s": statistics.median(r["s"] for r in rs)}
        res["scored_tokens"] = sum(r.num_loss_tokens for r in ro)
        res["prompt_tokens"] = sum(len(r.input_ids) - r.num_loss_tokens for r in ro if r.sample_index == 0)
        res["positions_ratio"] = res["cut"]["positions"] / res["whole"]["positions"]
        res["time_ratio"] = res["cut"]["median_s"] / res["whole"]["median_s"]
        res["cut_padded_over_real"] = res["cut"]["positions"] / res["cut"]["real"]
        out[name] = res
    if a.json:
        print(json.dumps({"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab, "repeats": a.repeats, **out}))
        return
    for name, r in out.items():
        c, w = r["cut"], r["whole"]
        print(f"{name}: positions whole {w['positions']} cut {c['positions']} ({r['positions_ratio']:.3f}x); "
              f"cut padded/real {r['cut_padded_over_real']:.3f}; head rows {c['head_rows']} "
              f"(scored {r['scored_tokens']}); time whole {w['median_s']:.2f} s cut {c['median_s']:.2f} s "
              f"({r['time_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
