"""The streaming contract as a library (core/streaming.py): exact against the lazy batch for every estimator,
std and buffer form, in float64; each safety rail raised at the wrong call (and not at the right one); the
docs example runs."""

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tsrl_cli.core.advantages import ADVANTAGES, Estimator, group_normalized, leave_one_out
from tsrl_cli.core.streaming import (
    DoubleClose,
    GroupIncomplete,
    GroupStillOpen,
    NotStreamable,
    ParametersChanged,
    StreamingRound,
    UnknownGroup,
)
from tsrl_cli.policy import forward_logprobs
from tsrl_cli.verify import random_rollouts

DOC = Path(__file__).resolve().parents[2] / "docs" / "streaming-api.md"


def neg_logp(model, r):
    """-sum over the model's tokens of log-probs: the surrogate's gradient at ratio 1, advantage 1."""
    logp, _ = forward_logprobs(model, torch.tensor([r.input_ids]))
    return -(logp[0] * torch.tensor(r.loss_mask, dtype=logp.dtype)).sum()


def lazy_grads(model, rollouts, advantages, z):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = sum(advantages[r.key] * neg_logp(model, r) for r in rollouts) * z
    return torch.autograd.grad(loss, params)


def rel(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)) / max(y.abs().max().item() for y in b)


def advantages_of(rollouts, fn, std):
    out = {}
    for g in sorted({r.group_id for r in rollouts}):
        members = [r for r in rollouts if r.group_id == g]
        adv = fn(torch.tensor([m.reward for m in members], dtype=torch.float64), 1e-6, std)
        out.update({m.key: float(a) for m, a in zip(members, adv, strict=True)})
    return out


@pytest.fixture(scope="module")
def rollouts():
    return random_rollouts(128, 4, 5, seed=3)  # binary, continuous, zero-variance and far-from-zero rewards


@pytest.mark.parametrize("estimator,std,buffers", [
    ("group", "unbiased", "affine"), ("group", "population", "affine"), ("group", "population", "buckets"),
    ("center", "unbiased", "affine"), ("rloo", "unbiased", "buckets"), ("rloo", "unbiased", "affine"),
])
def test_streamed_in_random_order_equals_the_lazy_batch(tiny64, rollouts, estimator, std, buffers):
    params = [p for p in tiny64.parameters() if p.requires_grad]
    # the reference is written from the estimator's definition, independently of its affine form
    ref_fn = {"group": group_normalized, "center": ADVANTAGES["center"].advantages, "rloo": leave_one_out}[estimator]
    z = 1 / sum(r.num_loss_tokens for r in rollouts)
    ref = lazy_grads(tiny64, rollouts, advantages_of(rollouts, ref_fn, std), z)
    rnd = StreamingRound(params, estimator=estimator, std=std, buffers=buffers)
    sizes = {g: sum(r.group_id == g for r in rollouts) for g in {r.group_id for r in rollouts}}
    for g, n in sizes.items():
        rnd.open_group(g, n)
    for r in random.Random(7).sample(rollouts, len(rollouts)):
        rnd.close_trajectory(r.group_id, r.reward, loss=neg_logp(tiny64, r), trajectory_id=r.sample_index)
        if rnd.members(r.group_id) == sizes[r.group_id]:
            rnd.close_group(r.group_id)
    assert rel(rnd.finish(z), ref) <= 1e-9


def test_population_and_unbiased_differ_so_the_choice_matters(rollouts):
    rewards = torch.tensor([r.reward for r in rollouts if r.group_id == "g0"], dtype=torch.float64)
    a, b = group_normalized(rewards, std="unbiased"), group_normalized(rewards, std="population")
    assert (a - b).abs().max() > 1e-3  # (N / (N - 1)) ** 0.5 apart
    assert torch.allclose(b, (rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-6), rtol=1e-15)


def test_buckets_hold_one_buffer_per_reward_value(tiny64):
    params = [p for p in tiny64.parameters() if p.requires_grad]
    rnd = StreamingRound(params, estimator="rloo", buffers="buckets")
    rnd.open_group("g", 4)
    grads = [torch.ones_like(p) for p in params]
    for i, reward in enumerate([1.0, 0.0, 1.0]):
        rnd.close_trajectory("g", reward, grads=grads, trajectory_id=i)
    assert rnd.acc.open_bytes == 2 * rnd.acc.param_bytes  # values 1 and 0: two buckets


def test_a_member_whose_gradient_comes_after_the_close_goes_in_with_its_advantage(tiny64, rollouts):
    """The learner's path: rewards first, some gradients after the group closed (into R, weighted by A_i)."""
    params = [p for p in tiny64.parameters() if p.requires_grad]
    group = [r for r in rollouts if r.group_id == "g1"]
    ref = lazy_grads(tiny64, group, advantages_of(group, group_normalized, "unbiased"), 1.0)
    rnd = StreamingRound(params)
    rnd.open_group("g1", len(group))
    for r in group[:2]:
        rnd.close_trajectory("g1", r.reward, loss=neg_logp(tiny64, r), trajectory_id=r.sample_index)
    for r in group[2:]:
        rnd.close_trajectory("g1", r.reward, trajectory_id=r.sample_index)  # reward now, gradient later
    rnd.close_group("g1")
    for r in group[2:]:
        rnd.add(loss=neg_logp(tiny64, r), scale=rnd.advantage("g1", r.reward))
    assert rel(rnd.finish(1.0), ref) <= 1e-9


