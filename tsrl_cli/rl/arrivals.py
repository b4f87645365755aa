"""What reaches the round learner, and the objective's rules for it: where each arrival's gradient goes.

  Arrival        one queued unit of backward work: a GRPO trajectory with its reward, an OPD turn with
                 its teacher scores, or a whole OPD trajectory (turn None: every turn at once, sync)
  OpenBuffers    which groups (GRPO) or trajectories (OPD units) hold streaming buffers now, under
                 loss.max_open_groups; the rest are deferred until their scalar is known
  GrpoRules      a trajectory is one row; its fold target is its open group's (S_r, S_1) per reward
                 value, or R once the group is complete and its advantages are known
  OpdRules       a turn's row is its prefix, and a trajectory's queued turns share one row; R, or the
                 trajectory's unit buffer while its 1/n_i (seq-mean-token-mean) is unknown
  RULES          {"grpo": GrpoRules, "opd": OpdRules}: chosen once by the objective's name

A rules object keeps the arrival bookkeeping of its objective (through the streaming contract,
core/streaming.py: groups, rewards, statistics; ended trajectories and their weights), closes a buffer
when its scalar becomes known,
and gives the per-row pieces of a micro-batch's loss (rl/batchloss.py). It never runs a backward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch

from tsrl_cli.core.losses import pg_token_loss, seq_weight
from tsrl_cli.core.streaming import StreamingRound
from tsrl_cli.errors import UsageError
from tsrl_cli.rl.objective import Objective, opd_term
from tsrl_cli.rollouts import Rollout


@dataclass
class Arrival:
    """One learner input: a GRPO trajectory (turn None), an OPD turn k, or a whole OPD trajectory
    (turn None, OPD: every turn at once; what sync backwards)."""

    rollout: Rollout
    turn: int | None
    seq: int = 0  # arrival number: batches are formed in arrival order
    row: Hashable = field(default=None)  # arrivals with the same row share one row of a micro-batch
    start: int = 0  # where its row starts: 0, or its group's prompt cut (rl/prefix.py: positions before it are past)
    # positions [0, end) its row covers: a turn's end, or a whole trajectory's up to its last scored token (what
    # follows it, a last tool output, changes no log-prob before it: causal attention)
    end: int = field(init=False)

    def __post_init__(self):
        r = self.rollout
        if self.turn is not None:
            self.end = r.turn_spans[self.turn][1]
        else:
            scored = [j for j, m in enumerate(r.loss_mask) if m]
            self.end = scored[-1] + 1 if scored else len(r.input_ids)

    @property
    def span(self) -> tuple[int, int]:
        return (0, self.end) if self.turn is None else tuple(self.rollout.turn_spans[self.turn])


class OpenBuffers:
    """The groups or units holding buffers, and the cap on them (loss.max_open_groups, None: no cap).

    A new group or unit beyond the cap is deferred: its arrivals wait until its scalar is known, then
    join R with their final weights (exact, costing no buffer)."""

    def __init__(self, cap: int | None):
        self.cap = cap
        self.open: set = set()
        self.deferred: set = set()
        self.held: set = set()  # every ident the cap held back at least once (has_work's look included)

    def admit(self, ident: Hashable, opening: set) -> bool:
        """Whether `ident`'s arrivals may fold into a buffer now (`opening`: idents this plan opens)."""
        if ident in self.deferred:
            return False
        if ident not in self.open and ident not in opening:
            if self.cap is not None and len(self.open) + len(opening) >= self.cap:
                self.deferred.add(ident)
                self.held.add(ident)
                return False
            opening.add(ident)
        return True

    def release(self, ident: Hashable) -> bool:
        """The ident's scalar is known: True if it held a buffer (which the caller closes)."""
        if ident in self.open:
            self.open.discard(ident)
            return True
        return False


Tally = Callable[[Rollout, int], None]  # (rollout, loss tokens it brings): the round's N and B
Queue = Callable[[Rollout, "int | None", Hashable], None]  # (rollout, turn, row): an arrival for the queue


