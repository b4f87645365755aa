"""What one round's loss is, and the lazy reference every round learner is tested against.

  Objective(kind, loss)            grpo | opd, and the loss settings (config.LossConfig), checked
  check_inputs(rollouts, obj)      the per-token fields an objective needs are present
  grpo_advantages(rollouts, obj)   per-trajectory float64 advantages, each group on its own
  regularizer / opd_term           the per-token terms a micro-batch's loss is assembled from
  lazy_loss(model, rollouts, obj)  every trajectory, one padded batch, one loss (verl style)

Holds no formula of its own: it assembles core/ functions. The streaming engine (rl/learner.py)
computes the same loss from factored weights; the float64 tests compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tsrl_cli.config import OBJECTIVES, LossConfig, ObjectiveKind
from tsrl_cli.core.advantages import ADVANTAGES
from tsrl_cli.core.losses import agg_loss, kl_penalty, opd_k3_loss, opd_pg_advantages, pg_token_loss
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import forward_logprobs
from tsrl_cli.rollouts import Rollout


@dataclass(frozen=True)
class Objective:
    """What the round's loss is: the objective and its loss settings, checked on construction.

    The loss fields are defined and checked once, in config.LossConfig (`tsrl train`'s `loss.*` keys and
    `tsrl verify`'s flags); an objective also refuses the settings outside the scope where streaming is exact.
    """

    kind: ObjectiveKind = "grpo"
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self):
        if self.kind not in OBJECTIVES:
            raise UsageError(f"objective {self.kind!r} is unknown; use {' or '.join(OBJECTIVES)}")
        self.loss.check()
        self.loss.check_scope()


def pad_rows(rows: Sequence[Sequence[float]], length: int, dtype, device) -> torch.Tensor:
    out = torch.zeros(len(rows), length, dtype=dtype, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:length], dtype=dtype)
    return out


def regularizer(obj: Objective, logp, ref_logp, ent):
    """Advantage-free per-token terms: kl_coef * KL - entropy_coef * H (or None when both are off)."""
    reg = None
    if obj.loss.kl_coef:
        reg = obj.loss.kl_coef * kl_penalty(logp, ref_logp, obj.loss.kl_type)
    if obj.loss.entropy_coef:
        term = -obj.loss.entropy_coef * ent
        reg = term if reg is None else reg + term
    return reg


def opd_term(obj: Objective, logp, teacher_logp):
    if obj.loss.opd_form == "pg":
        return pg_token_loss(logp, opd_pg_advantages(logp, teacher_logp, obj.loss.opd_coef))
    return obj.loss.opd_coef * opd_k3_loss(logp, teacher_logp)


def check_inputs(rollouts: Sequence[Rollout], obj: Objective, ref_model: bool = False) -> None:
    for r in rollouts:
        if obj.kind == "opd" and r.teacher_logprobs is None:
            raise UsageError(f"rollout {r.key}: OPD needs teacher_logprobs (in the file, or pass --teacher DIR)")
        if obj.loss.kl_coef and r.ref_logprobs is None and not ref_model:
            raise UsageError(f"rollout {r.key}: a KL term needs ref_logprobs (in the file, or a reference model)")


def grpo_advantages(rollouts: Sequence[Rollout], obj: Objective) -> dict[tuple[str, int], float]:
    """Per-trajectory float64 advantage, each group normalized on its own (verl's index grouping), from its valid
    members: masked ones (an infrastructure failure, Rollout.masked) are left out, and a group that masking left
    with fewer than two valid members gets advantage 0 (core/streaming.py StreamingRound.mask_trajectory)."""
    fn = ADVANTAGES[obj.loss.adv_norm].advantages
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    out = {}
    for members in groups.values():
        valid = [m for m in members if not m.masked]
        if len(valid) < len(members) and len(valid) < 2:
            out.update({m.key: 0.0 for m in valid})
            continue
        adv = fn(torch.tensor([m.reward for m in valid], dtype=torch.float64), obj.loss.adv_eps, obj.loss.adv_std)
        out.update({m.key: float(a) for m, a in zip(valid, adv, strict=True)})
    return out


def lazy_loss(model, rollouts: Sequence[Rollout], obj: Objective,
              token_weights: Callable[[torch.Tensor], torch.Tensor] | None = None,
              chunk_tokens: int | None = None) -> torch.Tensor:
    """The lazy synchronous loss: all trajectories in one padded batch, verl's agg_loss, one scalar.

    The reference the engine is tested against (it is written the way verl writes it, not through
    the factored weights the engine uses). token_weights(logp_B_T) -> (B, T) detached weights on each
    token's main term: truncated importance sampling (schedules.tis). KL and entropy are not reweighted.
    chunk_tokens: the LM head and log-softmax that many positions at a time (losses.chunked_token_logprobs: same
    values).
    """
    check_inputs(rollouts, obj)
    if obj.kind == "grpo":  # masked trajectories (infrastructure failures) are out of the loss and its counts
        adv = grpo_advantages(rollouts, obj)
        rollouts = [r for r in rollouts if not r.masked]
        if not rollouts:
            raise UsageError("every trajectory of the round is masked (an infrastructure failure): no loss")
    device = next(model.parameters()).device
    T = max(len(r.input_ids) for r in rollouts)
    ids = pad_rows([r.input_ids for r in rollouts], T, torch.long, device)
    attn = pad_rows([[1] * len(r.input_ids) for r in rollouts], T, torch.long, device)
    mask = pad_rows([r.loss_mask for r in rollouts], T, torch.long, device)
    logp, ent = forward_logprobs(model, ids, attn, entropy=obj.loss.entropy_coef != 0, chunk_tokens=chunk_tokens)

    def aligned(name):  # (B, T) tensor of an optional per-token field, in logp's dtype
        return pad_rows([getattr(r, name) for r in rollouts], T, logp.dtype, device)

    if obj.kind == "grpo":
        adv_B_1 = (torch.tensor([[adv[r.key]] for r in rollouts], dtype=torch.float64)
                   .to(device=logp.device, dtype=logp.dtype))
        main = pg_token_loss(logp, adv_B_1)
    else:
        main = opd_term(obj, logp, aligned("teacher_logprobs"))
    if token_weights is not None:
        main = main * token_weights(logp)
    agg = dict(mode=obj.loss.loss_agg, global_batch_size=obj.loss.global_batch_size,
               norm_constant=obj.loss.norm_constant)
    loss = agg_loss(main, mask, **agg)
    if obj.loss.kl_coef:  # verl: policy_loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss
        kl = kl_penalty(logp, aligned("ref_logprobs"), obj.loss.kl_type)
        loss = loss + obj.loss.kl_coef * agg_loss(kl, mask, **agg)
    if obj.loss.entropy_coef:
        loss = loss - obj.loss.entropy_coef * agg_loss(ent, mask, **agg)
    return loss
