"""How far apart two gradients of the same round are: the one measure `tsrl verify` prints and the
exactness certificate of `tsrl train` (run.verify_every) records.

    relative difference = max |lazy - other| / max |lazy|,   both maxima over every element of every tensor

One maximum over the whole gradient, not a mean of per-tensor ratios: a tensor whose gradient is
tiny does not dominate it. On a sharded learner each rank compares its own shards and `combine`
takes the maximum of each term over ranks, which is the same figure as on the full tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Relative tolerance per model dtype. float64: both sides see the same float64 math, only the
# summation order differs (measured 0.9e-15 .. 2.5e-15, tsrl verify on the built-in tiny Qwen3,
# results/LOG.md 2026-11-30). float32: lazy sums inside one backward, stream per trajectory in
# float32 buffers (measured 3.9e-7 .. 1.8e-6 there, 2.4e-6 at Qwen3-1.7B shapes with LoRA). bfloat16:
# the forward itself rounds per batch shape (measured 0.9e-2 .. 1.5e-2 on the tiny model, 3.2e-2 at
# Qwen3-1.7B shapes with LoRA, results/LOG.md).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}


def tolerance(model_dtype: torch.dtype, bf16_buffers: bool = False) -> float:
    """The default tolerance of a gradient computed in model_dtype. bf16 buffers (opt-in) round every
    partial sum to 8 bits of mantissa: judged at bf16's tolerance, whatever the model's dtype."""
    return TOLERANCE[torch.bfloat16] if bf16_buffers else TOLERANCE[model_dtype]


def relative(max_abs_diff: float, max_abs_ref: float) -> float:
    """max |a - b| / max |a|; 0 when both are 0, inf when only the reference is 0."""
    if max_abs_ref > 0:
        return max_abs_diff / max_abs_ref
    return 0.0 if max_abs_diff == 0 else float("inf")


def compare(names: list[str], lazy: Sequence[torch.Tensor], stream: Sequence[torch.Tensor]) -> dict:
    """Max absolute and relative difference, overall and for the worst tensor (by relative)."""
    max_abs, max_ref = 0.0, 0.0
    worst = ("", 0.0, 0.0)
    for name, a, b in zip(names, lazy, stream, strict=True):
        a64, b64 = a.double(), b.double()
        d = float((a64 - b64).abs().max()) if a.numel() else 0.0
        ref = float(a64.abs().max()) if a.numel() else 0.0
        max_abs, max_ref = max(max_abs, d), max(max_ref, ref)
        rel = relative(d, ref)
        if rel > worst[1] or not worst[0]:
            worst = (name, rel, d)
    return {
        "max_abs_diff": max_abs,
        "max_abs_grad": max_ref,
        "max_rel_diff": relative(max_abs, max_ref),
        "worst_param": worst[0],
        "worst_param_rel_diff": worst[1],
        "worst_param_abs_diff": worst[2],
    }


def combine(parts: Sequence[dict]) -> dict:
    """`compare` results of disjoint pieces of one gradient (each rank's shards) as one result."""
    max_abs = max(p["max_abs_diff"] for p in parts)
    max_ref = max(p["max_abs_grad"] for p in parts)
    worst = max(parts, key=lambda p: p["worst_param_rel_diff"])
    return {"max_abs_diff": max_abs, "max_abs_grad": max_ref, "max_rel_diff": relative(max_abs, max_ref),
            "worst_param": worst["worst_param"], "worst_param_rel_diff": worst["worst_param_rel_diff"],
            "worst_param_abs_diff": worst["worst_param_abs_diff"]}
