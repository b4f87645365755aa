"""The learner's compute and peak memory for one round: sync against stream, per-arrival and micro-batched.

One round of GRPO on synthetic agent rollouts (Qwen3 shapes, random weights: cost and memory do not
depend on what the weights are), through the learner engine that `tsrl train` runs:
  sync            every trajectory after the last arrival, micro-batches of --max-tokens
  stream K=1      each arrival backwarded alone (learner.max_microbatch_items 1)
  stream K=k      the learner busy for k arrivals: what is queued then is micro-batched (one backward
                  per fold target), as when arrivals outpace the learner
Reported per run: learner seconds (forward + backward + folds, synchronized), the ratio over sync,
the gradient's max relative difference from sync, the accumulator's peak bytes and, on CUDA, the
peak device memory (torch.cuda.max_memory_allocated) and stream's peak over sync's.
--buffer-device cpu puts the streaming buffers in pinned host memory (folded by a host thread).

Run (CPU, small):          .venv/bin/python experiments/learner_compute.py
Run (GPU, Qwen3-1.7B):     python experiments/learner_compute.py --device cuda --preset qwen3-1.7b --dtype bfloat16 \
                               --length 1024 --max-tokens 16384 --bursts 1,8 --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_lora import PRESETS, build, peak, peak_reset, rollouts  # noqa: E402

from tsrl_cli.config import LossConfig  # noqa: E402
from tsrl_cli.policy import wrap_lora  # noqa: E402
from tsrl_cli.rl.learner import Objective, StreamLearner  # noqa: E402


def one_run(model, ro, obj, device, *, burst: int | None, max_tokens: int | None, seed: int) -> tuple[dict, list]:
    """burst None: sync (all arrivals, then the batches); else stream, draining after every `burst` arrivals."""
    sizes = Counter(r.group_id for r in ro)
    peak_reset(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    sl = StreamLearner(model, obj, sizes, max_tokens=max_tokens, max_items=1 if burst == 1 else None)
    order = sorted(ro, key=lambda r: r.key) if burst is None else random.Random(seed).sample(ro, len(ro))
    for n, r in enumerate(order, 1):
        sl.on_trajectory(r)
        if burst is not None and n % burst == 0:
            sl.drain()
    sl.drain()
    grads = sl.close_round()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    return {"learner_s": secs, "microbatches": len(sl.batches), "backwards": sl.backwards,
            "accumulator_peak_bytes": sl.acc.peak_open_bytes + sl.acc.param_bytes,
            "peak_device_bytes": peak(device)}, grads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--length", type=int, default=256, help="max tokens per trajectory")
    ap.add_argument("--max-tokens", type=int, default=None, help="learner.max_microbatch_tokens (padded positions)")
    ap.add_argument("--bursts", default="1,8", help="comma-separated arrivals per learner pass for stream")
    ap.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA adapters on every linear layer")
    ap.add_argument("--buffer-device", default="device", choices=["device", "cpu"])
    ap.add_argument("--buffer-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2, help="each run this many times; the minimum time is kept")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[a.dtype]
    model = build(a.preset, dtype, a.device)
    if a.lora_rank:
        model = wrap_lora(model, a.lora_rank, 2.0 * a.lora_rank,
                          ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=0)
    ro = rollouts(PRESETS[a.preset]["vocab_size"], a.groups, a.group_size, a.length, seed=1)
    obj = Objective("grpo", LossConfig(buffer_device=a.buffer_device, buffer_dtype=a.buffer_dtype))
    runs = [("sync", None)] + [(f"stream K={k}", int(k)) for k in a.bursts.split(",")]
    out = {"preset": a.preset, "device": a.device, "dtype": a.dtype, "lora_rank": a.lora_rank,
           "buffer_device": a.buffer_device, "buffer_dtype": a.buffer_dtype, "trajectories": len(ro),
           "max_tokens": a.max_tokens, "runs": {}}
    ref = None
    for name, burst in runs:
        best, grads = None, None
        for rep in range(a.repeats):
            grads = None  # the previous run's gradients, alive during this run, would count in its peak
            row, grads = one_run(model, ro, obj, a.device, burst=burst, max_tokens=a.max_tokens, seed=rep)
            best = row if best is None or row["learner_s"] < best["learner_s"] else best
        if ref is None:
            # sync's gradient in host memory (not in later runs' device peaks), in float64 (a float64 run's precision)
            ref = [g.to("cpu", torch.float64) for g in grads]
        best["grad_max_rel_diff"] = max(
            float((g.to("cpu", torch.float64) - s).abs().max() / s.abs().max().clamp(min=1e-30))
            for g, s in zip(grads, ref, strict=True))
        out["runs"][name] = best
    sync = out["runs"]["sync"]
    for row in out["runs"].values():
        row["compute_over_sync"] = row["learner_s"] / sync["learner_s"]
        if row["peak_device_bytes"] is not None and sync["peak_device_bytes"]:
            row["peak_device_over_sync"] = row["peak_device_bytes"] / sync["peak_device_bytes"]
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.preset} {a.dtype} on {a.device}, lora {a.lora_rank}, buffers {a.buffer_dtype} on {a.buffer_device}: "
          f"{len(ro)} trajectories <= {a.length} tokens, max_tokens {a.max_tokens}")
    for name, r in out["runs"].items():
        mem = "" if r["peak_device_bytes"] is None else \
            f", peak {r['peak_device_bytes'] / 2**30:.2f} GiB ({r.get('peak_device_over_sync', 1):.3f}x sync)"
        print(f"  {name:>12}: learner {r['learner_s']:.3f} s ({r['compute_over_sync']:.2f}x sync), "
              f"{r['microbatches']} micro-batches, "
              f"accumulator peak {r['accumulator_peak_bytes'] / 2**20:.1f} MiB{mem}, "
              f"grad diff {r['grad_max_rel_diff']:.1e}")


if __name__ == "__main__":
    main()
