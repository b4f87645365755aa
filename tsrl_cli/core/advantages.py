"""Group-wise outcome advantages: every member's advantage from its reward and its group's rewards.

verl `compute_grpo_outcome_advantage` (core_algos.py), per group of rewards r_1..r_G:
  group (GRPO):       A_i = (r_i - mean) / (std + eps), eps = 1e-6
  center (Dr. GRPO):  A_i = r_i - mean                   (verl norm_adv_by_std_in_grpo=False)
verl `compute_rloo_outcome_advantage`:
  rloo:               A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean)

The standard deviation of `group` is a choice (loss.adv_std):
  unbiased    (N - 1), verl's; a singleton group (G = 1) takes mean 0, std 1 (verl's rule, so a lone
              sample is pushed by its raw reward: A = r / (1 + eps))
  population  (N), ThunderSyncRL's own library (thundersync `RewardLinearBackward`: "population std with
              eps"); the formula applies as written, so a singleton's A is 0
RLOO's singleton keeps its reward (verl: no leave-one-out baseline exists).

Every estimator here depends on a member only through its reward and the group's rewards, so members
that share a reward share an advantage: streaming is exact by one buffer per (group, reward value)
(core.accumulator "buckets"). The affine ones, A_i = (r_i - mu) * s with mu and s group statistics,
also stream with two buffers per group whatever the rewards (S_r, S_1): `Estimator.stats` gives
(mu, s). All statistics are float64 whatever the model dtype: float32 statistics of rewards like
100 + 0.01 * noise lose 4 digits.

Differences from other trainers: TRL `GRPOTrainer` uses eps = 1e-4, AReaL 1e-5; tinker-cookbook
and prime-rl never divide by std (that is `center` here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GRPO_EPS = 1e-6
STD_KINDS = ("unbiased", "population")  # loss.adv_std; config.AdvStd copies them (tests/test_config.py)


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


def _rewards(rewards_G: torch.Tensor) -> torch.Tensor:
    r = rewards_G.detach().to(torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("a group needs at least one reward")
    return r


def group_stats(rewards_G: torch.Tensor, norm_by_std: bool = True, eps: float = GRPO_EPS,
                std: str = "unbiased") -> GroupStats:
    """Mean, std and advantage scale of one group's rewards (GRPO and Dr. GRPO).

    Args:
        rewards_G: (G,) rewards of the group, any float dtype (cast to float64 here).
        norm_by_std: True for GRPO (divide by std + eps), False for Dr. GRPO (centering only).
        eps: added to the std, verl's 1e-6 by default.
        std: "unbiased" (N - 1, verl; a singleton takes mean 0, std 1) or "population" (N).
    """
    r = _rewards(rewards_G)
    if std not in STD_KINDS:
        raise ValueError(f"unknown std {std!r}; use one of {', '.join(STD_KINDS)}")
    if std == "population":
        mean, sd = float(r.mean()), float(r.std(correction=0))
    elif r.numel() == 1:
        mean, sd = 0.0, 1.0  # verl: singleton group -> mean 0, std 1
    else:
        mean, sd = float(r.mean()), float(r.std())  # torch.std: unbiased (N-1), as verl
    scale = 1.0 / (sd + eps) if norm_by_std else 1.0
    return GroupStats(mean=mean, std=sd, scale=scale, size=int(r.numel()))


def rloo_stats(rewards_G: torch.Tensor) -> GroupStats:
    """RLOO as an affine form: mean and scale G / (G - 1); a singleton keeps its reward (mean 0, scale 1)."""
    r = _rewards(rewards_G)
    g = r.numel()
    if g == 1:
        return GroupStats(mean=0.0, std=0.0, scale=1.0, size=1)
    return GroupStats(mean=float(r.mean()), std=0.0, scale=g / (g - 1), size=g)


def group_normalized(rewards_G: torch.Tensor, eps: float = GRPO_EPS, std: str = "unbiased") -> torch.Tensor:
    """(G,) float64 GRPO advantages (r - mean) / (std + eps)."""
    s = group_stats(rewards_G, True, eps, std)
    return (_rewards(rewards_G) - s.mean) / (s.std + eps)


def group_centered(rewards_G: torch.Tensor, eps: float = GRPO_EPS, std: str = "unbiased") -> torch.Tensor:
    """(G,) float64 Dr. GRPO advantages r - mean (eps unused; std decides only the singleton's mean)."""
    return _rewards(rewards_G) - group_stats(rewards_G, False, eps, std).mean


def leave_one_out(rewards_G: torch.Tensor, eps: float = GRPO_EPS, std: str = "unbiased") -> torch.Tensor:
    """(G,) float64 RLOO advantages r_i - mean of the others, written directly (the reference of rloo_stats)."""
    r = _rewards(rewards_G)
    g = r.numel()
    if g == 1:
        return r.clone()
    return r - (r.sum() - r) / (g - 1)


@dataclass(frozen=True)
class Estimator:
    """A group-wise advantage estimator: `advantages` is its definition (the lazy reference); `stats`, when
    given, its affine form A = (r - mean) * scale, which streams with two buffers per open group."""

    advantages: Callable[[torch.Tensor, float, str], torch.Tensor]  # (rewards_G, eps, std) -> (G,) float64
    stats: Callable[[torch.Tensor, float, str], GroupStats] | None  # (rewards_G, eps, std) -> its affine form
    # the affine form's scale is known only at the group's close (GRPO's 1 / (std + eps); RLOO's G / (G - 1) is
    # taken there too). False: scale 1 at every arrival (Dr. GRPO), so S_r folds into R at once (one buffer)
    scale_at_close: bool = True

    def advantage_of(self, rewards_G: torch.Tensor, eps: float = GRPO_EPS, std: str = "unbiased") -> dict[float, float]:
        """{reward value: advantage} of one group: what each (group, reward) bucket is weighted by at close."""
        adv = self.advantages(rewards_G, eps, std)
        out: dict[float, float] = {}
        for r, a in zip(_rewards(rewards_G).tolist(), adv.tolist(), strict=True):
            out.setdefault(float(r), float(a))
        return out


# name -> estimator: the source of the names; config.AdvNorm copies them (tests/test_config.py)
ADVANTAGES = {
    "group": Estimator(group_normalized, lambda r, eps, std: group_stats(r, True, eps, std)),
    "center": Estimator(group_centered, lambda r, eps, std: group_stats(r, False, eps, std), scale_at_close=False),
    "rloo": Estimator(leave_one_out, lambda r, eps, std: rloo_stats(r)),
}
