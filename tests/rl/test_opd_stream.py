"""The stream schedule on OPD turns, with a scripted learner (no processes): what is queued, what one
backward covers, and the timing fields the breakdown (experiments/opd_breakdown.py) reads.

- a trajectory's turns queued together are backwarded in one row (its longest prefix), one row per
  backward (no padding across trajectories), and the gradient still equals the lazy one in float64;
- with coalescing off every turn is its own backward, over its own prefix;
- RoundWork counts the positions the backwards covered beside sum T_i and B x T_max.
"""

from collections import Counter

import pytest
import torch

from tsrl_cli.config import LossConfig
from tsrl_cli.policy import score_tokens
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.rl.schedules import learn_stream
from tsrl_cli.rl.types import GroupSpec, RoundPlan, TrajectoryDone, TurnScored
from tsrl_cli.rollouts import Rollout
from tsrl_cli.verify import compare, random_rollouts


class ScriptedLearner:
    """What learn_stream uses of rl.learner_worker.Learner; `arrivals` are bursts: everything of a burst
    is in the queue when the learner next looks (it was busy while they arrived)."""

    def __init__(self, model, obj, arrivals, coalesce_turns):
        self.model, self.obj, self.arrivals, self.coalesce_turns = model, obj, list(arrivals), coalesce_turns
        self.version = 0
        self.limits = []

    def round_learner(self, plan):
        return StreamLearner(self.model, self.obj, plan.group_sizes(), max_items=1)  # one row per backward

    def receive(self, plan, block, limit=None):
        self.limits.append(limit)
        assert self.arrivals, "the learner asked for more than the round sends"
        burst = self.arrivals[0]
        taken, rest = (burst, []) if limit is None else (burst[:limit], burst[limit:])
        self.arrivals = ([rest] if rest else []) + self.arrivals[1:]
        return taken

    def progress(self, round_, work):
        pass

    def finish(self, sl, plan, work):
        return sl.close_round()


def _turn(r: Rollout, k: int) -> TurnScored:
    """Turn k as the teacher sends it: the prefix up to its end, a placeholder span for turns to come."""
    e = r.turn_spans[k][1]
    partial = Rollout(r.group_id, r.sample_index, r.input_ids[:e], r.loss_mask[:e], 0.0,
                      list(r.turn_spans[:k + 1]) + [(e, e)], teacher_logprobs=r.teacher_logprobs[:e])
    return TurnScored(1, 0, partial, k, closed_at=10.0 + k, finished_at=10.5 + k, teacher_start=10.2 + k)


def _done(r: Rollout) -> TrajectoryDone:
    return TrajectoryDone(1, 0, r, "t", "submitted", len(r.turn_spans), finished_at=20.0)


@pytest.fixture(scope="module")
def three_turns(teacher64):
    ro = [r for r in random_rollouts(128, 2, 4, 7) if len(r.turn_spans) == 3][:2]
    assert len(ro) == 2
    for r in ro:
        r.teacher_logprobs = score_tokens(teacher64, r.input_ids)
    return ro


def _run(model, ro, coalesce):
    obj = Objective("opd", LossConfig())
    a, b = ro
    # burst 1: a's turns 0 and 1 (a busy learner found both queued); then b's three turns one by one; the ends
    bursts = [[_turn(a, 0), _turn(a, 1)], [_turn(b, 0)], [_turn(b, 1)], [_turn(a, 2), _turn(b, 2)],
              [_done(a), _done(b)]]
    sizes = Counter(r.group_id for r in ro)
    plan = RoundPlan(1, tuple(GroupSpec(g, "t", n) for g, n in sizes.items()))
    learner = ScriptedLearner(model, obj, bursts, coalesce)
    work = learn_stream(learner, plan)
    params = [p for p in model.parameters() if p.requires_grad]
    ref = torch.autograd.grad(lazy_loss(model, ro, obj), params)
    assert compare([""] * len(ref), list(ref), work.grads)["max_rel_diff"] <= 1e-10
    return work, learner


def test_queued_turns_of_a_trajectory_share_one_row(tiny64, three_turns):
    a, b = three_turns
    work, learner = _run(tiny64, three_turns, coalesce=True)
    ends = {(r.key, k): r.turn_spans[k][1] for r in three_turns for k in range(3)}
    # a's turns 0+1 in one row (a's turn-1 prefix), b0, b1, then a2 and b2: one row each (never padded together)
    assert work.microbatches == 5 and work.backwards == 5
    assert work.positions == (ends[a.key, 1] + ends[b.key, 0] + ends[b.key, 1] + ends[a.key, 2] + ends[b.key, 2])
    rows = {it["id"]: it for it in work.items}
    t0, t1 = rows[f"{a.group_id}/{a.sample_index}/t0"], rows[f"{a.group_id}/{a.sample_index}/t1"]
    assert (t0["backward_start"], t0["backward_end"]) == (t1["backward_start"], t1["backward_end"])
    assert set(learner.limits) == {None}  # it takes everything queued; the engine still plans one row per backward


def test_without_coalescing_every_turn_is_its_own_backward(tiny64, three_turns):
    work, learner = _run(tiny64, three_turns, coalesce=False)
    assert set(learner.limits) == {1}
    assert work.microbatches == 6
    assert work.positions == sum(r.turn_spans[k][1] for r in three_turns for k in range(3))


def test_round_work_timing_fields(tiny64, three_turns):
    work, _ = _run(tiny64, three_turns, coalesce=True)
    a, _ = three_turns
    row = next(it for it in work.items if it["id"] == f"{a.group_id}/{a.sample_index}/t1")
    assert (row["closed_at"], row["teacher_start"], row["finished_at"]) == (11.0, 11.2, 11.5)
    assert row["prefix_tokens"] == a.turn_spans[1][1]
    w = work.work()
    lengths = [len(r.input_ids) for r in three_turns]
    assert w["trajectory_tokens"] == sum(lengths) and w["padded_tokens"] == 2 * max(lengths)
    assert w["positions"] == work.positions and w["busy_cpu_s"] >= 0
