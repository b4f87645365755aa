"""One round's policy gradient: the lazy reference and the learner engine that `sync`, `stream` and `async` share.

Both take the same `Objective` and the same frozen weights; only *when* each backward runs differs.
This module holds no formulas: it assembles core/ functions per row of a micro-batch.

  Objective(kind, loss)            grpo | opd, and the loss settings (config.LossConfig), checked
  lazy_loss(model, rollouts, obj)  every trajectory, one padded batch, one loss (verl style): the reference
  StreamLearner                    the engine: items arrive (a GRPO trajectory with its reward, an OPD turn
                                   with its teacher scores); what is queued is backwarded in micro-batches;
                                   group and round scalars join at their close

Micro-batching stays exact because one backward is taken per *fold target*, never across targets:
  - a GRPO group whose rewards are all known ("complete") has its advantages: any of its members, of
    any complete groups, go into the round buffer R in one backward with weights A_i;
  - members of an open group with the same reward share their weight in both S_r and S_1 (docs/
    streaming.md): one backward per (group, reward value) class, folded with (r - b) and 1;
  - OPD turns go into R (their scalar is known: 1, or 1/n_i once the trajectory ended under
    seq-mean-token-mean), or into their trajectory's unit buffer while n_i is still unknown;
    queued turns of one trajectory share one row: the longest prefix's forward scores them all.
    With opd_unit "trajectory" a trajectory's turns wait for its end and go to R in that one row.
The first arrival never waits for company: the engine backwards whatever is queued when it is free.

On a learner group (rl/group.py) every rank runs this engine on the same arrivals, plans the same
micro-batches, backwards its own one per lockstep pass, and the folding all-to-all puts each source
rank's gradient into that rank's target: the same buffers, sharded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tsrl_cli.config import BUFFER_DTYPES, OBJECTIVES, OPD_UNITS, LossConfig
from tsrl_cli.core.accumulator import RoundGradAccumulator
from tsrl_cli.core.advantages import ADVANTAGES, GroupStats, group_stats
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
from tsrl_cli.rl.hostfold import HostFold, auto_threads
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


# ---- the engine ---------------------------------------------------------------------------------------


@dataclass
class Item:
    """One learner input: a GRPO trajectory (turn None), an OPD turn k, or a whole OPD trajectory
    (turn None, OPD: every turn at once; what sync backwards)."""

    rollout: Rollout
    turn: int | None
    seq: int = 0  # arrival number: batches are formed in arrival order

    @property
    def end(self) -> int:
        return len(self.rollout.input_ids) if self.turn is None else self.rollout.turn_spans[self.turn][1]

    @property
    def span(self) -> tuple[int, int]:
        return (0, self.end) if self.turn is None else tuple(self.rollout.turn_spans[self.turn])


@dataclass
class MicroBatch:
    """Items backwarded together, and where each pass's gradient goes (rl.group.Fold)."""

    items: list[Item]
    target: tuple  # ("round",) | ("member", group_id, reward) | ("unit", key)
    rows: int = 0
    width: int = 0

    @property
    def tokens(self) -> int:
        """Padded token positions: what one forward and backward of this batch costs."""
        return self.rows * self.width


