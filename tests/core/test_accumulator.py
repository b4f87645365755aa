"""RoundGradAccumulator against the direct sum  Z * sum_i A_i G_i  (independent, float64).

Per-trajectory gradients are random parameter-shaped tensors here: the accumulator only sees
gradients and rewards, so this isolates its algebra from any model (the model-level proof is
tests/test_streaming_exact.py).
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tsrl_cli.core.accumulator import RoundGradAccumulator
from tsrl_cli.core.advantages import group_stats

SHAPES = [(5, 3), (7,)]


def make_round(group_sizes, dtype, seed, reward_fn):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    items = []
    for gi, G in enumerate(group_sizes):
        for i in range(G):
            grads = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]
            items.append((f"g{gi}", reward_fn(rng, gi, i), grads))
    return items


def reference(items, norm_by_std=True, eps=1e-6, z=1.0):
    """Direct formula in float64: A_i from each group's float64 rewards, then sum A_i G_i."""
    out = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    groups = {}
    for gid, r, grads in items:
        groups.setdefault(gid, []).append((r, grads))
    for members in groups.values():
        r = torch.tensor([m[0] for m in members], dtype=torch.float64)
        if len(r) > 1:
            mean, std = r.mean(), r.std()
        else:
            mean, std = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        adv = (r - mean) / (std + eps) if norm_by_std else r - mean
        for a, (_, grads) in zip(adv.tolist(), members, strict=True):
            for o, gr in zip(out, grads, strict=True):
                o += a * gr.double()
    return [o * z for o in out]


def stream(items, params, order_seed, norm_by_std=True, z=1.0, center=True):
    acc = RoundGradAccumulator(params, center_on_first_reward=center)
    sizes = {}
    for gid, _, _ in items:
        sizes[gid] = sizes.get(gid, 0) + 1
    seen = {}
    order = list(items)
    random.Random(order_seed).shuffle(order)
    for gid, r, grads in order:
        acc.add_member(gid, r, grads, norm_by_std)
        seen.setdefault(gid, []).append(r)
        if len(seen[gid]) == sizes[gid]:
            acc.close_group(gid, stats_of(seen[gid], norm_by_std))
    return acc.finalize(z), acc


def stats_of(rewards, norm_by_std=True):
    return group_stats(torch.tensor(rewards, dtype=torch.float64), norm_by_std)


def rel(a, b):
    diff = max(float((x.double() - y).abs().max()) for x, y in zip(a, b, strict=True))
    return diff / max(float(y.abs().max()) for y in b)


def params_of(dtype):
    return [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]


@pytest.mark.parametrize("sizes", [[2], [3, 3], [8, 8, 8], [16, 1, 2, 3, 8]])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("order_seed", [0, 1, 2])
def test_any_order_any_group_size_float64(sizes, norm_by_std, order_seed):
    items = make_round(sizes, torch.float64, order_seed, lambda rng, g, i: rng.choice([0.0, 1.0]) + 0.3 * rng.random())
    got, _ = stream(items, params_of(torch.float64), order_seed, norm_by_std, z=1 / 37)
    assert rel(got, reference(items, norm_by_std, z=1 / 37)) <= 1e-12


@pytest.mark.parametrize("rewards", [[1, 1, 1, 0.999], [0.5] * 8, [1e4 + 1e-3, 1e4, 1e4, 1e4 - 1e-3]])
def test_near_equal_and_zero_variance_groups(rewards):
    items = make_round([len(rewards)], torch.float64, 3, lambda rng, g, i: float(rewards[i]))
    items.append(("other", 1.0, [torch.ones(s, dtype=torch.float64) for s in SHAPES]))  # keep the total nonzero
    items.append(("other", 0.0, [torch.zeros(s, dtype=torch.float64) for s in SHAPES]))
    got, _ = stream(items, params_of(torch.float64), 5)
    assert rel(got, reference(items)) <= 1e-10


def test_float32_offset_rewards_stay_accurate_and_naive_form_does_not():
    """Rewards 100 + 0.01*noise, float32 gradients and buffers: centering on the first reward keeps
    the error at float32 level; the naive sum r_i g_i - mean * sum g_i (baseline 0) loses digits."""
    items = make_round([8, 8, 8], torch.float32, 11, lambda rng, g, i: 100.0 + 0.01 * rng.gauss(0, 1))
    ref = reference(items)
    got, _ = stream(items, params_of(torch.float32), 4)
    err = rel(got, ref)

    naive, _ = stream(items, params_of(torch.float32), 4, center=False)  # sum r_i g_i - mean * sum g_i
    naive_err = rel(naive, ref)
    assert err < 1e-5
    assert naive_err > 30 * err  # the test can tell the two apart


