"""Micro-batched streaming equals the lazy gradient in float64, whatever is queued when the learner runs.

The engine backwards what is queued in one pass per fold target: the members of complete groups
(advantages known) into R, an open group's members of one reward value into S_r and S_1, OPD turns
into R or their trajectory's unit buffer, queued turns of one trajectory in one row. These tests
queue arrivals in bursts (the learner busy for K arrivals), with and without a token cap, and
compare with the verl-style lazy loss: independent of the engine's factored weights.
"""

import copy
import random
from collections import Counter

import pytest
import torch

from tsrl_cli.config import LossConfig
from tsrl_cli.core.losses import LOSS_AGG_MODES
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.verify import compare, lazy_and_stream, random_rollouts

C = 40.0


def binary_round(vocab=128, groups=4, size=8, seed=0):
    """Groups with 0/1 rewards: several members share a reward, so open-group classes really batch."""
    ro = random_rollouts(vocab, groups, size, seed)
    rng = random.Random(seed)
    for r in ro:
        r.reward = float(rng.random() < 0.5)
    return ro


@pytest.fixture(scope="module")
def scored(tiny64, teacher64):
    from tsrl_cli.policy import score_tokens

    ro = binary_round() + [r for r in random_rollouts(128, 2, 4, 9) if r.group_id == "g1"]  # + continuous rewards
    for r in ro[-4:]:
        r.group_id = "h1"
    ref = copy.deepcopy(tiny64)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for r in ro:
        r.teacher_logprobs = score_tokens(teacher64, r.input_ids)
        r.ref_logprobs = score_tokens(ref, r.input_ids)
    return ro


def O(kind="grpo", reg=False, **loss):  # noqa: E743 (short: called in nearly every test here)
    extra = dict(kl_coef=0.1, kl_type="k3", entropy_coef=0.01) if reg else {}
    return Objective(kind, LossConfig(norm_constant=C, **extra, **loss))