class GrpoRules:
    """GRPO: `on_trajectory(r)` per finished trajectory, any order, groups interleaved; a group is
    complete when its `group_sizes[group_id]`-th member arrived, and its advantages are then known.
    The group ledger is the streaming contract's (core/streaming.py StreamingRound): its estimator, its
    buffer form (affine S_r, S_1 or reward-value buckets) and its rails.
    granularity (learner.granularity): "trajectory" backwards a member when the learner is free; "group"
    holds a group's members until it is complete, then backwards them into R with their advantages."""

    kind = "grpo"

    def __init__(self, obj: Objective, group_sizes: Mapping[str, int], rnd: StreamingRound,
                 buffers: OpenBuffers, tally: Tally, queue: Queue, granularity: str = "trajectory"):
        self.obj, self.rnd, self.buffers, self.tally, self.queue = obj, rnd, buffers, tally, queue
        self.group_sizes = dict(group_sizes)
        self.hold_groups = granularity == "group"

    def on_trajectory(self, r: Rollout) -> None:
        gid = r.group_id
        if gid not in self.group_sizes:
            raise UsageError(f"rollout {r.key}: group {gid!r} has no declared size")
        if gid in self.rnd.stats:
            raise UsageError(f"rollout {r.key}: group {gid!r} already has its {self.group_sizes[gid]} declared members")
        if not self.rnd.is_open(gid):
            self.rnd.open_group(gid, self.group_sizes[gid])
        if r.masked:  # its sandbox or engine failed, not the agent: neither in the group's statistics nor the loss
            self.rnd.mask_trajectory(gid, trajectory_id=r.sample_index)
        else:
            self.rnd.close_trajectory(gid, r.reward, trajectory_id=r.sample_index)
            self.tally(r, r.num_loss_tokens)
            if r.num_loss_tokens:  # no model token (the agent crashed at once): only its reward counts
                self.queue(r, None, None)  # a row of its own
        if self.rnd.members(gid) == self.group_sizes[gid]:  # complete: advantages known; its buffers join R
            self.buffers.release(gid)
            self.rnd.close_group(gid)

    def target(self, a: Arrival, opening: set) -> tuple | None:
        """R once the group is complete; else its (group, reward value) class, if it may hold buffers."""
        gid = a.rollout.group_id
        if gid in self.rnd.stats:
            return ("round",)
        if self.hold_groups:
            return None
        return ("member", gid, float(a.rollout.reward)) if self.buffers.admit(gid, opening) else None

    def weight(self, a: Arrival) -> float:
        """w_i: the per-sequence part of the aggregation (seq-mean-token-mean: 1/n_i)."""
        return seq_weight(self.obj.loss.loss_agg, a.rollout.num_loss_tokens)

    def main_term(self, logp: torch.Tensor, heads: list[Arrival], target: tuple, aligned, per_row) -> torch.Tensor:
        """The policy-gradient term per token: advantage A_i in R; advantage 1 for an open group's members, whose
        group-level weights the streaming round applies at the group's close. per_row(values): a tensor of one
        value per row, laid out to broadcast with logp (padded rows or a packed one)."""
        if target[0] == "member":
            return pg_token_loss(logp, 1.0)
        return pg_token_loss(logp, per_row([self.rnd.advantage(h.rollout.group_id, h.rollout.reward) for h in heads]))

    def regularizer_apart(self, target: tuple) -> bool:
        """An open group's KL/entropy terms carry no advantage: they go to R in a pass of their own."""
        return target[0] == "member"

    def fold(self, target: tuple, grads: list) -> None:
        self.rnd.add_members(target[1], target[2], grads)

    def group_closed(self, gid: Hashable) -> bool:
        """Its advantages are known (rl/prefix.py: its prompt's adjoint can be weighted)."""
        return gid in self.rnd.stats

    def unit_scale(self, key: Hashable) -> float:
        raise ValueError(f"GRPO has no unit buffers (trajectory {key!r})")

    def ended(self, key: Hashable) -> bool:
        return True  # a GRPO trajectory arrives whole


