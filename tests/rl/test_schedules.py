"""Truncated importance sampling (the async schedule's token weights) against a hand-written loop, on
lazy_loss, and through the learner engine (what the async schedule runs) against lazy_loss."""

import math
import random

import torch

from tsrl_cli.core.offpolicy import tis_weights
from tsrl_cli.policy import score_tokens
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.rl.schedules import tis
from tsrl_cli.verify import random_rollouts


def on(rollouts, cap):
    """lazy_loss's token weights (logp -> weights) for these rollouts, from the schedule's TIS."""
    return lambda logp: tis(cap)(rollouts, logp)


def test_tis_weights_match_a_hand_loop():
    rng = random.Random(0)
    old = [[rng.uniform(-5, 0) for _ in range(7)] for _ in range(3)]
    beh = [[o + rng.uniform(-2, 2) for o in row] for row in old]
    beh[0][0] = old[0][0] - 30.0  # log-ratio 30: clamped to 20 first, then capped
    cap = 2.0
    w = tis_weights(torch.tensor(old, dtype=torch.float64), torch.tensor(beh, dtype=torch.float64), cap)
    for i in range(3):
        for t in range(7):
            lr = min(max(old[i][t] - beh[i][t], -20.0), 20.0)
            assert math.isclose(float(w[i, t]), min(math.exp(lr), cap), rel_tol=1e-12)


def test_tis_weights_are_detached():
    old = torch.zeros(4, requires_grad=True)
    w = tis_weights(old * 2, torch.full((4,), -1.0), 1.5)
    assert not w.requires_grad and torch.all(w == 1.5)


def test_tis_loss_equals_lazy_loss_when_on_policy(tiny64):
    """behavior == current log-probs -> every weight is 1 -> the lazy loss and its gradient."""
    obj = Objective()
    rollouts = random_rollouts(tiny64.config.vocab_size, groups=2, group_size=3, seed=1)
    for r in rollouts:
        r.behavior_logprobs = score_tokens(tiny64, r.input_ids)
    params = list(tiny64.parameters())
    g_lazy = torch.autograd.grad(lazy_loss(tiny64, rollouts, obj), params)
    g_tis = torch.autograd.grad(lazy_loss(tiny64, rollouts, obj, token_weights=on(rollouts, 2.0)), params)
    for a, b in zip(g_lazy, g_tis, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def test_tis_loss_weights_each_token(tiny64):
    """A behavior log-prob 0.5 below the current one gives that token weight e^0.5 (cap 10)."""
    obj = Objective()
    r = random_rollouts(tiny64.config.vocab_size, groups=1, group_size=2, seed=2)
    for x in r:
        x.behavior_logprobs = [v - 0.5 for v in score_tokens(tiny64, x.input_ids)]
    plain = float(lazy_loss(tiny64, r, obj).detach())
    assert math.isclose(float(lazy_loss(tiny64, r, obj, token_weights=on(r, 10.0)).detach()), math.exp(0.5) * plain,
                        rel_tol=1e-9)
    assert math.isclose(float(lazy_loss(tiny64, r, obj, token_weights=on(r, 1.2)).detach()), 1.2 * plain, rel_tol=1e-9)


def test_engine_with_tis_equals_lazy_loss_with_tis(tiny64):
    """The async schedule's computation (the engine, every group complete, micro-batched) against
    lazy_loss with the same truncated weights: off-policy rollouts, weights far from 1."""
    obj = Objective()
    rollouts = random_rollouts(tiny64.config.vocab_size, groups=3, group_size=4, seed=3)
    rng = random.Random(4)
    for r in rollouts:
        r.behavior_logprobs = [v + rng.uniform(-1, 1) for v in score_tokens(tiny64, r.input_ids)]
    params = [p for p in tiny64.parameters() if p.requires_grad]
    ref = torch.autograd.grad(lazy_loss(tiny64, rollouts, obj, token_weights=on(rollouts, 1.5)), params)
    sizes = {}
    for r in rollouts:
        sizes[r.group_id] = sizes.get(r.group_id, 0) + 1
    sl = StreamLearner(tiny64, obj, sizes, token_weights=tis(1.5), max_tokens=60)
    for r in rollouts:
        sl.on_trajectory(r)
    sl.drain()
    got = sl.close_round()
    assert len(sl.batches) > 1  # the cap split the round into micro-batches
    diff = max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))
    rel = diff / max(float(a.abs().max()) for a in ref)
    assert rel < 1e-10
    plain = torch.autograd.grad(lazy_loss(tiny64, rollouts, obj), params)
    assert max(float((a - b).abs().max()) for a, b in zip(ref, plain, strict=True)) > 1e-4  # the weights mattered
