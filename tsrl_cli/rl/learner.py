"""One round's policy gradient, two timings: lazy (`sync`) and streaming (`stream`).

Both take the same `Objective` and the same frozen weights; only *when* each backward runs
differs.  This module holds no formulas: it assembles core/ functions per trajectory or turn.

  Objective(kind, loss)                  grpo | opd, and the loss settings (config.LossConfig), checked
  lazy_loss(model, rollouts, obj)        every trajectory, one padded batch, one loss (verl style)
  StreamLearner.on_trajectory(r)         GRPO: backward the moment a trajectory's reward exists
  StreamLearner.on_turn(r, k)            OPD: backward the moment turn k's teacher scores exist
  StreamLearner.close_round()            apply the round scalar once -> gradient list
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tsrl_cli.config import OBJECTIVES, LossConfig
from tsrl_cli.core.accumulator import RoundGradAccumulator
from tsrl_cli.core.advantages import ADVANTAGES, group_stats
from tsrl_cli.core.losses import (
    KL_TYPES,
    LOSS_AGG_MODES,
    agg_loss,
    kl_penalty,
    opd_k3_loss,
    opd_pg_advantages,
    pg_token_loss,
    round_scale,
    seq_weight,
)
from tsrl_cli.errors import ScopeError, UsageError
from tsrl_cli.policy import forward_logprobs
from tsrl_cli.rollouts import Rollout


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
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _regularizer(obj: Objective, logp, ref_logp, ent):
    """Advantage-free per-token terms: kl_coef * KL - entropy_coef * H (or None when both are off)."""
    reg = None
    if obj.loss.kl_coef:
        reg = obj.loss.kl_coef * kl_penalty(logp, ref_logp, obj.loss.kl_type)
    if obj.loss.entropy_coef:
        term = -obj.loss.entropy_coef * ent
        reg = term if reg is None else reg + term
    return reg


def _opd_main(obj: Objective, logp, teacher_logp):
    if obj.loss.opd_form == "pg":
        return pg_token_loss(logp, opd_pg_advantages(logp, teacher_logp, obj.loss.opd_coef))
    return obj.loss.opd_coef * opd_k3_loss(logp, teacher_logp)


def check_inputs(rollouts: Sequence[Rollout], obj: Objective) -> None:
    for r in rollouts:
        if obj.kind == "opd" and r.teacher_logprobs is None:
            raise UsageError(f"rollout {r.key}: OPD needs teacher_logprobs (in the file, or pass --teacher DIR)")
        if obj.loss.kl_coef and r.ref_logprobs is None:
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
              token_weights: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The lazy synchronous loss: all trajectories in one padded batch, verl's agg_loss, one scalar.

    token_weights(logp_B_T) -> (B, T) detached weights on each token's main (policy-gradient or OPD)
    term, from the batch's log-probs: the async baseline's truncated importance sampling
    (schedules.tis). KL and entropy terms are not reweighted (verl).
    """
    check_inputs(rollouts, obj)
    device = next(model.parameters()).device
    T = max(len(r.input_ids) for r in rollouts)
    ids = pad_rows([r.input_ids for r in rollouts], T, torch.long, device)
    attn = pad_rows([[1] * len(r.input_ids) for r in rollouts], T, torch.long, device)
    mask = pad_rows([r.loss_mask for r in rollouts], T, torch.long, device)
    logp, ent = forward_logprobs(model, ids, attn, entropy=obj.loss.entropy_coef != 0)  # (B, T)

    def aligned(name):  # (B, T) tensor of an optional per-token field, in logp's dtype
        return pad_rows([getattr(r, name) for r in rollouts], T, logp.dtype, device)

    if obj.kind == "grpo":
        adv = grpo_advantages(rollouts, obj)
        adv_B_1 = torch.tensor([[adv[r.key]] for r in rollouts], dtype=torch.float64).to(device=logp.device, dtype=logp.dtype)
        main = pg_token_loss(logp, adv_B_1)
    else:
        main = _opd_main(obj, logp, aligned("teacher_logprobs"))
    if token_weights is not None:
        main = main * token_weights(logp)
    agg = dict(mode=obj.loss.loss_agg, global_batch_size=obj.loss.global_batch_size, norm_constant=obj.loss.norm_constant)
    loss = agg_loss(main, mask, **agg)
    if obj.loss.kl_coef:  # verl: policy_loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss
        loss = loss + obj.loss.kl_coef * agg_loss(kl_penalty(logp, aligned("ref_logprobs"), obj.loss.kl_type), mask, **agg)
    if obj.loss.entropy_coef:
        loss = loss - obj.loss.entropy_coef * agg_loss(ent, mask, **agg)
    return loss