class OpdRules:
    """OPD: `on_turn(r, k)` per teacher-scored model turn, `end_trajectory(r)` when the trajectory ends;
    `on_opd_trajectory(r)` gives every turn at once (the lazy baselines).

    opd_unit (learner.opd_unit): "turn" backwards each turn when it can, over its prefix (a lone turn
    re-encodes everything before it); "trajectory" holds a trajectory's turns until its end and
    backwards them in one row, the row its last turn alone would cover: the lazy batch's positions, no
    unit buffer, and the per-turn backwards before it, which never shorten that last one, skipped."""

    kind = "opd"

    def __init__(self, obj: Objective, group_sizes: Mapping[str, int], rnd: StreamingRound,
                 buffers: OpenBuffers, tally: Tally, queue: Queue, granularity: str = "trajectory",
                 opd_unit: str = "turn"):
        self.obj, self.rnd, self.buffers, self.tally, self.queue = obj, rnd, buffers, tally, queue
        self.hold_turns = opd_unit == "trajectory"  # a trajectory's turns wait for its end
        # granularity group: a group's turns wait until every trajectory of the group ended
        self.group_sizes = dict(group_sizes) if granularity == "group" else None
        self._group_ended: Counter = Counter()
        self.sizes = dict(group_sizes)  # trajectories per group: when a group's shared prompt part closes
        self.per_traj_scale = obj.loss.loss_agg == "seq-mean-token-mean"  # 1/n_i waits for the trajectory's end
        self._arrived: Counter = Counter()
        self._ended: dict[tuple[str, int], float] = {}  # trajectories that ended: their w_i

    def on_turn(self, r: Rollout, k: int) -> None:
        """Model turn k of r was scored. r holds the trajectory so far (at least up to turn k's end) with
        teacher log-probs; a turn's log-probs depend on its whole prefix: its row is the prefix."""
        n = r.turn_tokens(k)
        self.tally(r, n)
        if n:
            self.queue(r, k, (r.key, False))  # queued turns of one trajectory share a row
        self._arrived[r.key] += 1
        if self._arrived[r.key] == len(r.turn_spans):  # a whole rollout given turn by turn (tsrl verify)
            self.end_trajectory(r)

    def on_opd_trajectory(self, r: Rollout) -> None:
        self.tally(r, r.num_loss_tokens)
        if r.num_loss_tokens:
            self.queue(r, None, (r.key, True))
        self.end_trajectory(r)

    def end_trajectory(self, r: Rollout) -> None:
        """The trajectory's per-sequence scalar (seq-mean-token-mean) is now known."""
        if r.key in self._ended:
            return
        self._ended[r.key] = seq_weight(self.obj.loss.loss_agg, r.num_loss_tokens) if self.per_traj_scale else 1.0
        self._group_ended[r.group_id] += 1
        if self.buffers.release(r.key):
            self.rnd.close_unit(r.key, self._ended[r.key])

    def target(self, a: Arrival, opening: set) -> tuple | None:
        """R when the turn's scalar is known; the trajectory's unit buffer while it is not; None to wait."""
        key = a.rollout.key
        if self.hold_turns and key not in self._ended:
            return None  # opd_unit trajectory: one row at the trajectory's end
        if self.group_sizes is not None:
            gid = a.rollout.group_id
            if gid not in self.group_sizes:
                raise UsageError(f"rollout {key}: group {gid!r} has no declared size")
            if self._group_ended[gid] < self.group_sizes[gid]:
                return None  # granularity group: every trajectory of the group first
        if not self.per_traj_scale or key in self._ended:
            return ("round",)
        return ("unit", key) if self.buffers.admit(key, opening) else None

    def weight(self, a: Arrival) -> float:
        """w_i where known now (1/n_i once the trajectory ended, under seq-mean-token-mean); else 1."""
        return self._ended.get(a.rollout.key, 1.0) if self.per_traj_scale else 1.0

    def main_term(self, logp: torch.Tensor, heads: list[Arrival], target: tuple, aligned, per_row) -> torch.Tensor:
        return opd_term(self.obj, logp, aligned("teacher_logprobs"))

    def regularizer_apart(self, target: tuple) -> bool:
        return False

    def fold(self, target: tuple, grads: list) -> None:
        self.rnd.append_turn(target[1], grads=grads)

    def group_closed(self, gid: Hashable) -> bool:
        """Every trajectory of the group ended (rl/prefix.py: its prompt part's adjoint is complete once nothing of it
        is queued); a group of unknown size waits for the round's close."""
        return gid in self.sizes and self._group_ended[gid] >= self.sizes[gid]

    def unit_scale(self, key: Hashable) -> float:
        """The scale its unit buffer closed with (1/n_i under seq-mean-token-mean)."""
        return self._ended[key]

    def ended(self, key: Hashable) -> bool:
        return key in self._ended


RULES = {"grpo": GrpoRules, "opd": OpdRules}
