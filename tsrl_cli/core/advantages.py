"""GRPO outcome advantages for one group, with verl's semantics.

verl `compute_grpo_outcome_advantage` (core_algos.py), per group of rewards r_1..r_G:
  group_normalized:  A_i = (r_i - mean) / (std + eps), std unbiased (N-1), eps = 1e-6
  group_centered:    A_i = r_i - mean                  (Dr. GRPO, norm_adv_by_std_in_grpo=False)
  singleton group (G = 1): mean = 0, std = 1, so A = r / (1 + eps) or A = r.  This is verl's rule,
  not "zero advantage": a lone sample is pushed by its raw reward.

All statistics are float64 whatever the model dtype: advantages are scalars per trajectory and
cost nothing, while float32 statistics of rewards like 100 + 0.01*noise lose 4 digits.

Differences from other trainers: TRL `GRPOTrainer` uses eps = 1e-4, AReaL 1e-5; tinker-cookbook
and prime-rl never divide by std (that is `group_centered` here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRPO_EPS = 1e-6


@dataclass(frozen=True)
class GroupStats:
    """A_i = (r_i - mean) * scale for every member i of the group (scale = 1/(std+eps) or 1)."""

    mean: float
    std: float
    scale: float
    size: int

    def advantage(self, reward: float) -> float:
        """A = (r - mean) * scale, in float64."""
        return (float(reward) - self.mean) * self.scale


def group_stats(rewards_G: torch.Tensor, norm_by_std: bool = True, eps: float = GRPO_EPS) -> GroupStats:
    """Mean, unbiased std and advantage scale of one group's rewards (verl's edge rules).

    Args:
        rewards_G: (G,) rewards of the group, any float dtype (cast to float64 here).
        norm_by_std: True for GRPO (divide by std + eps), False for Dr. GRPO (centering only).
        eps: added to the std, verl's 1e-6 by default.
    """
    r = rewards_G.detach().to(torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("a GRPO group needs at least one reward")
    if r.numel() == 1:
        mean, std = 0.0, 1.0  # verl: singleton group -> mean 0, std 1
    else:
        mean, std = float(r.mean()), float(r.std())  # torch.std: unbiased (N-1), as verl
    scale = 1.0 / (std + eps) if norm_by_std else 1.0
    return GroupStats(mean=mean, std=std, scale=scale, size=int(r.numel()))


def group_normalized(rewards_G: torch.Tensor, eps: float = GRPO_EPS) -> torch.Tensor:
    """(G,) float64 GRPO advantages (r - mean) / (std + eps)."""
    s = group_stats(rewards_G, True, eps)
    return (rewards_G.detach().to(torch.float64) - s.mean) / (s.std + eps)


def group_centered(rewards_G: torch.Tensor, eps: float = GRPO_EPS) -> torch.Tensor:
    """(G,) float64 Dr. GRPO advantages r - mean (eps unused, kept for a uniform signature)."""
    s = group_stats(rewards_G, False, eps)
    return rewards_G.detach().to(torch.float64) - s.mean


# name -> (advantage function, norm_by_std).  "group" and "center" are the CLI names.
ADVANTAGES = {
    "group": (group_normalized, True),
    "center": (group_centered, False),
}