@pytest.mark.parametrize("kind", ["grpo", "opd"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("queued", [3, 11])
def test_bursts_equal_lazy(tiny64, scored, kind, mode, queued):
    pair = lazy_and_stream(tiny64, scored, O(kind, loss_agg=mode), order="random", seed=queued, queued=queued)
    cmp = compare(pair.names, pair.lazy, pair.stream)
    assert cmp["max_abs_grad"] > 1e-4 and cmp["max_rel_diff"] <= 1e-10, cmp
    batches = pair.learner.batches
    assert len(batches) < pair.num_items  # something was batched
    assert any(len(b.items) > 1 for b in batches)


@pytest.mark.parametrize("kind", ["grpo", "opd"])
@pytest.mark.parametrize("cap", [None, 0, 1])
def test_regularizers_caps_and_open_group_limits(tiny64, scored, kind, cap):
    obj = O(kind, reg=True, loss_agg="seq-mean-token-mean", max_open_groups=cap)
    pair = lazy_and_stream(tiny64, scored, obj, order="random", seed=7, queued=5, max_tokens=90)
    assert compare(pair.names, pair.lazy, pair.stream)["max_rel_diff"] <= 1e-10
    assert all(b.tokens <= 90 or b.rows == 1 for b in pair.learner.batches)  # the cap holds (a row alone may exceed it)


def test_open_group_classes_fold_members_of_one_reward(tiny64, scored):
    """GRPO arrivals queued before their group completes: one backward per (group, reward) class."""
    grpo = [r for r in scored if r.group_id.startswith("g")]
    sizes = Counter(r.group_id for r in grpo)
    sl = StreamLearner(tiny64, O(), sizes)
    first = [r for r in grpo if r.sample_index < 6]  # 6 of 8 members of each group: none complete
    for r in first:
        sl.on_trajectory(r)
    sl.drain()
    members = [b for b in sl.batches if b.target[0] == "member"]
    classes = {(r.group_id, r.reward) for r in first}
    assert len(members) == len(classes) and sum(len(b.items) for b in members) == len(first)
    for r in grpo:
        if r.sample_index >= 6:
            sl.on_trajectory(r)
    sl.drain()
    assert [b.target for b in sl.batches[len(members):]] == [("round",)]  # the rest: advantages known, one batch
    got = sl.close_round()
    params = [p for p in tiny64.parameters() if p.requires_grad]
    ref = torch.autograd.grad(lazy_loss(tiny64, grpo, O()), params)
    assert compare([""] * len(ref), list(ref), got)["max_rel_diff"] <= 1e-10


def test_opd_turns_of_one_trajectory_share_a_row(tiny64, scored):
    obj = O("opd", loss_agg="token-mean")
    ro = [r for r in scored if len(r.turn_spans) > 1][:3]
    sl = StreamLearner(tiny64, obj, Counter(r.group_id for r in ro))
    for r in ro:
        for k in range(len(r.turn_spans)):
            sl.on_turn(r, k)
    sl.drain()
    assert len(sl.batches) == 1 and sl.batches[0].rows == len(ro)
    assert sl.batches[0].width == max(len(r.input_ids) for r in ro)
    got = sl.close_round()
    params = [p for p in tiny64.parameters() if p.requires_grad]
    ref = torch.autograd.grad(lazy_loss(tiny64, ro, obj), params)
    assert compare([""] * len(ref), list(ref), got)["max_rel_diff"] <= 1e-10


def test_a_single_arrival_never_waits(tiny64, scored):
    sl = StreamLearner(tiny64, O(), Counter(r.group_id for r in scored))
    sl.on_trajectory(scored[0])
    assert sl.has_work()
    assert [len(b.items) for b in sl.step()] == [1]


def test_group_of_ranks_plans_one_batch_per_rank(tiny64, scored):
    """The plan a group of 4 ranks would run: the queue split into at most 4 batches, every item once."""
    sizes = Counter(r.group_id for r in scored)
    sl = StreamLearner(tiny64, O(), sizes, world=4)
    for r in scored:
        sl.on_trajectory(r)
    plan = sl.plan()
    assert len(plan) == 4
    assert sorted(id(it) for b in plan for it in b.items) == sorted(id(it) for it in sl.queue)


def test_bf16_buffers_are_opt_in_and_measured(tiny64, scored):
    """bf16 partial sums: the difference from lazy is bf16 rounding (far above float64's, far below the gradient)."""
    pair = lazy_and_stream(tiny64, scored, O(buffer_dtype="bfloat16"), order="random", seed=1, queued=4)
    err = compare(pair.names, pair.lazy, pair.stream)["max_rel_diff"]
    assert 1e-6 < err < 5e-2
    assert pair.learner.acc.param_bytes == 2 * sum(p.numel() for p in tiny64.parameters())  # 2 bytes a value


def test_host_buffers_folded_by_a_thread_are_the_inline_sums(tiny64, scored):
    """buffer_device cpu on a GPU folds through a host thread; forced here on CPU tensors: the same sums,
    bit for bit, as folding inline (one thread keeps the order), and every fold done before a read."""
    obj = O("grpo", reg=True, loss_agg="seq-mean-token-mean", buffer_device="cpu")
    sizes = Counter(r.group_id for r in scored)
    out = {}
    for threaded in (False, True):
        sl = StreamLearner(tiny64, obj, sizes, threaded_host_fold=threaded)
        for i, r in enumerate(scored):
            sl.on_trajectory(r)
            if i % 3 == 2:
                sl.drain()
        sl.drain()
        out[threaded] = sl.close_round()
        assert sl.host_fold.folds > 0 and (sl.host_fold._thread is None)  # closed at round close
        if threaded:  # an open group's members fold into S_r and S_1 from one host copy
            assert 0 < sl.host_fold.copies < sl.host_fold.folds
    assert all(torch.equal(a, b) for a, b in zip(out[False], out[True], strict=True))
    params = [p for p in tiny64.parameters() if p.requires_grad]
    ref = torch.autograd.grad(lazy_loss(tiny64, scored, obj), params)
    assert compare([""] * len(ref), list(ref), out[True])["max_rel_diff"] <= 1e-10
