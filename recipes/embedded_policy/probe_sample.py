"""Probe a policy on one fixed random sample of the embedded training tasks (8 samples at T=1, on a
sample instead of all 400 tasks, which take hours here).

`tsrl policy probe --limit N` takes the first N tasks of each set, which are few repositories; this
draws 20 repair and 10 terminal tasks with a fixed seed instead. Prints one JSON line (the probe's
summary, without the per-trajectory results).

  OMP_NUM_THREADS=1 .venv/bin/python recipes/embedded_policy/probe_sample.py data/embedded_policy/student
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch


def main() -> None:
    from dataclasses import replace

    from tsrl_cli.datasets.store import open_dataset
    from tsrl_cli.evals.probe import probe_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--data", default="data")
    ap.add_argument("--repair", type=int, default=20)
    ap.add_argument("--terminal", type=int, default=10)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--draw-seed", type=int, default=1, help="seed of the task sample (1 in results/LOG.md)")
    ap.add_argument("--out", default=None, help="records folder (default results/probe/<model folder>; resumable)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sets = []
    for name, n in (("embedded_repair_train", a.repair), ("embedded_terminal_train", a.terminal)):
        ds = open_dataset(Path(a.data) / name)
        sets.append(replace(ds, tasks=random.Random(a.draw_seed).sample(ds.tasks, n)))
    r = probe_policy(a.model, sets, samples=a.samples, temperature=1.0, seed=0, out_dir=a.out)
    r.pop("results")
    print(json.dumps({"model": a.model, **r}))


if __name__ == "__main__":
    main()
