"""Buffer sets allocated uninitialised (core/accumulator.py BufferSet): each tensor's first fold assigns.

- the assignment (add_scaled, first) is the add into zeros bit for bit, in float32 and float64: signed zeros,
  subnormals, infinities, negative and tiny alphas, a bf16 gradient, a tensor whose first gradient comes later;
  the fresh buffers start as NaN (what an allocator may leave), so an add in place of the assignment shows
- opening sets and their first folds fill nothing on the learner's thread: no torch.zeros, zeros_like,
  Tensor.zero_ or fill_ of a buffer (GRPO's S_r and S_1, a reward-value bucket, an OPD unit, R); the control
  allocates zero-filled sets, the old way, and is caught
- uninitialised memory never reaches a sum: every allocation NaN, a float32 round (affine groups, buckets, a
  unit, tensors that no gradient or only some members' reach) equals the zero-filled accumulator bit for bit:
  a close skips its set's unwritten tensors and R's unwritten tensors are 0 at round close
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tsrl_cli.core import accumulator
from tsrl_cli.core.accumulator import BufferSet, RoundGradAccumulator, axpy, readable
from tsrl_cli.core.advantages import group_stats

SHAPES = [(13,), (3, 5), (4, 7)]
SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, float("inf"), 1e-30, -7.0]  # float32 edge values
INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_OF[t.dtype])


def same_bits(a, b) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def gradients(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    out[0][: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
    return [t.to(dtype) for t in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad_dtype", ["same", torch.bfloat16])
def test_the_first_fold_assigns_the_bits_of_the_add_into_zeros(dtype, grad_dtype):
    gd = dtype if grad_dtype == "same" else grad_dtype
    folds = [(0.5, gradients(gd, 1)), (-1.7, gradients(gd, 2)), (1e-30, gradients(gd, 3)), (3.0, gradients(gd, 4))]
    folds[0][1][2] = None  # tensor 2's first gradient comes with the second fold
    fresh = BufferSet([torch.full(s, float("nan"), dtype=dtype) for s in SHAPES])
    zeros = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    garbage = [torch.full(s, float("nan"), dtype=dtype) for s in SHAPES]  # a plain list: always added into
    for i, (alpha, grads) in enumerate(folds):
        for buf in (fresh, zeros, garbage):
            axpy(buf, grads, alpha)
        if i == 0:
            assert fresh.written == [True, True, False]
            assert readable(fresh)[2] is None and readable(fresh)[0] is fresh[0]  # a close skips tensor 2
        assert same_bits([t for t, w in zip(fresh, fresh.written, strict=True) if w],
                         [t for t, w in zip(zeros, fresh.written, strict=True) if w])
    assert fresh.written == [True, True, True]
    assert torch.equal(bits(fresh[0][:2]), bits(torch.zeros(2, dtype=dtype)))  # 0 + 0.5 * -0.0 is +0.0
    assert all(torch.isnan(t).all() for t in garbage)  # control: adding into what was there keeps it


FILLS = ((torch, "zeros"), (torch, "zeros_like"), (torch.Tensor, "zero_"), (torch.Tensor, "fill_"))


def spy_fills(monkeypatch) -> list:
    """Every torch.zeros / zeros_like / Tensor.zero_ / fill_ of more than one element from now on: (name, thread).
    A 0-dim zero (the other operand of a first fold, made once per device and dtype) is no buffer's fill."""
    calls: list = []
    for owner, name in FILLS:
        real = getattr(owner, name)

        def spy(*a, _real=real, _name=name, **k):
            out = _real(*a, **k)
            if out.numel() > 1:
                calls.append((_name, threading.current_thread().name))
            return out

        monkeypatch.setattr(owner, name, spy)
    return calls


def open_every_kind(acc: RoundGradAccumulator, seed: int = 0) -> None:
    """Open an affine group (S_r, S_1), a reward-value bucket, an OPD unit and R, each with its first fold."""
    acc.add_member("affine", 1.0, gradients(torch.float32, seed))
    acc.add_to_bucket("buckets", 0.5, gradients(torch.float32, seed + 1))
    acc.add_to_unit("unit", gradients(torch.float32, seed + 2))
    acc.add(gradients(torch.float32, seed + 3), 0.25)


def zero_filled(acc: RoundGradAccumulator) -> list[torch.Tensor]:
    """The allocation this replaces: every set zero-filled where it opens, then added into."""
    return [torch.zeros(t.shape, dtype=dt) for t, dt in zip(acc.templates, acc._dtypes, strict=True)]


def test_opening_sets_fills_nothing_on_the_learners_thread(monkeypatch):
    templates = [torch.empty(s) for s in SHAPES]
    acc = RoundGradAccumulator(templates, device="cpu")
    monkeypatch.setattr(accumulator, "_ZEROS", {})  # the 0-dim zero made at the first fold too
    calls = spy_fills(monkeypatch)
    open_every_kind(acc)
    assert calls == [] and acc.open_groups == 2 and acc.open_units == 1
    old = RoundGradAccumulator(templates, device="cpu")
    monkeypatch.setattr(old, "_fresh", lambda: zero_filled(old))
    open_every_kind(old)  # control: the zero-filled allocation is seen, on this thread
    assert {c for c in calls} == {("zeros", threading.current_thread().name)} and len(calls) == 5 * len(SHAPES)


def _round(acc: RoundGradAccumulator, seed: int) -> list[torch.Tensor]:
    """A float32 round: tensor 0 never gets a gradient, tensor 1 only from some members; affine groups, bucket
    groups and a unit, interleaved; closed and finalized."""
    rng = random.Random(seed)
    groups = {f"a{k}": [rng.choice([0.0, 1.0]) + 0.1 * rng.random() for _ in range(4)] for k in range(3)}
    groups |= {f"b{k}": [rng.choice([0.0, 0.5, 1.0]) for _ in range(4)] for k in range(2)}
    arrivals = [(gid, i) for gid, rs in groups.items() for i in range(len(rs))]
    rng.shuffle(arrivals)
    seen: dict[str, int] = {}
    for n, (gid, i) in enumerate(arrivals):
        grads = gradients(torch.float32, 100 * seed + n)
        grads[0] = None
        if rng.random() < 0.5:
            grads[1] = None
        r = groups[gid][i]
        if gid.startswith("a"):
            acc.add_member(gid, r, grads)
        else:
            acc.add_to_bucket(gid, r, grads)
        if n % 4 == 0:
            acc.add_to_unit("u", [None, None, gradients(torch.float32, 7 * n)[2]])
        seen[gid] = seen.get(gid, 0) + 1
        if seen[gid] == len(groups[gid]):
            stats = group_stats(torch.tensor(groups[gid], dtype=torch.float64))
            if gid.startswith("a"):
                acc.close_group(gid, stats)
            else:
                adv = {v: (v - stats.mean) * stats.scale for v in groups[gid]}
                acc.close_buckets(gid, adv)
    acc.close_unit("u", 0.125)
    return acc.finalize(1 / 20)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uninitialised_memory_never_reaches_a_sum(seed, monkeypatch):
    templates = [torch.empty(s) for s in SHAPES]
    old = RoundGradAccumulator(templates, device="cpu")
    monkeypatch.setattr(old, "_fresh", lambda: zero_filled(old))
    want = _round(old, seed)
    real_empty = torch.empty
    monkeypatch.setattr(accumulator.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    got = _round(RoundGradAccumulator(templates, device="cpu"), seed)
    assert same_bits(got, want) and all(torch.isfinite(t).all() for t in got)
    assert torch.equal(got[0], torch.zeros(SHAPES[0])) and got[1].abs().max() > 0