class StreamLearner:
    """Gradient streaming for one round: each backward runs when its input arrives.

    GRPO: `on_trajectory` per finished trajectory (any order, groups interleaved); a group closes
    when its `group_sizes[group_id]`-th member arrives. OPD: `on_turn(r, k)` per teacher-scored
    model turn (any order); a trajectory ends when all its turns arrived.
    `obj.loss.max_open_groups`: beyond this many open groups (GRPO) or open trajectories (OPD with
    seq-mean-token-mean), new ones are deferred: inputs are kept, and every backward of that group
    runs at its close with the final advantage, still exact, costing no buffer.
    """

    def __init__(
        self,
        model,
        obj: Objective,
        group_sizes: Mapping[str, int] | None = None,
    ):
        self.model, self.obj = model, obj
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.acc = RoundGradAccumulator(self.params)
        self.group_sizes = dict(group_sizes or {})
        self.max_open_groups = obj.loss.max_open_groups
        self.norm_by_std = ADVANTAGES[obj.loss.adv_norm][1]
        self.num_tokens = 0  # N: loss tokens of the round so far
        self._nonempty: set[tuple[str, int]] = set()  # B: sequences with >= 1 loss token
        self._arrived: Counter = Counter()
        self._streaming: set = set()  # group ids (GRPO) or trajectory keys (OPD units) streamed
        self._deferred: dict = {}  # id -> held items, computed at close
        self.backwards = 0

    # ---- helpers -----------------------------------------------------------------------------
    def _grads(self, loss: torch.Tensor, retain: bool = False):
        self.backwards += 1
        return torch.autograd.grad(loss, self.params, retain_graph=retain, allow_unused=True)

    def _row(self, r: Rollout, end: int, start: int = 0):
        """Forward input_ids[:end]; returns logp, entropy, mask restricted to [start, end)."""
        device = self.params[0].device
        ids = torch.tensor([r.input_ids[:end]], dtype=torch.long, device=device)
        logp, ent = forward_logprobs(self.model, ids, entropy=self.obj.loss.entropy_coef != 0)
        mask = torch.tensor([r.loss_mask[:end]], dtype=logp.dtype, device=device)
        mask[:, :start] = 0

        def aligned(name):
            v = getattr(r, name)
            return None if v is None else torch.tensor([v[:end]], dtype=logp.dtype, device=device)

        ref = aligned("ref_logprobs") if self.obj.loss.kl_coef else None
        return logp, ent, mask, ref, aligned

    def _should_defer(self, ident) -> bool:
        if ident in self._streaming:
            return False
        if ident in self._deferred:
            return True
        if self.max_open_groups is not None and self.acc.open_groups + self.acc.open_units >= self.max_open_groups:
            self._deferred[ident] = []
            return True
        self._streaming.add(ident)
        return False

    def _count(self, r: Rollout, n: int) -> None:
        self.num_tokens += n
        if n:
            self._nonempty.add(r.key)

    # ---- GRPO ----------------------------------------------------------------------------------
    def on_trajectory(self, r: Rollout) -> None:
        """A trajectory and its reward arrived: backward now (unless its group is deferred)."""
        check_inputs([r], self.obj)
        gid = r.group_id
        if gid not in self.group_sizes:
            raise UsageError(f"rollout {r.key}: group {gid!r} has no declared size")
        if self._arrived[gid] >= self.group_sizes[gid]:
            raise UsageError(f"rollout {r.key}: group {gid!r} already has its {self.group_sizes[gid]} declared members")
        n = r.num_loss_tokens
        self._count(r, n)
        if self._should_defer(gid):
            self._deferred[gid].append(r)
        elif n == 0:  # no model token (e.g. the agent crashed at once): only its reward counts
            self.acc.add_member(gid, r.reward, [None] * len(self.params), self.norm_by_std)
        else:
            w = seq_weight(self.obj.loss.loss_agg, n)
            logp, ent, mask, ref, _ = self._row(r, len(r.input_ids))
            # G_i: surrogate with advantage 1; the group's advantage joins at close (accumulator).
            pg = w * (pg_token_loss(logp, 1.0) * mask).sum()
            reg = _regularizer(self.obj, logp, ref, ent)
            self.acc.add_member(gid, r.reward, self._grads(pg, retain=reg is not None), self.norm_by_std)
            if reg is not None:  # KL / entropy do not depend on the group: straight into R
                self.acc.add(self._grads(w * (reg * mask).sum()))
        self._arrived[gid] += 1
        if self._arrived[gid] == self.group_sizes[gid]:
            self._close_group(gid)

    def _close_group(self, gid: str) -> None:
        held = self._deferred.pop(gid, None)
        if held is None:
            self.acc.close_group(gid, self.norm_by_std, self.obj.loss.adv_eps)
            return
        stats = group_stats(torch.tensor([m.reward for m in held], dtype=torch.float64), self.norm_by_std, self.obj.loss.adv_eps)
        for r in held:  # deferred group: advantages known, one backward per member straight into R
            logp, ent, mask, ref, _ = self._row(r, len(r.input_ids))
            per_tok = pg_token_loss(logp, stats.advantage(r.reward))
            reg = _regularizer(self.obj, logp, ref, ent)
            if reg is not None:
                per_tok = per_tok + reg
            w = seq_weight(self.obj.loss.loss_agg, r.num_loss_tokens)
            self.acc.add(self._grads(w * (per_tok * mask).sum()))

    # ---- OPD -----------------------------------------------------------------------------------
    def on_turn(self, r: Rollout, k: int) -> None:
        """Model turn k of trajectory r was scored by the teacher: backward this turn now.

        The forward covers input_ids[:end_k] (the turn's log-probs depend on the whole prefix;
        re-encoding it per turn is the O(T^2) cost SkyRL's step-wise docs warn about).
        """
        check_inputs([r], self.obj)
        n = r.turn_tokens(k)
        self._count(r, n)
        per_traj_scale = self.obj.loss.loss_agg == "seq-mean-token-mean"  # 1/n_i waits for the last turn
        if per_traj_scale and self._should_defer(r.key):
            self._deferred[r.key].append(k)
        else:
            loss = self._turn_loss(r, k)
            if loss is not None:
                if per_traj_scale:
                    self.acc.add_to_unit(r.key, self._grads(loss))
                else:
                    self.acc.add(self._grads(loss))  # w_i = 1 in every mode but seq-mean-token-mean
        self._arrived[r.key] += 1
        if self._arrived[r.key] == len(r.turn_spans):
            self.end_trajectory(r)

    def _turn_loss(self, r: Rollout, k: int):
        s, e = r.turn_spans[k]
        if r.turn_tokens(k) == 0:
            return None
        logp, ent, mask, ref, aligned = self._row(r, e, start=s)
        per_tok = _opd_main(self.obj, logp, aligned("teacher_logprobs"))
        reg = _regularizer(self.obj, logp, ref, ent)
        if reg is not None:
            per_tok = per_tok + reg
        return (per_tok * mask).sum()

    def end_trajectory(self, r: Rollout) -> None:
        """OPD trajectory end: its per-sequence scalar (seq-mean-token-mean) is now known."""
        if self.obj.loss.loss_agg != "seq-mean-token-mean":
            return
        w = seq_weight(self.obj.loss.loss_agg, r.num_loss_tokens)
        held = self._deferred.pop(r.key, None)
        if held is None:
            self.acc.close_unit(r.key, w)
            return
        for k in held:
            loss = self._turn_loss(r, k)
            if loss is not None:
                self.acc.add(self._grads(loss), w)

    # ---- round close ---------------------------------------------------------------------------
    def close_round(self) -> list[torch.Tensor]:
        """Apply the round scalar (1/N, 1/B or 1/C) once and return the gradient per parameter."""
        z = round_scale(
            self.obj.loss.loss_agg, self.num_tokens, len(self._nonempty), self.obj.loss.global_batch_size, self.obj.loss.norm_constant
        )
        return self.acc.finalize(z)
