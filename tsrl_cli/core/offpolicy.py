"""Off-policy correction for the `async` baseline: truncated importance sampling (TIS).

Not part of gradient streaming (which is on-policy, ratio exactly 1); this is what the async
baseline needs because its data comes from older weights. verl / SkyRL semantics
(verl `compute_rollout_correction_weights`, token level; SkyRL's token TIS cap):

    w_t = min( exp(clamp(logp_old_t - logp_behavior_t, -20, 20)), cap ),   detached

logp_old is recomputed by the learner from its current weights (one step per round, so it equals
the current log-prob), logp_behavior is what the rollout engine sampled with. The weight multiplies
the per-token policy-gradient loss; KL and entropy terms are not reweighted (as in verl).
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # verl clamps the log-ratio to +-20 before exp


def tis_weights(old_logprobs_T: torch.Tensor, behavior_logprobs_T: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token truncated importance weights, detached.

    Args:
        old_logprobs_T: (..., T) log-probs of the sampled tokens under the learner's weights.
        behavior_logprobs_T: (..., T) log-probs the rollout engine sampled them with.
        cap: upper bound on each weight (verl's TIS threshold, SkyRL's token cap, e.g. 2.0).
    Returns:
        (..., T) weights in (0, cap]; positions outside the loss mask are meaningless (mask them).
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    log_ratio = (old_logprobs_T.detach() - behavior_logprobs_T.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap)
