"""Three timings of one round learner and one objective: `sync`, `stream`, `async`.

  sync    the lazy baseline: wait for every trajectory, then the round's gradient (one padded batch,
          or micro-batches under learner.max_microbatch_tokens; every advantage is known by then)
  stream  gradient streaming: whatever has arrived is backwarded while the rest of the round is still
          generating; a GRPO group's advantage joins at its close, the round scalar at round close
          (rl.learner.StreamLearner). Staleness 0, asserted per item. Equal to sync up to summation order.
  async   the off-policy baseline: sync's computation on data from older weights (the rollout side ran
          ahead), optionally with truncated importance sampling. NOT exact.

Each function consumes one round's arrivals and returns the round's gradient and timing record;
the learner process takes the optimizer step. On a learner group every rank runs the same function
on the same arrivals (rank 0 reads the queue and broadcasts them). Times are time.monotonic() seconds.
What a schedule drives is a ScheduleHost: rl/learner_worker.Learner, or a test's scripted learner.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tsrl_cli.config import OffPolicyConfig
from tsrl_cli.core.offpolicy import tis_weights
from tsrl_cli.rl.learner import Objective, StreamLearner, pad_rows
from tsrl_cli.rl.reports import (
    BatchSpan,
    Certificate,
    GroupClose,
    Item,
    LearnerWork,
    TrajectoryEnd,
    TrajectoryItem,
    TurnItem,
)
from tsrl_cli.rl.types import RoundPlan, TrajectoryDone, TurnScored
from tsrl_cli.rollouts import Rollout

now = time.monotonic


class ScheduleHost(Protocol):
    """What the schedules use of the learner process (rl/learner_worker.Learner)."""

    obj: Objective
    version: int  # the weights being trained: an on-policy item must come from exactly these
    coalesce_turns: bool  # stream: take every queued message at once (else one at a time, in arrival order)
    sync_batching: str  # sync / async after the last arrival: padded | per_item (config.TrainConfig)
    offpolicy: OffPolicyConfig  # async: max_staleness and tis_cap

    def round_learner(self, plan: RoundPlan, *, token_weights=None, max_items: int | None = None
                      ) -> StreamLearner: ...  # the round's StreamLearner on this rank

    def receive(self, plan: RoundPlan, block: bool, limit: int | None = None) -> list: ...  # arrived messages

    def progress(self, round_: int, work: RoundWork) -> None: ...  # a few progress reports per second

    def finish(self, sl: StreamLearner, plan: RoundPlan, work: RoundWork) -> list | None: ...  # the round's gradient


@dataclass
class RoundWork:
    """One round on the learner: the gradient plus everything events.jsonl needs."""

    opd: bool = False  # OPD: items are teacher-scored turns; GRPO: trajectories
    grads: list[torch.Tensor | None] | None = None  # None on a learner group: FSDP holds the sharded p.grad
    items: list[Item] = field(default_factory=list)  # events.jsonl `item` rows (absolute times)
    group_close: list[GroupClose] = field(default_factory=list)
    batch: BatchSpan | None = None  # sync/async: the lazy computation after the last arrival
    busy_s: float = 0.0  # forward + backward seconds (the step is added by the learner)
    busy_cpu_s: float = 0.0  # this process's CPU seconds inside those spans (below busy_s: it shared a core)
    positions: int = 0  # token positions the backwards covered: rows x width per micro-batch (padding included)
    real_positions: int = 0  # the same without padding: the rows' own lengths
    step_start: float = 0.0  # the gradient's final assembly starts here (stream: close_round)
    loss: float | None = None  # the lazy loss value (this rank's part on a group); stream never forms it
    accumulator_peak_bytes: int = 0
    buffer_set_bytes: int = 0  # one parameter-sized buffer set on this rank (1/N of the model's on N ranks)
    backwards: int = 0  # backward passes on this rank
    microbatches: int = 0  # micro-batches of the round (all ranks')
    last_arrival: float = float("-inf")  # the last message of the round (the round cannot close before)
    rollouts: list[Rollout] = field(default_factory=list)  # final rollouts, in arrival order
    verify: Certificate | None = None  # the exactness certificate's result this round (rl/certificate.py)
    trajectories: list[TrajectoryEnd] = field(default_factory=list)  # OPD: each trajectory's end (turns: the items)
    _members: Counter = field(default_factory=Counter)
    _rows: dict[tuple, Item] = field(default_factory=dict)  # (group_id, sample_index, turn) -> its item row

    def record(self, msg, staleness: int, at: float) -> None:
        """An item row for a GRPO trajectory or an OPD turn; its backward times come when it runs."""
        r = msg.rollout
        self.last_arrival = max(self.last_arrival, msg.finished_at)
        if isinstance(msg, TurnScored):
            s, e = r.turn_spans[msg.turn]
            n = r.turn_tokens(msg.turn)
            row = TurnItem(id=f"{r.group_id}/{r.sample_index}/t{msg.turn}", group_id=r.group_id,
                           sample_index=r.sample_index, turn=msg.turn, finished_at=msg.finished_at,
                           backward_start=None if n else at, backward_end=None if n else at, tokens=e - s,
                           loss_tokens=n, staleness=staleness, reward=None,
                           # where the turn's time went before the learner: rollout close -> teacher start -> scores
                           closed_at=msg.closed_at, teacher_start=msg.teacher_start, prefix_tokens=e, last=msg.last)
            self.items.append(row)
            self._rows[(r.group_id, r.sample_index, msg.turn)] = row
            return
        self.rollouts.append(r)
        # what the trajectory was (its model turns, why it ended: a limit or an error cuts it short)
        turns, exit_ = msg.num_turns, msg.exit_reason.split(":")[0]
        if not self.opd:  # GRPO: the trajectory is the item
            n = r.num_loss_tokens
            row = TrajectoryItem(id=f"{r.group_id}/{r.sample_index}", group_id=r.group_id,
                                 sample_index=r.sample_index, turn=None, finished_at=msg.finished_at,
                                 backward_start=None if n else at, backward_end=None if n else at,
                                 tokens=len(r.input_ids), loss_tokens=n, staleness=staleness, reward=r.reward,
                                 turns=turns, exit=exit_)
            self.items.append(row)
            self._rows[(r.group_id, r.sample_index, None)] = row
        else:
            self.trajectories.append(TrajectoryEnd(f"{r.group_id}/{r.sample_index}", r.group_id, r.sample_index,
                                                   msg.finished_at, len(r.input_ids), r.num_loss_tokens, staleness,
                                                   r.reward, turns, exit_))

    def ran(self, batches, start: float, end: float, cpu_s: float = 0.0) -> None:
        """stream: the items of these micro-batches (one per rank) were backwarded in [start, end),
        using cpu_s of this process's CPU time.
        Each item's share of its batch's cost is its share of the batch's loss tokens."""
        self.busy_s += end - start
        self.busy_cpu_s += cpu_s
        self.microbatches += len(batches)
        self.positions += sum(b.tokens for b in batches)
        self.real_positions += sum(b.real_tokens for b in batches)
        for b in batches:
            total = sum(it.rollout.turn_tokens(it.turn) if it.turn is not None else it.rollout.num_loss_tokens
                        for it in b.items) or 1
            for it in b.items:
                row = self._rows.get((it.rollout.group_id, it.rollout.sample_index, it.turn))
                if row is not None:
                    row.backward_start, row.backward_end = start, end
                    row.share = row.loss_tokens / total

    def deferred(self, idents) -> None:
        """stream: mark each item whose GRPO group (group_id) or OPD trajectory ((group_id, sample_index))
        loss.max_open_groups deferred to its close; every other item of the round was not deferred."""
        for (gid, i, _), row in self._rows.items():
            row.deferred = (gid if not self.opd else (gid, i)) in idents

    def trajectory_ended(self, r: Rollout, size: int, at: float) -> None:
        self._members[r.group_id] += 1
        if self._members[r.group_id] == size:
            self.group_close.append(GroupClose(r.group_id, at))

    def batched(self, start: float, end: float, padded: bool, cpu_s: float = 0.0) -> None:
        """sync/async: every item was backwarded after the last arrival, in [start, end)."""
        for it in self.items:
            it.backward_start, it.backward_end = start, end
        self.batch = BatchSpan(start, end, len(self.items), padded, sum(r.num_loss_tokens for r in self.rollouts))
        self.busy_s += end - start
        self.busy_cpu_s += cpu_s

    def work(self) -> LearnerWork:
        """The learner's work of the round in token positions, beside the two trajectory-level references:
        every trajectory once (sum T_i) and the lazy padded batch (B x T_max). An OPD turn's row covers its
        whole prefix, so per-turn streaming computes more than sum T_i: the re-encoding."""
        lengths = [len(r.input_ids) for r in self.rollouts]
        return LearnerWork(self.positions, sum(lengths), len(lengths) * max(lengths, default=0), self.busy_cpu_s,
                           self.real_positions)