# ---- the rails ------------------------------------------------------------------------------------------


@pytest.fixture
def rnd(tiny64):
    params = [p for p in tiny64.parameters() if p.requires_grad]
    r = StreamingRound(params)
    r.open_group("g", 2)
    return r, [torch.ones_like(p) for p in params]


def test_a_correct_sequence_raises_nothing(rnd):  # the positive control of every rail below
    r, g = rnd
    r.close_trajectory("g", 1.0, grads=g, trajectory_id=0)
    r.close_trajectory("g", 0.0, grads=g, trajectory_id=1)
    r.close_group("g")
    r.assert_safe_to_step()
    assert len(r.finish(0.5)) == len(g)


def test_a_step_with_an_open_group_is_refused(rnd):
    r, g = rnd
    r.close_trajectory("g", 1.0, grads=g, trajectory_id=0)
    with pytest.raises(GroupStillOpen, match="still open"):
        r.finish(1.0)
    r.append_turn("u", grads=g)  # an OPD unit left open is refused the same way
    with pytest.raises(GroupStillOpen):
        r.assert_safe_to_step()


def test_a_double_close_is_refused(rnd):
    r, g = rnd
    r.close_trajectory("g", 1.0, grads=g, trajectory_id=0)
    with pytest.raises(DoubleClose, match="trajectory 0"):
        r.close_trajectory("g", 1.0, grads=g, trajectory_id=0)
    r.close_trajectory("g", 0.0, trajectory_id=1)
    r.close_group("g")
    with pytest.raises(DoubleClose, match="already closed"):
        r.close_group("g")
    with pytest.raises(DoubleClose, match="already opened"):
        r.open_group("g", 2)


def test_a_close_before_all_members_is_refused(rnd):
    r, g = rnd
    r.close_trajectory("g", 1.0, grads=g, trajectory_id=0)
    with pytest.raises(GroupIncomplete, match="1 of 2"):
        r.close_group("g")


def test_a_member_for_a_closed_or_unknown_group_is_refused(rnd):
    r, g = rnd
    r.close_trajectory("g", 1.0, trajectory_id=0)
    r.close_trajectory("g", 1.0, trajectory_id=1)
    with pytest.raises(UnknownGroup, match="already has its 2"):
        r.close_trajectory("g", 1.0, trajectory_id=2)
    r.close_group("g")
    with pytest.raises(UnknownGroup, match="is closed"):
        r.close_trajectory("g", 1.0, grads=g, trajectory_id=3)
    with pytest.raises(UnknownGroup, match="never opened"):
        r.add_members("h", 1.0, g)


def test_parameters_changed_between_open_and_step_are_refused(tiny64):
    params = [p for p in tiny64.parameters() if p.requires_grad]
    backup = [p.detach().clone() for p in params]
    r = StreamingRound(params)
    r.open_group("g", 1)
    r.close_trajectory("g", 1.0, grads=[torch.ones_like(p) for p in params], trajectory_id=0)
    r.close_group("g")
    try:
        with torch.no_grad():
            params[0].add_(0.0)  # an in-place update (what an optimizer step does), even of zero
        with pytest.raises(ParametersChanged, match="changed in place"):
            r.finish(1.0)
    finally:
        with torch.no_grad():
            for p, b in zip(params, backup, strict=True):
                p.copy_(b)


def test_estimators_outside_the_class_are_refused_before_any_work(tiny64):
    params = [p for p in tiny64.parameters() if p.requires_grad]
    with pytest.raises(NotStreamable, match="not an Estimator"):
        StreamingRound(params, estimator=lambda rewards: rewards)  # a bare function: nothing declares its inputs
    with pytest.raises(NotStreamable, match="unknown"):
        StreamingRound(params, estimator="batch_whiten")
    no_affine = Estimator(lambda r, eps, std: r.argsort().argsort().double(), None)  # rank-based: group-wise
    with pytest.raises(NotStreamable, match="no affine form"):
        StreamingRound(params, estimator=no_affine, buffers="affine")
    assert StreamingRound(params, estimator=no_affine).form == "buckets"  # auto: streamed exactly in buckets


@pytest.mark.slow  # a fresh interpreter importing transformers: about 10 s idle, more beside other work
def test_the_docs_example_runs_and_agrees_with_the_lazy_batch(tmp_path):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert len(code.splitlines()) < 60
    (tmp_path / "example.py").write_text(code)
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    diffs = [float(x) for x in re.findall(r"= ([0-9.e+-]+)", out.stdout)]
    assert len(diffs) == 2 and all(d <= 1e-5 for d in diffs), out.stdout
