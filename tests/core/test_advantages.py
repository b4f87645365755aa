"""GRPO advantages: hand-derived values and verl's edge rules, against an independent loop."""

import math

import pytest
import torch

from tsrl_cli.core.advantages import GRPO_EPS, group_centered, group_normalized, group_stats


def verl_style_reference(rewards, norm_by_std=True, eps=1e-6):
    """Written from verl's compute_grpo_outcome_advantage description, in plain Python."""
    n = len(rewards)
    if n == 1:
        mean, std = 0.0, 1.0
    else:
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))  # unbiased
    return [(r - mean) / (std + eps) if norm_by_std else r - mean for r in rewards]


def test_hand_derived_binary_group():
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    adv = group_normalized(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    s = math.sqrt(1 / 3)
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6)],
                                         rel=1e-15)


def test_eps_is_verl_1e6():
    assert GRPO_EPS == 1e-6


def test_singleton_group_is_mean0_std1():
    assert group_normalized(torch.tensor([3.0])).item() == pytest.approx(3.0 / (1 + 1e-6), rel=1e-15)
    assert group_centered(torch.tensor([3.0])).item() == 3.0
    st = group_stats(torch.tensor([3.0]))
    assert (st.mean, st.std) == (0.0, 1.0)


def test_zero_variance_group_gives_zero_advantage():
    assert group_normalized(torch.tensor([2.0, 2.0, 2.0])).abs().max().item() == 0.0
    assert group_centered(torch.tensor([0.25] * 8)).abs().max().item() == 0.0


@pytest.mark.parametrize("G", [2, 3, 8, 16])
@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_matches_independent_reference(G, offset):
    g = torch.Generator().manual_seed(G)
    r = (offset + torch.randn(G, generator=g, dtype=torch.float64)).tolist()
    for fn, norm in ((group_normalized, True), (group_centered, False)):
        got = fn(torch.tensor(r, dtype=torch.float32 if offset == 0 else torch.float64)).tolist()
        ref = verl_style_reference([float(torch.tensor(x, dtype=torch.float32)) if offset == 0 else x for x in r], norm)
        assert got == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_statistics_are_float64_even_for_float32_rewards():
    r32 = torch.tensor([100.001, 100.002, 100.0], dtype=torch.float32)
    st = group_stats(r32)
    ref = verl_style_reference([float(x) for x in r32])
    assert group_normalized(r32).tolist() == pytest.approx(ref, rel=1e-12)
    assert isinstance(st.mean, float)


def test_empty_group_refused():
    with pytest.raises(ValueError):
        group_stats(torch.tensor([]))
