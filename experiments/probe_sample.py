"""Probe a policy on one fixed random sample of the embedded training tasks (the issue-4 item-3 setting,
8 samples at T=1, on a sample instead of all 400 tasks, which take tens of minutes here).

`tsrl policy probe --limit N` takes the first N tasks of each set, which are few repositories; this
draws 20 repair and 10 terminal tasks with a fixed seed instead. Prints one JSON line (the probe's
summary, without the per-trajectory results).

  OMP_NUM_THREADS=1 .venv/bin/python experiments/probe_sample.py data/copy_repair_policy/student
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch


def main() -> None:
    from tsrl_cli.embedded.demos import dataset_tasks
    from tsrl_cli.embedded.sft import load_policy, probe_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--data", default="data")
    ap.add_argument("--repair", type=int, default=20)
    ap.add_argument("--terminal", type=int, default=10)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--draw-seed", type=int, default=1, help="seed of the task sample (1 in results/LOG.md)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    m, tok = load_policy(a.model)
    rep = random.Random(a.draw_seed).sample(dataset_tasks(Path(a.data) / "embedded_repair_train"), a.repair)
    ter = random.Random(a.draw_seed).sample(dataset_tasks(Path(a.data) / "embedded_terminal_train"), a.terminal)
    r = probe_policy(m, tok, rep + ter, samples=a.samples, temperature=1.0, seed=0)
    r.pop("results")
    print(json.dumps({"model": a.model, **r}))


if __name__ == "__main__":
    main()