def test_buffers_are_float32_for_bf16_params_and_memory_is_two_sets_per_open_group():
    params = params_of(torch.bfloat16)
    acc = RoundGradAccumulator(params)
    n = sum(p.numel() for p in params)
    assert acc.param_bytes == 4 * n
    g = [torch.ones(s, dtype=torch.bfloat16) for s in SHAPES]
    acc.add_member("a", 1.0, g)
    acc.add_member("b", 0.0, g)
    assert acc.open_bytes == 2 * 2 * 4 * n
    acc.add_member("a", 0.0, g)
    acc.close_group("a", stats_of([1.0, 0.0]))
    assert acc.open_bytes == 2 * 4 * n and acc.peak_open_bytes == 4 * 4 * n
    with pytest.raises(RuntimeError, match="open group"):
        acc.finalize(1.0)
    acc.add_member("b", 1.0, g)
    acc.close_group("b", stats_of([0.0, 1.0]))
    out = acc.finalize(1.0)
    assert all(o.dtype == torch.float32 for o in out)


def test_dr_grpo_holds_one_buffer_per_open_group():
    items = make_round([4, 4], torch.float64, 9, lambda rng, g, i: rng.random())
    got, acc = stream(items, params_of(torch.float64), 0, norm_by_std=False)
    assert rel(got, reference(items, norm_by_std=False)) <= 1e-12
    assert acc.peak_open_bytes <= 2 * acc.param_bytes  # two groups open at most, one set each
    acc2 = RoundGradAccumulator(params_of(torch.float64))
    acc2.add_member("g", 1.0, items[0][2], norm_by_std=False)
    with pytest.raises(ValueError, match="norm_by_std"):
        acc2.add_member("g", 0.0, items[1][2], norm_by_std=True)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_members_sharing_a_reward_fold_at_once(norm_by_std):
    """Micro-batching's premise: the summed gradient of members with one reward, folded once, equals
    folding them one by one (both weights, r - b and 1, are shared)."""
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0]
    items = make_round([len(rewards)], torch.float64, 21, lambda rng, g, i: rewards[i])
    items.append(("anchor", 1.0, [torch.ones(s, dtype=torch.float64) for s in SHAPES]))
    acc = RoundGradAccumulator(params_of(torch.float64))
    classes: dict = {}
    for _gid, r, grads in items[:-1]:
        prev = classes.get(r)
        classes[r] = grads if prev is None else [a + b for a, b in zip(prev, grads, strict=True)]
    for r, grads in reversed(list(classes.items())):  # one fold per reward value, in another order
        acc.add_member("g0", r, grads, norm_by_std)
    acc.close_group("g0", stats_of(rewards, norm_by_std))
    acc.add_member("anchor", 1.0, items[-1][2], norm_by_std)
    acc.close_group("anchor", stats_of([1.0], norm_by_std))
    assert rel(acc.finalize(1 / 9), reference(items, norm_by_std, z=1 / 9)) <= 1e-12


def test_buffers_follow_dtype_and_device_options():
    acc = RoundGradAccumulator(params_of(torch.float64), dtype=torch.bfloat16, device="cpu")
    acc.add([torch.ones(s, dtype=torch.float64) for s in SHAPES], 0.5)
    out = acc.finalize(2.0)
    assert all(o.dtype == torch.bfloat16 and o.device.type == "cpu" and float(o.flatten()[0]) == 1.0 for o in out)
    assert acc.param_bytes == 2 * sum(p.numel() for p in params_of(torch.float64))


def test_units_defer_their_scalar():
    params = params_of(torch.float64)
    acc = RoundGradAccumulator(params)
    g1 = [torch.full(s, 2.0, dtype=torch.float64) for s in SHAPES]
    acc.add_to_unit("t", g1)
    acc.add_to_unit("t", g1)
    acc.add(g1, scale=0.5)
    assert acc.open_units == 1
    acc.close_unit("t", 0.25)
    out = acc.finalize(3.0)
    assert out[0][0, 0].item() == pytest.approx(3.0 * (0.25 * 4.0 + 0.5 * 2.0))


# ---- property test: random group sizes, reward kinds and interleavings ----------------------

@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([1, 2, 3, 8, 16]), min_size=1, max_size=5),
    kind=st.sampled_from(["binary", "gauss", "equal", "offset", "near_equal"]),
    norm_by_std=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_stream_equals_direct_sum(sizes, kind, norm_by_std, seed):
    def reward(rng, g, i):
        return {"binary": float(rng.random() < 0.5), "gauss": rng.gauss(0, 1), "equal": 0.25,
                "offset": 100.0 + 0.01 * rng.gauss(0, 1), "near_equal": 1.0 - (1e-3 if i == 0 else 0.0)}[kind]

    items = make_round(sizes, torch.float64, seed, reward)
    items.append(("anchor", 1.0, [torch.ones(s, dtype=torch.float64) for s in SHAPES]))  # total never 0
    got, _ = stream(items, params_of(torch.float64), seed, norm_by_std, z=1 / 7)
    assert rel(got, reference(items, norm_by_std, z=1 / 7)) <= 1e-10
