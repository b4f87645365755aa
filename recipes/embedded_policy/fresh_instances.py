"""Does a policy solve new instances of the training terminal families, written with training words?

The held-out terminal split changes two things at once: unseen words (a disjoint pool) and, for a
few tasks, unseen families. This probe removes the first: it writes fresh instances of the
*training* families from the *training* word pool (another generator seed; any instruction that is
also a training task is dropped), so a policy that reads its instruction, rather than recalling
training tasks, should solve about as many as it solves on the training tasks. Tasks are written to
--root (not validated: the generator is the one `prepare-data` validates) and probed greedily and at
temperature 1.

  .venv/bin/python recipes/embedded_policy/fresh_instances.py data/embedded_policy/student data/embedded_policy/teacher
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


def main() -> None:
    from tsrl_cli.datasets.harbor import read_task_dir
    from tsrl_cli.datasets.store import Dataset, open_dataset
    from tsrl_cli.embedded import terminal_suite as ts
    from tsrl_cli.evals.probe import probe_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--n", type=int, default=42, help="instances drawn (before dropping training duplicates)")
    ap.add_argument("--seed", type=int, default=7, help="generator seed (the shipped suite uses 0)")
    ap.add_argument("--samples", type=int, default=4, help="samples per task at temperature 1")
    ap.add_argument("--root", default="/tmp/tsrl-fresh-instances")
    a = ap.parse_args()
    torch.set_num_threads(1)

    train = {t.instruction for t in open_dataset("data/embedded_terminal_train").tasks}
    root = Path(a.root)
    shutil.rmtree(root, ignore_errors=True)
    tasks = []
    for task_id, family, spec in ts.generate_specs(a.seed, "train", a.n):
        if spec.instruction in train:
            continue
        d = root / "tasks" / task_id
        ts.write_task(d, spec, family=family, split="train", seed=a.seed)
        tasks.append(read_task_dir(d, source="fresh", split="eval", rel=str(d.relative_to(root))))
    fresh = Dataset("fresh_instances", root, {}, tasks)
    for i, path in enumerate(a.models):
        greedy = probe_policy(path, [fresh], samples=1, temperature=0.0, out_dir=root / f"probe{i}-greedy")
        sampled = probe_policy(path, [fresh], samples=a.samples, temperature=1.0, out_dir=root / f"probe{i}-t1")
        print(json.dumps({"model": path, "tasks": len(tasks),
                          "greedy_success": greedy["terminal"]["success_rate"],
                          "greedy_solved": sorted(x["instance_id"] for x in greedy["results"] if x["reward"]),
                          "t1_success": sampled["terminal"]["success_rate"],
                          "t1_groups_nonzero_var": sampled["terminal"]["groups_nonzero_var"]}), flush=True)


if __name__ == "__main__":
    main()
