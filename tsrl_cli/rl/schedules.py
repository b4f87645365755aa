"""Three timings of one learner and one objective: `sync`, `stream`, `async`.

  sync    the lazy baseline: wait for every trajectory, then one batched loss, one backward
  stream  gradient streaming: backward each trajectory (GRPO) or teacher-scored turn (OPD) as it
          arrives; group advantages join at group close, the round scalar at round close
          (StreamLearner). Staleness 0, asserted per item. Equal to sync up to summation order.
  async   the off-policy baseline: the batched loss of sync on data from older weights (the
          rollout side ran ahead), optionally with truncated importance sampling. NOT exact.

Each function consumes one round's arrivals and returns the round's gradient and timing record;
the learner process takes the optimizer step. Times are time.monotonic() seconds.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from tsrl_cli.core.offpolicy import tis_weights
from tsrl_cli.rl.learner import StreamLearner, lazy_loss, pad_rows
from tsrl_cli.rl.types import RoundPlan, TrajectoryDone, TurnScored
from tsrl_cli.rollouts import Rollout

now = time.monotonic


@dataclass
class RoundWork:
    """One round on the learner: the gradient plus everything events.jsonl needs."""

    opd: bool = False  # OPD: items are teacher-scored turns; GRPO: trajectories
    grads: list[torch.Tensor | None] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)  # events.jsonl `item` rows (absolute times)
    group_close: list[dict] = field(default_factory=list)
    batch: dict | None = None  # sync/async: the one batched backward
    busy_s: float = 0.0  # forward + backward seconds (the step is added by the learner)
    step_start: float = 0.0  # the gradient's final assembly starts here (stream: close_round)
    loss: float | None = None  # the lazy loss value; stream never forms that scalar
    accumulator_peak_bytes: int = 0
    last_arrival: float = float("-inf")  # the last message of the round (the round cannot close before)
    rollouts: list[Rollout] = field(default_factory=list)  # final rollouts, in arrival order
    _members: Counter = field(default_factory=Counter)

    def record(self, msg, staleness: int, start: float | None, end: float | None) -> None:
        """An item row for a GRPO trajectory or an OPD turn; trajectory ends close groups."""
        r = msg.rollout
        self.last_arrival = max(self.last_arrival, msg.finished_at)
        if isinstance(msg, TurnScored):
            s, e = r.turn_spans[msg.turn]
            self.items.append({"id": f"{r.group_id}/{r.sample_index}/t{msg.turn}", "group_id": r.group_id,
                               "sample_index": r.sample_index, "turn": msg.turn, "finished_at": msg.finished_at,
                               "backward_start": start, "backward_end": end, "tokens": e - s,
                               "loss_tokens": r.turn_tokens(msg.turn), "staleness": staleness, "reward": None})
            return
        self.rollouts.append(r)
        if not self.opd:  # GRPO: the trajectory is the item
            self.items.append({"id": f"{r.group_id}/{r.sample_index}", "group_id": r.group_id,
                               "sample_index": r.sample_index, "turn": None, "finished_at": msg.finished_at,
                               "backward_start": start, "backward_end": end, "tokens": len(r.input_ids),
                               "loss_tokens": r.num_loss_tokens, "staleness": staleness, "reward": r.reward})

    def trajectory_ended(self, r: Rollout, size: int, at: float) -> None:
        self._members[r.group_id] += 1
        if self._members[r.group_id] == size:
            self.group_close.append({"group_id": r.group_id, "at": at})

    def batched(self, start: float, end: float) -> None:
        """sync/async: every item was backwarded in the one batch [start, end)."""
        for it in self.items:
            it["backward_start"], it["backward_end"] = start, end
        self.batch = {"start": start, "end": end, "items": len(self.items),
                      "loss_tokens": sum(r.num_loss_tokens for r in self.rollouts)}
        self.busy_s += end - start


def _check_on_policy(learner, msg) -> int:
    """stream and sync train on the frozen policy only: staleness 0, checked per item."""
    staleness = learner.version - msg.policy_version
    if staleness != 0:
        raise RuntimeError(f"round {msg.round}: item from policy version {msg.policy_version} reached the learner at "
                           f"version {learner.version} (staleness {staleness}) under an on-policy schedule")
    return 0


def learn_stream(learner, plan: RoundPlan) -> RoundWork:
    """Backward each item the moment it arrives; join with one scalar at round close."""
    sl = StreamLearner(learner.model, learner.obj, group_sizes=plan.group_sizes())
    work, sizes = RoundWork(opd=learner.obj.kind == "opd"), plan.group_sizes()
    for msg in learner.arrivals(plan):
        staleness = _check_on_policy(learner, msg)
        t0 = now()
        if isinstance(msg, TurnScored):  # OPD: this turn's backward, while the trajectory goes on
            sl.on_turn(learner.with_ref(msg.rollout), msg.turn)
        elif learner.obj.kind == "opd":  # OPD trajectory end: its per-sequence scalar is now known
            sl.end_trajectory(msg.rollout)
        else:  # GRPO: the trajectory and its reward; the group's advantage joins at group close
            sl.on_trajectory(learner.with_ref(msg.rollout))
        t1 = now()
        work.busy_s += t1 - t0
        work.record(msg, staleness, t0, t1)
        if isinstance(msg, TrajectoryDone):
            work.trajectory_ended(msg.rollout, sizes[msg.rollout.group_id], t1)
        learner.progress(plan.round, work)
    work.step_start = now()
    work.grads = sl.close_round()  # the round scalar (1/N, 1/B or 1/C), applied once
    work.accumulator_peak_bytes = sl.acc.peak_open_bytes + sl.acc.param_bytes  # open groups + round buffer R
    return work


def _collect(learner, plan: RoundPlan, check) -> RoundWork:
    work, sizes = RoundWork(opd=learner.obj.kind == "opd"), plan.group_sizes()
    for msg in learner.arrivals(plan):
        work.record(msg, check(learner, msg), None, None)
        if isinstance(msg, TrajectoryDone):
            work.trajectory_ended(msg.rollout, sizes[msg.rollout.group_id], msg.finished_at)
        learner.progress(plan.round, work)
    return work


def _batched_backward(learner, work: RoundWork, loss_fn) -> RoundWork:
    rollouts = sorted(work.rollouts, key=lambda r: r.key)  # arrival order never changes the lazy sum
    t0 = now()
    loss = loss_fn(learner.model, [learner.with_ref(r) for r in rollouts], learner.obj)
    loss.backward()
    t1 = now()
    work.batched(t0, t1)
    work.loss = float(loss.detach())
    work.step_start = t1
    work.grads = [p.grad for p in learner.params]
    return work


def learn_sync(learner, plan: RoundPlan) -> RoundWork:
    """The lazy synchronous baseline: wait for every trajectory, then the round's gradient.

    sync_batching `padded` (default): one padded batch, one loss, one backward (verl's lazy loss).
    `per_item`: the stream learner's own per-item backwards, all run after the last arrival, so
    that sync and stream do the same learner work and differ only in timing.
    """
    work = _collect(learner, plan, _check_on_policy)
    if learner.cfg.sync_batching == "per_item":
        return _per_item_backward(learner, plan, work)
    return _batched_backward(learner, work, lazy_loss)


def _per_item_backward(learner, plan: RoundPlan, work: RoundWork) -> RoundWork:
    """Every item backwarded alone, in key order (groups one after another), after the last arrival."""
    sl = StreamLearner(learner.model, learner.obj, group_sizes=plan.group_sizes())
    t0 = now()
    for r in sorted(work.rollouts, key=lambda r: r.key):
        r = learner.with_ref(r)
        if learner.obj.kind == "opd":  # each model turn over its prefix, as stream does
            for k in range(len(r.turn_spans)):
                sl.on_turn(r, k)
            sl.end_trajectory(r)
        else:
            sl.on_trajectory(r)
    work.grads = sl.close_round()
    t1 = now()
    work.batched(t0, t1)
    work.batch["padded"] = False  # tsrl predict: shares by real tokens, no padding factor
    work.step_start = t1
    work.accumulator_peak_bytes = sl.acc.peak_open_bytes + sl.acc.param_bytes
    return work


def learn_async(learner, plan: RoundPlan) -> RoundWork:
    """Off-policy baseline: the lazy loss on data the rollout side generated with older weights.

    Staleness (learner version - generating version) is recorded per item and bounded by
    max_staleness. With offpolicy.tis_cap set, each token's policy-gradient term is weighted by
    its truncated importance weight (core/offpolicy.py). Not exact, by design.
    """
    bound = learner.cfg.offpolicy.max_staleness

    def check(lrn, msg) -> int:
        s = lrn.version - msg.policy_version
        if not 0 <= s <= bound:
            raise RuntimeError(f"round {msg.round}: staleness {s} outside [0, {bound}]")
        return s

    cap = learner.cfg.offpolicy.tis_cap
    loss_fn = lazy_loss if cap is None else (lambda m, rs, obj: lazy_loss(m, rs, obj, token_weights=tis(rs, cap)))
    return _batched_backward(learner, _collect(learner, plan, check), loss_fn)


def tis(rollouts: list[Rollout], cap: float):
    """lazy_loss's token weights for truncated importance sampling (async only, core.offpolicy.tis_weights):
    w = min(exp(logp_old - logp_behavior), cap), detached, with logp_old the learner's own log-probs of the
    batch (one step per round: the current weights) and logp_behavior what the rollout engine sampled with."""
    for r in rollouts:
        if r.behavior_logprobs is None:
            raise ValueError(f"rollout {r.key}: TIS needs behavior_logprobs")

    def weights(logp_B_T: torch.Tensor) -> torch.Tensor:
        behavior = pad_rows([r.behavior_logprobs for r in rollouts], logp_B_T.shape[1], logp_B_T.dtype, logp_B_T.device)
        return tis_weights(logp_B_T, behavior, cap)

    return weights


SCHEDULES = {"sync": learn_sync, "stream": learn_stream, "async": learn_async}
