"""Two stream rounds with a rollout engine, then two checks on what it generated.

    python experiments/engine_rounds.py --engine vllm --device cuda:0 [--model DIR] [--out DIR] [--json]

1. Round 2 was generated with the weights the learner published after round 1 (over the weight bus):
   the learner's log-probs of round 2's tokens under the round-1 checkpoint must match the engine's
   behavior log-probs (vLLM: within kernel rounding; hf float64: ~1e-15). The initial weights must
   not match as well (else the check could not tell an engine that never took the new weights).
2. Generation throughput: new tokens per second of the rounds' generation windows.

The model: --model DIR, else the first Qwen3 model in the HuggingFace cache, else the builtin toy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from tsrl_cli.config import load_config
from tsrl_cli.core.losses import token_logprobs
from tsrl_cli.policy import load_policy
from tsrl_cli.rl.train import train


def cached_model() -> str:
    hub = Path.home() / ".cache" / "huggingface" / "hub"
    for snap in sorted(hub.glob("models--Qwen--Qwen3-*/snapshots/*")):
        if (snap / "config.json").is_file() and (snap / "tokenizer.json").is_file():
            return str(snap)
    return "builtin:toy"


def rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def logprob_gap(ckpt: Path, rollouts: list[dict], device: str, dtype: str) -> dict:
    """max/mean |learner log-prob - behavior log-prob| over the loss tokens of `rollouts`."""
    model, _ = load_policy(ckpt, dtype=dtype, device=device, tokenizer=False)
    gaps = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r["input_ids"]], device=device)
            lp = token_logprobs(model(input_ids=ids).logits, ids)[0].double().cpu()
            for t, (m, b) in enumerate(zip(r["loss_mask"], r["behavior_logprobs"], strict=True)):
                if m and t > 0:
                    gaps.append(abs(float(lp[t]) - b))
    return {"max": max(gaps), "mean": statistics.fmean(gaps), "tokens": len(gaps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for vllm, float64 for hf")
    ap.add_argument("--out", default="/tmp/tsrl_engine_rounds")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    model = a.model or cached_model()
    dtype = a.dtype or ("bfloat16" if a.engine == "vllm" else "float64")
    out = Path(a.out) / a.engine
    cfg = load_config(sets=[f"model.policy={model}", "data.train=[builtin:echo]", f"model.dtype={dtype}",
                            f"rollout.engine={a.engine}", f"devices.rollout={a.device}", f"devices.learner={a.device}",
                            "rollout.prompts_per_round=4", "rollout.group_size=8", "rollout.max_turns=3",
                            "rollout.max_turn_tokens=64", "rollout.max_trajectory_tokens=1024",
                            "run.save_rollouts=true",
                            "run.save_every=1", "rollout.vllm_memory_fraction=0.3", f"run.out={out}"],
                      flags={"schedule": "stream", "rounds": 2})
    train(cfg)
    run = Path(cfg.run_dir())
    r2 = [r for r in rows(run, "rollouts.jsonl") if r["round"] == 2]
    new = logprob_gap(run / "checkpoints" / "round-1", r2, a.device, dtype)
    old = logprob_gap(run / "checkpoints" / "round-0", r2, a.device, dtype)
    gen = [e for e in rows(run, "events.jsonl") if e["event"] == "rollout"]
    metrics = rows(run, "metrics.jsonl")
    tok_s = [m["loss_tokens"] / (e["end_s"] - e["start_s"]) for m, e in zip(metrics, gen, strict=True)]
    res = {"engine": a.engine, "model": model, "dtype": dtype, "device": a.device, "run_dir": str(run),
           "round2_vs_round1_ckpt": new, "round2_vs_initial": old,
           "took_new_weights": new["mean"] < old["mean"], "gen_tokens_per_s": tok_s,
           "weight_sync_s": [m["weight_sync_s"] for m in metrics], "weight_bytes": metrics[0]["weight_bytes"]}
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0 if res["took_new_weights"] else 1


if __name__ == "__main__":
    sys.exit(main())
