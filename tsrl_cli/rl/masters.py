"""Master weights (optim.master_dtype): a bf16 model whose optimizer steps float32 copies.

AdamW on bf16 parameters adds each update to an 8-bit mantissa: an update below half a unit in the
last place of a weight rounds away, every step (at lr 1e-6, any weight of magnitude 2^-11 or more never
moves). With master weights the optimizer and its moments live in float32 and the bf16 parameters,
which the forward, the engines and the checkpoints use, take the masters' cast (round to nearest)
after every step.

  one process     MasterWeights: a float32 copy of each trained parameter; the round's float32 gradient
                  goes to the copy as is (no bf16 rounding), the optimizer steps the copies, then
                  copy_to_params casts them into the parameters.
  learner group   FSDP2's MixedPrecisionPolicy (rl/group.py shard): the sharded parameters themselves are
                  the float32 masters, every unit is all-gathered in bf16 for the forward and backward, and
                  the round's gradient reaches the sharded float32 p.grad unrounded. The engines and rank 0's
                  host copy of the policy (checkpointed) take the masters' cast, made on each shard.

optimizer.pt keeps the single-process format plus `master_weights` ({index: full tensor}, the optimizer's
parameters in order), so a run resumes on any number of ranks with the masters it stopped with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
MASTER_KEY = "master_weights"  # optimizer.pt: {index: full master tensor}


def master_dtype(cfg) -> torch.dtype | None:
    """The masters' dtype for this run, or None (the optimizer steps the parameters themselves)."""
    name = cfg.optim.master_dtype
    if name == "auto":
        return torch.float32 if getattr(torch, cfg.model.dtype) in LOW_PRECISION else None
    return None if name == "none" else getattr(torch, name)


class MasterWeights:
    """One process: a `dtype` copy of each trained parameter, which the optimizer steps."""

    def __init__(self, params: Sequence[torch.Tensor], dtype: torch.dtype):
        self.params = list(params)
        self.tensors = [p.detach().to(dtype, copy=True).requires_grad_(True) for p in self.params]

    def copy_to_params(self) -> None:
        """The parameters take the masters' values, cast to their own dtype (round to nearest)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.tensors, strict=True):
                p.copy_(m)


def upcast_for_group(params: Sequence[torch.nn.Parameter], dtype: torch.dtype) -> torch.dtype | None:
    """A group: the trained parameters not in `dtype` become `dtype` masters before sharding; returns the
    dtype they had (FSDP2's compute dtype, MixedPrecisionPolicy.param_dtype), or None when all were `dtype`
    already (LoRA adapters are float32 on a bf16 base: they are their own masters)."""
    other = {p.dtype for p in params if p.dtype != dtype}
    if not other:
        return None
    if len(other) > 1:
        raise ValueError(f"trained parameters in several dtypes {sorted(map(str, other))}; one compute dtype expected")
    for p in params:
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return other.pop()


def master_state(opt_params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """optimizer.pt's master_weights: the optimizer's parameters (full, on the CPU), by index."""
    return {i: p.detach().cpu().clone() for i, p in enumerate(opt_params)}
