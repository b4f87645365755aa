"""A learner group against one learner process: float64, the toy workload, stream on N ranks vs sync on one.

    python experiments/group_exact.py --learners cpu:2                    # CPU ranks (gloo)
    python experiments/group_exact.py --learners 0,1 --rollout 0          # two GPUs (NCCL)

Prints one JSON document: identical token ids, the final weights' max relative difference (the
target: <= 1e-9), the per-rank buffer bytes against the single process's; exit 1 when either fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from tsrl_cli.config import load_config
from tsrl_cli.rl.runlog import RunLog
from tsrl_cli.rl.train import train

TOY = ["model.policy=builtin:toy", "model.teacher=builtin:toy-teacher", "data.train=[builtin:echo]",
       "rollout.prompts_per_round=2", "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
       "rollout.max_trajectory_tokens=400", "optim.lr=1e-2", "model.dtype=float64", "run.save_rollouts=true",
       "rollout.tool_latency_median_s=0.05", "rollout.tool_latency_sigma=1.0"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", default="cpu:2", help="the group's devices: cpu:N, or CUDA indices (0,1 or 0-3)")
    ap.add_argument("--rollout", default="cpu", help="the rollout (and teacher) device")
    ap.add_argument("--objective", default="grpo", choices=["grpo", "opd"])
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for the two runs (default: a temporary one)")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="tsrl-group-exact-"))
    runs = {}
    for name, schedule, learners in (("one", "sync", a.rollout if a.rollout != "cpu" else "cpu"),
                                     ("group", "stream", a.learners)):
        cfg = load_config(sets=[*TOY, f"lora.rank={a.lora_rank}", f"devices.rollout={a.rollout}",
                                f"devices.learner={learners}", f"run.out={root / name}"],
                          flags={"schedule": schedule, "objective": a.objective, "rounds": a.rounds})
        train(cfg)
        runs[name] = root / name

    def weights(d):
        return load_file(str(d / "checkpoints" / f"round-{a.rounds}" / "model.safetensors"))

    def tokens(d):
        return [(r["round"], r["group_id"], r["sample_index"], r["input_ids"])
                for r in RunLog(d).rows("rollouts.jsonl")]

    w1, wn = weights(runs["one"]), weights(runs["group"])
    rel = max(float((w1[k] - wn[k]).abs().max() / w1[k].abs().max().clamp(min=1e-300)) for k in w1)
    m1, mn = RunLog(runs["one"]).rows("metrics.jsonl"), RunLog(runs["group"]).rows("metrics.jsonl")
    single = m1[0]["accumulator_set_rank_bytes"][0]
    per_rank = mn[0]["accumulator_set_rank_bytes"]
    doc = {"learners": a.learners, "objective": a.objective, "lora_rank": a.lora_rank, "rounds": a.rounds,
           "tokens_identical": tokens(runs["one"]) == tokens(runs["group"]), "weights_max_rel_diff": rel,
           "buffer_set_bytes_single": single, "buffer_set_bytes_per_rank": per_rank,
           "buffer_fraction_per_rank": [b / single for b in per_rank],
           "peak_device_learner_rank_bytes": mn[-1].get("peak_device_learner_rank_bytes"), "out": str(root)}
    doc["ok"] = doc["tokens_identical"] and rel <= 1e-9
    print(json.dumps(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
