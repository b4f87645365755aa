"""NEEDS A CUDA GPU. The plan's learner figure (fake CPU tensors) against torch.cuda.max_memory_allocated of the same
pass on a real GPU: one forward and backward, then AdamW's step, with the plan's own code (tsrl_cli/memtrace.py),
random weights from a config.json (default Qwen3-1.7B's, committed under experiments/node8/models/).

    python experiments/plan_vs_cuda.py                                    # Qwen3-1.7B, bf16, 1 x 4096, checkpointed
    python experiments/plan_vs_cuda.py --config experiments/node8/models/Qwen3-8B --tokens 8192 --json

max_memory_allocated counts what the caching allocator handed out (the tracker rounds blocks to 512 bytes as the
allocator does); neither counts the CUDA context or the allocator's reserved-but-free blocks, which are printed
too (max_memory_reserved). Prints one JSON document with --json; exit 1 when the pass or the step differs by more
than --tolerance (default 10 %).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tsrl_cli.memtrace import LearnerShape, learner_pass, optimizer_step
from tsrl_cli.policy import model_config


def measure(fn) -> tuple[object, int, int]:
    """(fn's result, peak allocated bytes, peak reserved bytes) of one call on a clean allocator."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="experiments/node8/models/Qwen3-1.7B")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024, help="learner.logits_chunk_tokens (0: off)")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("plan_vs_cuda: needs a CUDA GPU (none here)", file=sys.stderr)
        return 2
    config = model_config(a.config)
    shape = LearnerShape(rows=1, width=a.tokens, dtype=torch.bfloat16, checkpointing=not a.no_checkpointing,
                         chunk_tokens=a.chunk or None, master_dtype=torch.float32, buffer_dtype=torch.float32)
    plan = learner_pass(config, shape)
    real, allocated, reserved = measure(lambda: learner_pass(config, shape, fake=False, device="cuda"))
    step_plan = optimizer_step(plan.opt_shapes, plan.opt_dtype, foreach=True)
    _, step_allocated, step_reserved = measure(
        lambda: optimizer_step(plan.opt_shapes, plan.opt_dtype, foreach=True, fake=False, device="cuda"))
    rel = lambda a, b: abs(a - b) / b  # noqa: E731
    out = {"config": a.config, "tokens": a.tokens, "gpu": torch.cuda.get_device_name(0),
           "pass_plan_bytes": plan.pass_peak, "pass_tracker_on_cuda_bytes": real.pass_peak,
           "pass_max_memory_allocated": allocated, "pass_max_memory_reserved": reserved,
           "pass_rel_diff": rel(plan.pass_peak, allocated),
           "step_plan_bytes": step_plan, "step_max_memory_allocated": step_allocated,
           "step_max_memory_reserved": step_reserved, "step_rel_diff": rel(step_plan, step_allocated)}
    out["ok"] = out["pass_rel_diff"] <= a.tolerance and out["step_rel_diff"] <= a.tolerance
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28s} {v / 2**30:.3f} GiB" if k.endswith(("bytes", "allocated", "reserved")) else f"{k:28s} {v}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