def _check_on_policy(learner: ScheduleHost, msg) -> int:
    """stream and sync train on the frozen policy only: staleness 0, checked per item."""
    staleness = learner.version - msg.policy_version
    if staleness != 0:
        raise RuntimeError(f"round {msg.round}: item from policy version {msg.policy_version} reached the learner at "
                           f"version {learner.version} (staleness {staleness}) under an on-policy schedule")
    return 0


def learn_stream(learner: ScheduleHost, plan: RoundPlan) -> RoundWork:
    """Backward what has arrived while the round goes on; join with one scalar at round close."""
    sl = learner.round_learner(plan)
    work, sizes = RoundWork(opd=learner.obj.kind == "opd"), plan.group_sizes()
    # without micro-batching each arrival is taken and backwarded alone, in arrival order: the float32 sums
    # then depend on that order only, not on how far the learner lags. OPD under `auto` takes what is queued,
    # and its round learner (one row per backward) puts a trajectory's queued turns in one row
    limit = None if learner.coalesce_turns else 1
    ended = 0
    while ended < plan.num_trajectories or sl.has_work():
        for msg in learner.receive(plan, block=not sl.has_work(), limit=limit):  # the first never waits for company
            staleness = _check_on_policy(learner, msg)
            if isinstance(msg, TurnScored):  # OPD: this turn's backward, while the trajectory goes on
                sl.on_turn(msg.rollout, msg.turn)
            elif learner.obj.kind == "opd":  # OPD trajectory end: its per-sequence scalar is now known
                sl.end_trajectory(msg.rollout)
            else:  # GRPO: the trajectory and its reward; the group's advantage joins at group close
                sl.on_trajectory(msg.rollout)
            t = now()
            work.record(msg, staleness, t)
            if isinstance(msg, TrajectoryDone):
                ended += 1
                work.trajectory_ended(msg.rollout, sizes[msg.rollout.group_id], t)
        if sl.has_work():
            t0, c0 = now(), time.process_time()
            batches = sl.step()
            work.ran(batches, t0, now(), time.process_time() - c0)
        learner.progress(plan.round, work)
    work.deferred(sl.deferred)
    work.step_start = now()
    work.grads = learner.finish(sl, plan, work)  # the round scalar (1/N, 1/B or 1/C), applied once
    work.accumulator_peak_bytes = sl.acc.peak_open_bytes + sl.acc.param_bytes  # open groups + round buffer R
    work.buffer_set_bytes = sl.acc.param_bytes
    work.backwards = sl.backwards
    return work