class LocalGrads:
    """The single-process backend: autograd.grad per pass, one tensor per trainable parameter."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self.templates = self.params
        self.passes = 0

    def backward(self, losses, folds_by_rank, fold) -> None:
        for k, loss in enumerate(losses):
            grads = torch.autograd.grad(loss, self.params, retain_graph=k < len(losses) - 1, allow_unused=True)
            self.passes += 1
            if folds_by_rank[k][0] is not None:
                fold(folds_by_rank[k][0], list(grads))


class StreamLearner:
    """The learner engine for one round (one rank, or every rank of a group alike).

    GRPO: `on_trajectory(r)` per finished trajectory, any order, groups interleaved; a group is
    complete when its `group_sizes[group_id]`-th member arrived. OPD: `on_turn(r, k)` per
    teacher-scored model turn, `end_trajectory(r)` when the trajectory ends. `step()` backwards the
    next micro-batch (one per rank), `drain()` all queued work; on_* alone only queue.
    `obj.loss.max_open_groups`: beyond this many open groups (GRPO) or open trajectories (OPD with
    seq-mean-token-mean), new ones are deferred: their items wait until the group completes (or the
    trajectory ends) and then join R with their final weights: still exact, costing no buffer.
    `opd_unit` (learner.opd_unit): "turn" backwards each OPD turn when it can, over its prefix (a lone
    turn re-encodes everything before it); "trajectory" holds a trajectory's turns until end_trajectory
    and backwards them in one row, the row its last turn alone would cover: the lazy batch's positions,
    no unit buffer, and the per-turn backwards before it, which never shorten that last one, skipped.
    """

    def __init__(self, model, obj: Objective, group_sizes: Mapping[str, int] | None = None, *,
                 grads=None, rank: int = 0, world: int = 1, max_tokens: int | None = None,
                 max_items: int | None = None, ref_model=None,
                 token_weights: Callable[[list[Rollout], torch.Tensor], torch.Tensor] | None = None,
                 threaded_host_fold: bool | None = None, chunk_tokens: int | None = None,
                 opd_unit: str = "turn"):
        if opd_unit not in OPD_UNITS:
            raise UsageError(f"OPD unit {opd_unit!r} is unknown; use one of {', '.join(OPD_UNITS)}")
        self.model, self.obj = model, obj
        self.hold_turns = obj.kind == "opd" and opd_unit == "trajectory"  # a trajectory's turns wait for its end
        self.chunk_tokens = chunk_tokens  # learner.logits_chunk_tokens: the LM head N positions at a time
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads = grads if grads is not None else LocalGrads(self.params)
        self.rank, self.world = rank, world
        lc = obj.loss
        # host buffers beside GPU gradients: folds leave the critical path (rl/hostfold.py)
        on_gpu = any(t.is_cuda for t in self.grads.templates)
        host_gpu = on_gpu and lc.buffer_device == "cpu"
        self.host_fold = HostFold(cuda=host_gpu, threaded=threaded_host_fold,
                                  device=next((t.device for t in self.grads.templates if t.is_cuda), None),
                                  threads=lc.host_fold_threads or auto_threads(world, host_gpu))
        self.acc = RoundGradAccumulator(self.grads.templates, dtype=None if lc.buffer_dtype == "float32" else torch.bfloat16,
                                        device="cpu" if lc.buffer_device == "cpu" else None,
                                        fold=self.host_fold, sync=self.host_fold.sync)
        self.group_sizes = dict(group_sizes or {})
        self.max_tokens, self.max_items = max_tokens, max_items
        self.ref_model, self.token_weights = ref_model, token_weights
        self.norm_by_std = ADVANTAGES[lc.adv_norm][1]
        self.per_traj_scale = lc.loss_agg == "seq-mean-token-mean"  # OPD: 1/n_i waits for the trajectory's end
        self.num_tokens = 0  # N: loss tokens of the round so far
        self._nonempty: set[tuple[str, int]] = set()  # B: sequences with >= 1 loss token
        self._arrived: Counter = Counter()
        self._rewards: dict[str, list[float]] = {}
        self._stats: dict[str, GroupStats] = {}  # complete groups: advantages known
        self._ended: dict[tuple[str, int], float] = {}  # OPD trajectories that ended: their w_i
        self._open: set = set()  # groups (GRPO) or trajectory keys (OPD units) holding buffers
        self._deferred: set = set()
        self._held: set = set()  # every group or unit the cap held back at least once (has_work's look included)
        self.queue: list[Item] = []
        self._seq = 0
        self.backwards = 0  # backward passes this rank ran (dummies included)
        self._loss_sum = 0.0  # this rank's round-target losses before Z (the lazy loss, once Z is known)
        self.loss: float | None = None
        self.batches: list[MicroBatch] = []  # every micro-batch of the round, in order (all ranks')

    # ---- arrivals ------------------------------------------------------------------------------
    def _count(self, r: Rollout, n: int) -> None:
        self.num_tokens += n
        if n:
            self._nonempty.add(r.key)

    def _queue(self, r: Rollout, turn: int | None) -> None:
        self._seq += 1
        self.queue.append(Item(r, turn, self._seq))

    def on_trajectory(self, r: Rollout) -> None:
        """GRPO: a trajectory and its reward arrived (queued; backwarded by step/drain)."""
        check_inputs([r], self.obj, self.ref_model is not None)
        gid = r.group_id
        if gid not in self.group_sizes:
            raise UsageError(f"rollout {r.key}: group {gid!r} has no declared size")
        if self._arrived[gid] >= self.group_sizes[gid]:
            raise UsageError(f"rollout {r.key}: group {gid!r} already has its {self.group_sizes[gid]} declared members")
        self._count(r, r.num_loss_tokens)
        if r.num_loss_tokens:  # no model token (the agent crashed at once): only its reward counts
            self._queue(r, None)
        self._rewards.setdefault(gid, []).append(float(r.reward))
        self._arrived[gid] += 1
        if self._arrived[gid] == self.group_sizes[gid]:  # complete: advantages known; its buffers join R
            rewards = torch.tensor(self._rewards[gid], dtype=torch.float64)
            self._stats[gid] = group_stats(rewards, self.norm_by_std, self.obj.loss.adv_eps)
            if gid in self._open:
                self.acc.close_group(gid, self._stats[gid])
                self._open.discard(gid)

    def on_turn(self, r: Rollout, k: int) -> None:
        """OPD: model turn k of trajectory r was scored by the teacher (queued).

        r holds the trajectory so far (at least up to turn k's end) with teacher log-probs. A turn's
        log-probs depend on its whole prefix: its row is the prefix up to the turn's end.
        """
        check_inputs([r], self.obj, self.ref_model is not None)
        n = r.turn_tokens(k)
        self._count(r, n)
        if n:
            self._queue(r, k)
        self._arrived[r.key] += 1
        if self._arrived[r.key] == len(r.turn_spans):  # a whole rollout given turn by turn (tsrl verify)
            self.end_trajectory(r)

    def on_opd_trajectory(self, r: Rollout) -> None:
        """OPD, all turns at once (the lazy baselines): one row over the whole trajectory."""
        check_inputs([r], self.obj, self.ref_model is not None)
        self._count(r, r.num_loss_tokens)
        if r.num_loss_tokens:
            self._queue(r, None)
        self.end_trajectory(r)

    def end_trajectory(self, r: Rollout) -> None:
        """OPD trajectory end: its per-sequence scalar (seq-mean-token-mean) is now known."""
        if r.key in self._ended:
            return
        self._ended[r.key] = seq_weight(self.obj.loss.loss_agg, r.num_loss_tokens) if self.per_traj_scale else 1.0
        if r.key in self._open:
            self.acc.close_unit(r.key, self._ended[r.key])
            self._open.discard(r.key)

    # ---- planning ------------------------------------------------------------------------------
    def _target(self, it: Item, opening: set) -> tuple | None:
        """Where this item's gradient goes now, or None while it must wait (a deferred group or unit)."""
        r = it.rollout
        if self.obj.kind == "grpo":
            gid = r.group_id
            if gid in self._stats:
                return ("round",)
            ident = gid
        else:
            if self.hold_turns and r.key not in self._ended:
                return None  # opd_unit trajectory: one row at the trajectory's end
            if not self.per_traj_scale or r.key in self._ended:
                return ("round",)
            ident = r.key
        if ident in self._deferred:
            return None
        if ident not in self._open and ident not in opening:
            cap = self.obj.loss.max_open_groups
            if cap is not None and len(self._open) + len(opening) >= cap:
                self._deferred.add(ident)
                self._held.add(ident)
                return None
            opening.add(ident)
        return ("member", ident, float(r.reward)) if self.obj.kind == "grpo" else ("unit", ident)

    def plan(self) -> list[MicroBatch]:
        """The next step's micro-batches (at most one per rank), from the queue, in arrival order."""
        classes: dict[tuple, list[Item]] = {}
        opening: set = set()
        for it in self.queue:
            t = self._target(it, opening)
            if t is not None:
                classes.setdefault(t, []).append(it)
        batches: list[MicroBatch] = []
        for target, items in classes.items():  # dicts keep insertion order: the first arrival's class first
            for chunk in self._chunks(items):
                batches.append(self._batch(chunk, target))
                if self.world == 1:  # one rank: the first batch; the next step replans with new arrivals
                    return batches
        while len(batches) < self.world:  # more ranks than batches: split the widest batch that can split
            splittable = [b for b in batches if len(self._rows(b.items)) > 1]
            if not splittable:
                break
            b = max(splittable, key=lambda b: b.tokens)
            rows = self._rows(b.items)
            half = {id(x) for row in rows[: len(rows) // 2] for x in row}
            i = batches.index(b)
            batches[i:i + 1] = [self._batch([x for x in b.items if id(x) in half], b.target),
                                self._batch([x for x in b.items if id(x) not in half], b.target)]
        return batches[: self.world]

    def _rows(self, items: list[Item]) -> list[list[Item]]:
        """Items sharing a row: an OPD trajectory's queued turns (the longest prefix scores them all)."""
        rows: dict = {}
        for it in items:
            rows.setdefault((it.rollout.key, it.turn is None) if self.obj.kind == "opd" else (it.rollout.key, it.seq),
                            []).append(it)
        return list(rows.values())

    def _chunks(self, items: list[Item]) -> list[list[Item]]:
        out: list[list[Item]] = []
        cur: list[list[Item]] = []
        width = 0
        for row in self._rows(items):
            w = max(it.end for it in row)
            if cur and ((self.max_items is not None and len(cur) + 1 > self.max_items)
                        or (self.max_tokens is not None and (len(cur) + 1) * max(width, w) > self.max_tokens)):
                out.append([x for r in cur for x in r])
                cur, width = [], 0
            cur.append(row)
            width = max(width, w)
        if cur:
            out.append([x for r in cur for x in r])
        return out

    def _batch(self, items: list[Item], target: tuple) -> MicroBatch:
        rows = self._rows(items)
        return MicroBatch(items, target, len(rows), max(it.end for it in items))

    @property
    def deferred(self) -> frozenset:
        """The groups (GRPO group ids) or trajectories (OPD keys) that max_open_groups held back at least once:
        their items waited for the group's close (or for a buffer to free) instead of opening one."""
        return frozenset(self._held)

    # ---- one step ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Items queued that can be backwarded now (deferred ones wait for their group or trajectory)."""
        opening: set = set()
        deferred = set(self._deferred)
        try:
            return any(self._target(it, opening) is not None for it in self.queue)
        finally:
            self._deferred = deferred  # has_work never decides a deferral

    def step(self) -> list[MicroBatch]:
        """Backward the next micro-batch of each rank (every rank calls this together); returns them all."""
        batches = self.plan()
        if not batches:
            return []
        mine = batches[self.rank] if self.rank < len(batches) else None
        losses = self._losses(mine)
        n_pass = max(self._passes(b) for b in batches)
        losses += [losses[0] * 0.0] * (n_pass - len(losses))  # lockstep: every rank runs as many passes
        folds = [[self._fold_of(b, k) for b in batches] + [None] * (self.world - len(batches)) for k in range(n_pass)]
        self._loss_sum += sum(float(l.detach()) for l, f in zip(losses, folds) if f[self.rank] is not None
                              and f[self.rank][0] == "round")
        self.grads.backward(losses, folds, self._apply)
        self.backwards += n_pass
        done = {id(it) for b in batches for it in b.items}
        self.queue = [it for it in self.queue if id(it) not in done]
        self.batches += batches
        for b in batches:  # the groups and units these batches opened now hold buffers
            if b.target[0] != "round":
                self._open.add(b.target[1])
        return batches

    def drain(self) -> None:
        while self.has_work():
            self.step()

    def _passes(self, b: MicroBatch) -> int:
        """GRPO members of an open group with a KL/entropy term: the term goes to R in a second pass."""
        reg = bool(self.obj.loss.kl_coef or self.obj.loss.entropy_coef)
        return 2 if b.target[0] == "member" and reg else 1

    def _fold_of(self, b: MicroBatch, k: int):
        if k >= self._passes(b):
            return None
        return ("round", 1.0) if k == 1 or b.target == ("round",) else b.target

    def _apply(self, fold: tuple, grads: list) -> None:
        if fold[0] == "member":
            self.acc.add_member(fold[1], fold[2], grads, self.norm_by_std)
        elif fold[0] == "unit":
            self.acc.add_to_unit(fold[1], grads)
        else:
            self.acc.add(grads, fold[1])

    def _losses(self, b: MicroBatch | None) -> list[torch.Tensor]:
        """This rank's losses for batch b, one per pass; a rank without a batch runs a zero loss."""
        device = next(self.model.parameters()).device
        if b is None:  # same forwards, same order as a rank with a batch: FSDP's all-gathers run in lockstep
            out = self.zero_loss()
            if self.ref_model is not None and self.obj.loss.kl_coef:
                with torch.no_grad():
                    forward_logprobs(self.ref_model, torch.zeros(1, 2, dtype=torch.long, device=device))
            return [out]
        rows = self._rows(b.items)
        heads = [max(row, key=lambda it: it.end) for row in rows]  # the row's rollout: its longest prefix
        T = b.width
        ids = pad_rows([h.rollout.input_ids[: h.end] for h in heads], T, torch.long, device)
        attn = pad_rows([[1] * h.end for h in heads], T, torch.long, device)
        mask_rows = []
        for row, h in zip(rows, heads):
            m = [0] * h.end
            for it in row:
                s, e = it.span
                m[s:e] = h.rollout.loss_mask[s:e]
            mask_rows.append(m)
        logp, ent = forward_logprobs(self.model, ids, attn, entropy=self.obj.loss.entropy_coef != 0,
                                     chunk_tokens=self.chunk_tokens)  # (B, T)
        mask = pad_rows(mask_rows, T, logp.dtype, device)

        def aligned(name):
            return pad_rows([getattr(h.rollout, name)[: h.end] for h in heads], T, logp.dtype, device)

        ref = None
        if self.obj.loss.kl_coef:
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = forward_logprobs(self.ref_model, ids, attn, chunk_tokens=self.chunk_tokens)[0].to(logp.dtype)
            else:
                ref = aligned("ref_logprobs")
        reg = _regularizer(self.obj, logp, ref, ent)
        w = torch.tensor([self._weight(h) for h in heads], dtype=torch.float64).to(logp)  # (B,)
        if self.obj.kind == "grpo" and b.target[0] == "member":  # G_i: advantage 1; S_r, S_1 take it at close
            main = pg_token_loss(logp, 1.0)
            if self.token_weights is not None:  # TIS: a detached per-token weight, linear like the advantage
                main = main * self.token_weights([h.rollout for h in heads], logp)
            out = [(w * (main * mask).sum(-1)).sum()]
            if reg is not None:
                out.append((w * (reg * mask).sum(-1)).sum())
            return out
        if self.obj.kind == "grpo":
            adv = torch.tensor([[self._stats[h.rollout.group_id].advantage(h.rollout.reward)] for h in heads],
                               dtype=torch.float64).to(logp)
            main = pg_token_loss(logp, adv)
        else:
            main = _opd_main(self.obj, logp, aligned("teacher_logprobs"))
        if self.token_weights is not None:
            main = main * self.token_weights([h.rollout for h in heads], logp)
        per_tok = main if reg is None else main + reg
        return [(w * (per_tok * mask).sum(-1)).sum()]

    def zero_loss(self) -> torch.Tensor:
        """A loss of 0 over a 2-token forward: the pass a rank runs when it has nothing to backward."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=next(self.model.parameters()).device)
        return forward_logprobs(self.model, ids)[0].sum() * 0.0

    def _weight(self, it: Item) -> float:
        """w_i: the per-sequence part of the aggregation (seq-mean-token-mean: 1/n_i), where known now."""
        r = it.rollout
        if self.obj.kind == "grpo":
            return seq_weight(self.obj.loss.loss_agg, r.num_loss_tokens)
        return self._ended.get(r.key, 1.0) if self.per_traj_scale else 1.0

    # ---- round close ---------------------------------------------------------------------------
    def close_round(self) -> list[torch.Tensor]:
        """Apply the round scalar (1/N, 1/B or 1/C) once; the gradient per template (parameter or shard)."""
        if self.queue:
            raise RuntimeError(f"round closed with {len(self.queue)} item(s) not backwarded (a group or trajectory "
                               "never completed)")
        z = round_scale(self.obj.loss.loss_agg, self.num_tokens, len(self._nonempty), self.obj.loss.global_batch_size,
                        self.obj.loss.norm_constant)
        self.loss = z * self._loss_sum
        out = self.acc.finalize(z)
        self.host_fold.close()
        return out
