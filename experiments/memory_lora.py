"""Stream's extra memory over sync, full fine-tuning against LoRA (target: < 1 % with LoRA).

One round of GRPO gradients on synthetic agent rollouts, computed lazily (sync: one padded batch)
and streamed (stream: one backward per trajectory, arrival order shuffled), on a Qwen3 model built
from a config (random weights: memory does not depend on what the weights are).

Reported per mode (full, lora):
  model_bytes                 every parameter of the model
  trainable_bytes             what requires grad (everything, or the adapters)
  accumulator_peak_bytes      stream's partial-sum buffers at their peak (open groups + round buffer R)
  open_peak_bytes             the open groups' buffers alone (S_r, S_1 per open group): the extra
                              over sync, because R is the round's gradient, which sync holds as
                              p.grad too (the learner hands R to the optimizer as p.grad)
  open / model                stream's extra gradient state as a fraction of the model's bytes
  peak_sync / peak_stream     torch.cuda.max_memory_allocated on CUDA (None on CPU, where only the
                              buffers are counted): the whole process, activations included
  grad match                  stream against sync, max relative difference (the same gradient)

Run (CPU, small):   .venv/bin/python experiments/memory_lora.py
Run (GPU, ~1.7 B):  python experiments/memory_lora.py --device cuda --preset qwen3-1.7b --dtype bfloat16
Run (CPU, 1.7 B shapes, buffers only; about 1 min, 8 GB RAM):
  .venv/bin/python experiments/memory_lora.py --preset qwen3-1.7b --dtype bfloat16 --modes lora \
      --lora-rank 8 --targets q_proj,v_proj --groups 2 --group-size 4 --length 32 --max-open-groups 1
Shapes only (no forward; the meta device, any preset incl. 8B): add --count-only
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter

import torch

PRESETS = {  # Qwen3 shapes (from the published configs); random weights
    "small": dict(vocab_size=2048, hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2, head_dim=64),
    "qwen3-0.6b": dict(vocab_size=151936, hidden=1024, layers=28, intermediate=3072, heads=16, kv_heads=8,
                       head_dim=128),
    "qwen3-1.7b": dict(vocab_size=151936, hidden=2048, layers=28, intermediate=6144, heads=16, kv_heads=8,
                       head_dim=128),
    "qwen3-8b": dict(vocab_size=151936, hidden=4096, layers=36, intermediate=12288, heads=32, kv_heads=8, head_dim=128),
}


def build(preset: str, dtype, device, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tsrl_cli.policy import keep_float64_norms

    p = PRESETS[preset]
    cfg = Qwen3Config(vocab_size=p["vocab_size"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                      num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
                      head_dim=p["head_dim"], tie_word_embeddings=preset in ("qwen3-0.6b", "qwen3-1.7b"),
                      max_position_embeddings=4096)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy of an 8B model first
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg).to(dtype)
    finally:
        torch.set_default_dtype(old)
    if dtype == torch.float64:  # Qwen3's RMSNorm computes in float32 otherwise: a float64 run would not be float64
        keep_float64_norms(model)
    return model.eval()


def rollouts(vocab: int, groups: int, size: int, length: int, seed: int):
    from tsrl_cli.rollouts import Rollout

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for i in range(size):
            n = rng.randint(length // 2, length)
            p = n // 4
            ids = [rng.randrange(vocab) for _ in range(n)]
            out.append(Rollout(f"g{g}", i, ids, [0] * p + [1] * (n - p), float(rng.random() < 0.5), [(p, n)]))
    return out


def peak_reset(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return None


def one_mode(args, lora_rank: int) -> dict:
    from tsrl_cli.config import LossConfig
    from tsrl_cli.core.accumulator import RoundGradAccumulator
    from tsrl_cli.policy import param_bytes, wrap_lora
    from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
    model = build(args.preset, dtype, args.device)
    if lora_rank:
        model = wrap_lora(model, lora_rank, 2.0 * lora_rank, args.targets, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {"mode": "lora" if lora_rank else "full", "max_open_groups": args.max_open_groups, "lora_rank": lora_rank,
           "targets": list(args.targets) if lora_rank else None, "adv_norm": args.adv_norm, "preset": args.preset,
           "dtype": args.dtype, "device": args.device, "model_bytes": param_bytes(model),
           "trainable_bytes": param_bytes(model, True)}
    if args.count_only:  # meta device: bytes from shapes; per open group 2 sets (1 for Dr. GRPO)
        acc = RoundGradAccumulator(params)
        per_group = 1 if args.adv_norm == "center" else 2
        k = args.groups if args.max_open_groups is None else min(args.groups, args.max_open_groups)
        out["open_peak_bytes"] = k * per_group * acc.param_bytes
        out["accumulator_peak_bytes"] = out["open_peak_bytes"] + acc.param_bytes
        out["open_over_model"] = out["open_peak_bytes"] / out["model_bytes"]
        out["accumulator_over_model"] = out["accumulator_peak_bytes"] / out["model_bytes"]
        out["computed_from_shapes"] = True
        return out
    ro = rollouts(PRESETS[args.preset]["vocab_size"], args.groups, args.group_size, args.length, seed=1)
    obj = Objective("grpo", LossConfig(adv_norm=args.adv_norm, max_open_groups=args.max_open_groups))

    # sync: the lazy padded batch, in micro-batches of --micro trajectories (gradient accumulation of
    # the same scalar loss: each micro-batch's loss is scaled by its share of the round's tokens)
    peak_reset(args.device)
    t0 = time.perf_counter()
    n_tok = sum(sum(r.loss_mask) for r in ro)
    for k in range(0, len(ro), args.micro):
        part = ro[k:k + args.micro]
        w = sum(sum(r.loss_mask) for r in part) / n_tok
        # token-mean over the micro-batch times its token share = the round's token-mean; the
        # group advantages need whole groups, so micro-batches are whole groups (--micro = group size)
        (lazy_loss(model, part, obj) * w).backward()
    sync_grads = [p.grad.detach().clone() for p in params]
    out["peak_sync"] = peak(args.device)
    out["time_sync_s"] = time.perf_counter() - t0
    for p in params:
        p.grad = None

    peak_reset(args.device)
    t0 = time.perf_counter()
    sl = StreamLearner(model, obj, Counter(r.group_id for r in ro))
    order = list(ro)
    random.Random(0).shuffle(order)
    for r in order:
        sl.on_trajectory(r)
        sl.drain()  # per arrival: the streaming buffers' worst case
    grads = sl.close_round()
    out["peak_stream"] = peak(args.device)
    out["time_stream_s"] = time.perf_counter() - t0
    out["accumulator_peak_bytes"] = sl.acc.peak_open_bytes + sl.acc.param_bytes
    out["accumulator_over_model"] = out["accumulator_peak_bytes"] / out["model_bytes"]
    out["open_peak_bytes"] = sl.acc.peak_open_bytes
    out["open_over_model"] = out["open_peak_bytes"] / out["model_bytes"]
    if out["peak_sync"] is not None:
        out["extra_peak_over_model"] = (out["peak_stream"] - out["peak_sync"]) / out["model_bytes"]
    out["grad_max_rel_diff"] = max(float((g.float() - s.float()).abs().max() / s.float().abs().max().clamp(min=1e-30))
                                   for g, s in zip(grads, sync_grads, strict=True) if g is not None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--length", type=int, default=512, help="max tokens per trajectory")
    ap.add_argument("--max-open-groups", type=int, default=None,
                    help="stream's cap on groups holding buffers (None: no cap; 0: every group deferred to its close)")
    ap.add_argument("--modes", default="full,lora",
                    help="comma-separated: full, lora (full at 8B needs ~10x the model)")
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    help="LoRA target modules, comma-separated (PEFT's own default for Qwen is q_proj,v_proj)")
    ap.add_argument("--adv-norm", default="group", choices=["group", "center"],
                    help="center (Dr. GRPO, no std division) needs one buffer per open group instead of two")
    ap.add_argument("--count-only", action="store_true", help="bytes from shapes on the meta device; no forward")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
    if a.count_only:
        a.device = "meta"
    a.micro = a.group_size
    if a.device == "cpu":
        torch.set_num_threads(1)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    rows = [one_mode(a, 0 if m == "full" else a.lora_rank) for m in modes]
    if a.json:
        print(json.dumps(rows))
        return
    print(f"{a.preset} {a.dtype} on {a.device}: {a.groups} groups x {a.group_size}, <= {a.length} tokens, "
          f"max_open_groups {a.max_open_groups}")
    for r in rows:
        line = (f"{r['mode']:>4}: model {r['model_bytes'] / 2**20:.1f} MiB, "
                f"trainable {r['trainable_bytes'] / 2**20:.2f} MiB, "
                f"open-group buffers {r['open_peak_bytes'] / 2**20:.2f} MiB = "
                f"{100 * r['open_over_model']:.2f} % of the "
                f"model (with R: {100 * r['accumulator_over_model']:.2f} %)")
        if r.get("computed_from_shapes"):
            print(line + ", computed from shapes")
            continue
        extra = "" if r["peak_sync"] is None else (
            f", peak sync {r['peak_sync'] / 2**30:.2f} GiB, stream {r['peak_stream'] / 2**30:.2f} GiB "
            f"(extra {100 * r['extra_peak_over_model']:+.2f} % of the model)")
        print(f"{line}{extra}; time stream/sync {r['time_stream_s'] / r['time_sync_s']:.2f}; "
              f"grad max rel diff {r['grad_max_rel_diff']:.1e}")


if __name__ == "__main__":
    main()