def _collect(learner: ScheduleHost, plan: RoundPlan, check) -> RoundWork:
    work, sizes = RoundWork(opd=learner.obj.kind == "opd"), plan.group_sizes()
    ended = 0
    while ended < plan.num_trajectories:
        for msg in learner.receive(plan, block=True):
            work.record(msg, check(learner, msg), msg.finished_at)
            if isinstance(msg, TrajectoryDone):
                ended += 1
                work.trajectory_ended(msg.rollout, sizes[msg.rollout.group_id], msg.finished_at)
        learner.progress(plan.round, work)
    return work


def _after_last_arrival(learner: ScheduleHost, plan: RoundPlan, work: RoundWork, token_weights=None) -> RoundWork:
    """The lazy computation: every trajectory of the round (advantages known), in key order.

    sync_batching `padded`: one padded batch (or micro-batches of learner.max_microbatch_tokens);
    OPD rows are whole trajectories. `per_item`: what a per-arrival stream learner does, item by item
    as if each had just arrived (an open group's members into S_r and S_1, OPD turns over their
    prefixes), all after the last arrival: the same learner work, so sync and stream differ in timing only.
    """
    per_item = learner.sync_batching == "per_item"
    sl = learner.round_learner(plan, token_weights=token_weights, max_items=1 if per_item else None)
    t0, c0 = now(), time.process_time()
    feed_complete(sl, sorted(work.rollouts, key=lambda r: r.key), per_item)  # the order never changes the lazy sum
    work.grads = learner.finish(sl, plan, work)
    t1 = now()
    work.batched(t0, t1, padded=not per_item, cpu_s=time.process_time() - c0)
    work.microbatches = len(sl.batches)
    work.positions = sum(b.tokens for b in sl.batches)
    work.real_positions = sum(b.real_tokens for b in sl.batches)
    work.loss = sl.loss
    work.step_start = t1
    work.accumulator_peak_bytes = sl.acc.peak_open_bytes + sl.acc.param_bytes
    work.buffer_set_bytes = sl.acc.param_bytes
    work.backwards = sl.backwards
    return work


