"""One micro-batch of 8 GRPO rows through the streaming learner, padded against packed, on this machine's
default attention (sdpa on the CPU): the learner's time for each, medians of `--repeats` alternated runs.

    .venv/bin/python experiments/packing.py [--hidden 256] [--layers 4] [--repeats 3] [--json]

Three length spreads (uniform in lo-hi tokens, a 40-token prompt): each prints the padded/real position
ratio and the two medians. learner.packing=auto (rl/learner.py `packs`) follows what this measures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tsrl_cli.policy import build_tiny_model
from tsrl_cli.rl.learner import Objective, StreamLearner
from tsrl_cli.rollouts import Rollout

SPREADS = ((100, 300), (100, 600), (300, 400))
ROWS, PROMPT, VOCAB = 8, 40, 4096


def rollouts(rng: random.Random, lo: int, hi: int) -> list[Rollout]:
    out = []
    for i in range(ROWS):
        n = rng.randint(lo, hi)
        ids = [rng.randrange(VOCAB) for _ in range(n)]
        out.append(Rollout("g", i, ids, [0] * PROMPT + [1] * (n - PROMPT), float(i % 2), [(PROMPT, n)]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)  # one thread per process (two beside a busy process ran far slower here)
    model = build_tiny_model(0, torch.float32, hidden=a.hidden, layers=a.layers, vocab_size=VOCAB,
                             max_positions=1024)
    rng, rows_out = random.Random(0), []
    for lo, hi in SPREADS:
        rows = rollouts(rng, lo, hi)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeats):
            for packed in (False, True):  # alternated, so the machine's load falls on both
                learner = StreamLearner(model, Objective("grpo"), {"g": ROWS}, packed=packed)
                for r in rows:
                    learner.on_trajectory(r)
                t0 = time.perf_counter()
                learner.drain()
                times[packed].append(time.perf_counter() - t0)
                learner.close_round()
        real = sum(len(r.input_ids) for r in rows)
        rows_out.append({"lengths": f"{lo}-{hi}", "padded_over_real": ROWS * max(len(r.input_ids) for r in rows) / real,
                         "padded_s": statistics.median(times[False]), "packed_s": statistics.median(times[True])})
    if a.json:
        print(json.dumps({"hidden": a.hidden, "layers": a.layers, "repeats": a.repeats, "rows": rows_out}))
        return
    for r in rows_out:
        print(f"lengths {r['lengths']}: padded/real positions {r['padded_over_real']:.2f}; "
              f"padded {r['padded_s']:.3f} s, packed {r['packed_s']:.3f} s, "
              f"packed/padded {r['packed_s'] / r['padded_s']:.2f}")


if __name__ == "__main__":
    main()
