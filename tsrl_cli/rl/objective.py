"""What one round's loss is, and the lazy reference every learner engine is tested against.

  Objective(kind, loss)            grpo | opd, and the loss settings (config.LossConfig), checked
  check_inputs(rollouts, obj)      the per-token fields an objective needs are present
  grpo_advantages(rollouts, obj)   per-trajectory float64 advantages, each group on its own
  regularizer / opd_main           the per-token terms a micro-batch's loss is assembled from
  lazy_loss(model, rollouts, obj)  every trajectory, one padded batch, one loss (verl style)

Holds no formula of its own: it assembles core/ functions. The streaming engine (rl/learner.py)
computes the same loss from factored weights; the float64 tests compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tsrl_cli.config import BUFFER_DTYPES, OBJECTIVES, LossConfig
from tsrl_cli.core.advantages import ADVANTAGES
from tsrl_cli.core.losses import (
    KL_TYPES,
    LOSS_AGG_MODES,
    agg_loss,
    kl_penalty,
    opd_k3_loss,
    opd_pg_advantages,
    pg_token_loss,
)
from tsrl_cli.errors import ScopeError, UsageError
from tsrl_cli.policy import forward_logprobs
from tsrl_cli.rollouts import Rollout

BUFFER_DEVICES = ("device", "cpu")


@dataclass(frozen=True)
class Objective:
    """What the round's loss is: the objective and its loss settings, checked on construction.

    The loss fields are defined once, in config.LossConfig (`tsrl train`'s `loss.*` keys and `tsrl
    verify`'s flags); this is the one place they are checked against core/'s registries and against
    the scope where streaming is exact.
    """

    kind: str = "grpo"  # grpo | opd
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self):
        lc = self.loss
        if self.kind not in OBJECTIVES:
            raise UsageError(f"objective {self.kind!r} is unknown; use grpo or opd")
        if lc.loss_agg not in LOSS_AGG_MODES:
            raise UsageError(f"loss aggregation {lc.loss_agg!r} is unknown; use one of {', '.join(LOSS_AGG_MODES)}")
        if lc.adv_norm not in ADVANTAGES:
            raise UsageError(f"advantage normalization {lc.adv_norm!r} is unknown; use group or center")
        if lc.kl_type not in KL_TYPES:
            raise UsageError(f"KL estimator {lc.kl_type!r} is unknown; use one of {', '.join(KL_TYPES)}")
        if lc.opd_form not in ("pg", "k3"):
            raise UsageError(f"OPD form {lc.opd_form!r} is unknown; use pg or k3")
        if lc.adv_eps < 0:
            raise UsageError(f"advantage epsilon {lc.adv_eps}: must be >= 0")
        if lc.global_batch_size is not None and lc.global_batch_size < 1:
            raise UsageError(f"global batch size {lc.global_batch_size}: must be >= 1 (or unset: the round's "
                             "non-empty sequences)")
        if lc.max_open_groups is not None and lc.max_open_groups < 0:
            raise UsageError(f"max open groups {lc.max_open_groups}: must be >= 0 (or unset: no cap)")
        if lc.buffer_device not in BUFFER_DEVICES:
            raise UsageError(f"buffer device {lc.buffer_device!r} is unknown; use device (beside the parameters) "
                             "or cpu (host memory)")
        if lc.host_fold_threads < 0:
            raise UsageError(f"host fold threads {lc.host_fold_threads}: must be >= 0 (0: auto)")
        if lc.buffer_dtype not in BUFFER_DTYPES:
            raise UsageError(f"buffer dtype {lc.buffer_dtype!r} is unknown; use float32 (float64 for a float64 "
                             "model) or bfloat16 (opt-in: half the bytes, not exact)")
        if lc.loss_agg == "seq-mean-token-sum-norm" and not (lc.norm_constant and lc.norm_constant > 0):
            raise UsageError(
                "loss aggregation seq-mean-token-sum-norm needs an explicit constant: pass --norm-constant C "
                "(e.g. the max response length); verl's default, the padded micro-batch length, depends on batching"
            )
        why = []
        if lc.ppo_epochs != 1:
            why.append(f"ppo_epochs={lc.ppo_epochs} (later epochs see moved weights, ratio != 1)")
        if lc.mini_batches_per_round != 1:
            why.append(f"mini_batches_per_round={lc.mini_batches_per_round} (several optimizer steps per round)")
        if lc.old_logprobs != "recompute":
            why.append(f"old_logprobs={lc.old_logprobs} (clipping against stale log-probs depends on sign(A))")
        if lc.adv_batch_whiten:
            why.append("adv_batch_whiten (a round-level advantage statistic with no accumulator of its own)")
        if why:
            raise ScopeError(
                "not exact under gradient streaming: " + "; ".join(why)
                + ". Use one step per round with recomputed old log-probs (docs/streaming.md, 'Scope')"
            )


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


def opd_main(obj: Objective, logp, teacher_logp):
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
    """Per-trajectory float64 advantage, each group normalized on its own (verl's index grouping)."""
    fn = ADVANTAGES[obj.loss.adv_norm][0]
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    out = {}
    for members in groups.values():
        adv = fn(torch.tensor([m.reward for m in members], dtype=torch.float64), obj.loss.adv_eps)
        out.update({m.key: float(a) for m, a in zip(members, adv)})
    return out


def lazy_loss(model, rollouts: Sequence[Rollout], obj: Objective,
              token_weights: Callable[[torch.Tensor], torch.Tensor] | None = None,
              chunk_tokens: int | None = None) -> torch.Tensor:
    """The lazy synchronous loss: all trajectories in one padded batch, verl's agg_loss, one scalar.

    The reference the engine is tested against (it is written the way verl writes it, not through
    the factored weights the engine uses). token_weights(logp_B_T) -> (B, T) detached weights on each
    token's main term: truncated importance sampling (schedules.tis). KL and entropy are not reweighted.
    chunk_tokens: the LM head and log-softmax that many positions at a time (losses.chunked_token_logprobs: same values).
    """
    check_inputs(rollouts, obj)
    device = next(model.parameters()).device
    T = max(len(r.input_ids) for r in rollouts)
    ids = pad_rows([r.input_ids for r in rollouts], T, torch.long, device)
    attn = pad_rows([[1] * len(r.input_ids) for r in rollouts], T, torch.long, device)
    mask = pad_rows([r.loss_mask for r in rollouts], T, torch.long, device)
    logp, ent = forward_logprobs(model, ids, attn, entropy=obj.loss.entropy_coef != 0, chunk_tokens=chunk_tokens)

    def aligned(name):  # (B, T) tensor of an optional per-token field, in logp's dtype
        return pad_rows([getattr(r, name) for r in rollouts], T, logp.dtype, device)

    if obj.kind == "grpo":
        adv = grpo_advantages(rollouts, obj)
        adv_B_1 = torch.tensor([[adv[r.key]] for r in rollouts], dtype=torch.float64).to(device=logp.device, dtype=logp.dtype)
        main = pg_token_loss(logp, adv_B_1)
    else:
        main = opd_main(obj, logp, aligned("teacher_logprobs"))
    if token_weights is not None:
        main = main * token_weights(logp)
    agg = dict(mode=obj.loss.loss_agg, global_batch_size=obj.loss.global_batch_size, norm_constant=obj.loss.norm_constant)
    loss = agg_loss(main, mask, **agg)
    if obj.loss.kl_coef:  # verl: policy_loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss
        loss = loss + obj.loss.kl_coef * agg_loss(kl_penalty(logp, aligned("ref_logprobs"), obj.loss.kl_type), mask, **agg)
    if obj.loss.entropy_coef:
        loss = loss - obj.loss.entropy_coef * agg_loss(ent, mask, **agg)
    return loss
