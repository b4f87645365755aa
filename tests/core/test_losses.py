"""Per-token losses and verl's loss aggregation, on hand-derived numbers."""

import math

import pytest
import torch

from tsrl_cli.core.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    kl_penalty,
    opd_k3_loss,
    opd_pg_advantages,
    pg_token_loss,
    round_scale,
    seq_weight,
    token_entropy,
    token_logprobs,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 15 / 5),
        ("seq-mean-token-sum", (6 + 9) / 2),
        ("seq-mean-token-mean", (6 / (3 + 1e-8) + 9 / (2 + 1e-8)) / 2),
        ("token-sum", 15.0),
    ],
)
def test_agg_loss_hand_example(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-14)


def test_sum_norm_needs_and_uses_explicit_constant():
    """verl 0.9 agg_loss: the summed sequence losses divided by B * C (the mean over sequences, then / C).
    Older verl releases divided by C alone (15 / 3 = 5 here); this pins the factor B."""
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=3).item() == pytest.approx(15 / (2 * 3))
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=3, global_batch_size=5).item() == \
        pytest.approx(15 / (5 * 3))
    assert round_scale("seq-mean-token-sum-norm", 5, 2, norm_constant=3) == pytest.approx(1 / 6)
    assert round_scale("seq-mean-token-sum-norm", 5, 2, global_batch_size=5, norm_constant=3) == pytest.approx(1 / 15)
    with pytest.raises(ValueError):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        round_scale("seq-mean-token-sum-norm", 5, 2)


def test_seq_mean_uses_global_batch_size_and_skips_empty_sequences():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert agg_loss(LOSS, mask, "seq-mean-token-sum").item() == pytest.approx(6.0)  # B = 1 non-empty
    assert agg_loss(LOSS, mask, "seq-mean-token-sum", global_batch_size=4).item() == pytest.approx(1.5)


def test_zero_tokens_gives_zero_loss():
    assert agg_loss(LOSS, torch.zeros_like(MASK), "token-mean").item() == 0.0
    assert round_scale("token-mean", 0, 0) == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("gbs", [None, 7])
def test_factored_form_equals_verl_agg_loss(mode, gbs):
    """loss = Z * sum_i w_i * sum_t m l: the split streaming relies on, checked on random batches."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 11
    loss = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.6).long()
    mask[2] = 0  # one empty sequence
    C = 13.0
    ref = agg_loss(loss, mask, mode, global_batch_size=gbs, norm_constant=C).item()
    n_i = mask.sum(-1).tolist()
    z = round_scale(mode, sum(n_i), sum(1 for n in n_i if n), gbs, C)
    got = z * sum(seq_weight(mode, n) * float((loss[i] * mask[i]).sum()) for i, n in enumerate(n_i))
    assert got == pytest.approx(ref, rel=1e-13)


def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "abs").item() == pytest.approx(0.5)
    d = -0.5  # ref - logp
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(d) - d - 1)
    assert kl_penalty(lp, ref, "low_var_kl").item() == kl_penalty(lp, ref, "k3").item()
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-100.0]), "k3").item() == 10.0  # verl clamps
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "full")


def test_token_logprobs_alignment():
    logits = torch.randn(1, 4, 5, dtype=torch.float64)
    ids = torch.tensor([[3, 1, 4, 2]])
    lp = token_logprobs(logits, ids)
    assert lp[0, 0] == 0
    for j in range(1, 4):  # position j is predicted from logits at j-1
        assert lp[0, j].item() == pytest.approx(torch.log_softmax(logits[0, j - 1], -1)[ids[0, j]].item(), rel=1e-14)
    assert lp.dtype == torch.float64


def test_entropy_matches_definition():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    h = token_entropy(logits)
    p = torch.softmax(logits[1, 0], -1)
    assert h[1, 1].item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-13)


def test_pg_token_loss_value_and_gradient():
    lp = torch.tensor([-0.3, -1.2, -2.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.5, -2.0, 1.0], dtype=torch.float64)
    loss = pg_token_loss(lp, adv)
    assert loss.tolist() == pytest.approx((-adv).tolist())  # ratio is exactly 1
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx((-adv).tolist())  # d/dlogp = -A


def test_opd_advantage_three_tokens():
    s = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    t = torch.tensor([-0.7, -0.4, -2.0])
    a = opd_pg_advantages(s, t, coef=2.0)
    assert a.tolist() == pytest.approx([-2 * 0.2, -2 * -0.6, 0.0])
    assert not a.requires_grad  # stop-gradient


def test_opd_k3_is_reverse_kl_estimator_with_gradient():
    s = torch.tensor([-0.5, -1.0], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([-0.7, -1.0], dtype=torch.float64)
    d = opd_k3_loss(s, t)
    k = t[0] - s[0].detach()
    assert d[0].item() == pytest.approx(float(torch.exp(k) - k - 1))
    assert d[1].item() == 0.0
    d.sum().backward()
    assert s.grad[0].item() == pytest.approx(float(1 - torch.exp(k)))  # d/ds (e^{t-s} - (t-s) - 1)
