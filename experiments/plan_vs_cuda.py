"""tsrl plan's figures (fake CPU tensors) against what the same passes allocate for real: on a CUDA GPU against
torch.cuda.max_memory_allocated, on the CPU (--device cpu, the CPU run of experiments/gpu_checks.sh) against the
same tracker over real tensors, the only allocation count a CPU has. Three passes, with the plan's own code
(tsrl_cli/memtrace.py) and random weights from a config.json (default Qwen3-1.7B's, committed under
experiments/node8/models/): the learner's forward and backward, AdamW's step, and the OPD teacher's costliest
forward (rl/teacher_worker.TurnScorer's last chunk over a cached prefix).

    python experiments/plan_vs_cuda.py                                    # Qwen3-1.7B, bf16, 1 x 4096, checkpointed
    python experiments/plan_vs_cuda.py --config experiments/node8/models/Qwen3-8B --tokens 8192 --json
    .venv/bin/python experiments/plan_vs_cuda.py --device cpu --tiny --json   # the CPU run: a tiny Qwen3, float32

max_memory_allocated counts what the caching allocator handed out (the tracker rounds blocks to 512 bytes as the
allocator does). On a GPU it also measures what the plan covers with its CUDA allowance (tsrl_cli.plan
CUDA_RUNTIME_BYTES) rather than the tracker: the CUDA context and libraries (device memory in use that the
allocator did not reserve, after a matmul) and the allocator's slack (max reserved - max allocated over the
passes); NCCL's buffers need a process group and are not measured here. Prints one JSON document with --json;
exit 1 when a pass differs by more than --tolerance (default 10 %) or the runtime exceeds the allowance.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tsrl_cli.memtrace import LearnerShape, learner_pass, optimizer_step, teacher_scoring
from tsrl_cli.plan import CUDA_RUNTIME_BYTES
from tsrl_cli.policy import model_config, tiny_qwen3_config


def measure(fn, cuda: bool) -> tuple[object, int | None]:
    """(fn's result, peak bytes allocated during the call above what was allocated before; None on the CPU)."""
    if not cuda:
        return fn(), None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def compare(plan: int, measured: int, tolerance: float) -> dict:
    rel = abs(plan - measured) / measured
    return {"plan_bytes": plan, "measured_bytes": measured, "rel_diff": rel, "ok": rel <= tolerance}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="experiments/node8/models/Qwen3-1.7B")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 (policy.tiny_qwen3_config) instead of --config")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tokens", type=int, default=None, help="positions of the row (default 4096; --tiny 256)")
    ap.add_argument("--chunk", type=int, default=None, help="learner.logits_chunk_tokens and the teacher's chunk "
                                                             "(default 1024; --tiny 64; 0: the learner unchunked)")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("plan_vs_cuda: --device cuda needs a CUDA GPU (none here); --device cpu is the CPU run", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    tokens = a.tokens or (256 if a.tiny else 4096)
    chunk = a.chunk if a.chunk is not None else (64 if a.tiny else 1024)
    config = tiny_qwen3_config(vocab_size=4096, hidden=128, layers=4, max_positions=4096) if a.tiny \
        else model_config(a.config)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    device = "cuda" if cuda else "cpu"
    out: dict = {"config": "tiny" if a.tiny else a.config, "device": a.device, "tokens": tokens, "chunk": chunk,
                 "dtype": str(dtype).removeprefix("torch."),
                 "gpu": torch.cuda.get_device_name(0) if cuda else None,
                 "measured_by": "torch.cuda.max_memory_allocated" if cuda else "the tracker on real CPU tensors"}
    if cuda:  # the context and the libraries a pass initialises, before any pass: memory the allocator did not reserve
        x = torch.randn(256, 256, device="cuda", dtype=dtype)
        (x @ x).sum().item()
        free, total = torch.cuda.mem_get_info()
        out["cuda_context_bytes"] = total - free - torch.cuda.memory_reserved()
        del x
    shape = LearnerShape(rows=1, width=tokens, dtype=dtype, checkpointing=not a.no_checkpointing,
                         chunk_tokens=chunk or None, master_dtype=torch.float32 if dtype == torch.bfloat16 else None,
                         buffer_dtype=torch.float32)
    plan = learner_pass(config, shape)
    real, allocated = measure(lambda: learner_pass(config, shape, fake=False, device=device), cuda)
    out["pass"] = compare(plan.pass_peak, allocated if cuda else real.pass_peak, a.tolerance)
    out["pass"]["tracker_on_real_bytes"] = real.pass_peak
    step_plan = optimizer_step(plan.opt_shapes, plan.opt_dtype, foreach=True)
    step_real, step_allocated = measure(
        lambda: optimizer_step(plan.opt_shapes, plan.opt_dtype, foreach=True, fake=False, device=device), cuda)
    out["step"] = compare(step_plan, step_allocated if cuda else step_real, a.tolerance)
    turn = min(4096, tokens // 4)
    teacher_plan = teacher_scoring(config, dtype, tokens, turn, chunk_tokens=chunk or None)
    teacher_real, teacher_allocated = measure(lambda: teacher_scoring(
        config, dtype, tokens, turn, chunk_tokens=chunk or None, fake=False, device=device,
        before_trace=torch.cuda.reset_peak_memory_stats if cuda else None), cuda)
    out["teacher"] = compare(teacher_plan.peak, teacher_allocated if cuda else teacher_real.peak, a.tolerance)
    out["teacher"]["turn"] = turn
    checks = [out["pass"]["ok"], out["step"]["ok"], out["teacher"]["ok"]]
    if cuda:
        out["allocator_slack_bytes"] = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
        out["cuda_runtime_bytes"] = out["cuda_context_bytes"] + out["allocator_slack_bytes"]
        out["cuda_runtime_allowance_bytes"] = CUDA_RUNTIME_BYTES
        out["runtime_within_allowance"] = out["cuda_runtime_bytes"] <= CUDA_RUNTIME_BYTES
        checks.append(out["runtime_within_allowance"])
    out["ok"] = all(checks)
    if a.json:
        print(json.dumps(out))
    else:
        for k in ("pass", "step", "teacher"):
            r = out[k]
            print(f"{k:8s} plan {r['plan_bytes'] / 2**30:.3f} GiB, measured {r['measured_bytes'] / 2**30:.3f} GiB "
                  f"({out['measured_by']}): {r['rel_diff']:.1%}")
        if cuda:
            print(f"CUDA context {out['cuda_context_bytes'] / 2**30:.2f} GiB + allocator slack "
                  f"{out['allocator_slack_bytes'] / 2**30:.2f} GiB against the plan's allowance "
                  f"{CUDA_RUNTIME_BYTES / 2**30:.1f} GiB")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