def feed_complete(sl, rollouts: list[Rollout], per_item: bool) -> None:
    """Every trajectory of a round into round learner `sl`, in the given order, and backward them all.
    per_item False: as they come every group completes and every OPD trajectory is one row, so the
    learner forms the lazy padded batch (split under its token cap). True: each item is backwarded as
    if it had just arrived (an open group's members into S_r and S_1, OPD turns over their prefixes)."""
    for r in rollouts:
        if sl.obj.kind == "grpo":
            sl.on_trajectory(r)
        elif per_item:
            for k in range(len(r.turn_spans)):
                sl.on_turn(r, k)
                sl.drain()
            sl.end_trajectory(r)
        else:
            sl.on_opd_trajectory(r)
        if per_item:
            sl.drain()
    sl.drain()


def learn_sync(learner: ScheduleHost, plan: RoundPlan) -> RoundWork:
    """The lazy synchronous baseline: wait for every trajectory, then the round's gradient."""
    return _after_last_arrival(learner, plan, _collect(learner, plan, _check_on_policy))


def learn_async(learner: ScheduleHost, plan: RoundPlan) -> RoundWork:
    """Off-policy baseline: the lazy loss on data the rollout side generated with older weights.

    Staleness (learner version - generating version) is recorded per item and bounded by
    max_staleness. With offpolicy.tis_cap set, each token's policy-gradient term is weighted by
    its truncated importance weight (core/offpolicy.py). Not exact, by design.
    """
    bound = learner.offpolicy.max_staleness

    def check(lrn, msg) -> int:
        s = lrn.version - msg.policy_version
        if not 0 <= s <= bound:
            raise RuntimeError(f"round {msg.round}: staleness {s} outside [0, {bound}]")
        return s

    cap = learner.offpolicy.tis_cap
    work = _collect(learner, plan, check)
    return _after_last_arrival(learner, plan, work, token_weights=None if cap is None else tis(cap))


def tis(cap: float):
    """The round learner's token weights for truncated importance sampling (async only, core.offpolicy.tis_weights):
    w = min(exp(logp_old - logp_behavior), cap), detached, with logp_old the learner's own log-probs of the
    batch (one step per round: the current weights) and logp_behavior what the rollout engine sampled with."""

    def weights(rollouts: list[Rollout], logp_B_T: torch.Tensor) -> torch.Tensor:
        for r in rollouts:
            if r.behavior_logprobs is None:
                raise ValueError(f"rollout {r.key}: TIS needs behavior_logprobs")
        behavior = pad_rows([r.behavior_logprobs for r in rollouts], logp_B_T.shape[1], logp_B_T.dtype, logp_B_T.device)
        return tis_weights(logp_B_T, behavior, cap)

    return weights


SCHEDULES = {"sync": learn_sync, "stream": learn_stream, "async": learn_async}
