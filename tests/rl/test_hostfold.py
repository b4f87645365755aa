"""Folds into host buffers (rl/hostfold.py): the parallel add, the reused host copy, the learner's own device.

- the add split over threads equals core.accumulator.axpy bit for bit (float32 and float64 buffers, a
  bf16 gradient cast in chunks, a tensor too small to split, a non-contiguous buffer, a missing
  gradient), and the split is real: the slices cover every element once and the pool's threads did
  part of the adds
- one gradient folded into several buffers (GRPO's S_r and S_1) is staged once; a list whose tensor
  was replaced between folds, as the learner group's hook does for each source rank, is staged again
  (the sums show the right gradient went in)
- the copy stream is made on the learner's device and the event recorded on that device's stream
  (fakes of torch.cuda's classes: no GPU here)
- a fresh buffer set's first fold assigns: the split add, the chunked bf16 cast, a small and a non-contiguous
  tensor give the add into zeros bit for bit (buffers start as NaN), threaded folds and closes included, and
  neither thread fills a buffer with zeros (the control, zero-filled sets, is caught)
- the queue is bounded by passes (loss.host_fold_pending, K): with a slowed add, the gradients alive after every
  call (weak references to each one handed in) span K passes at most and the learner's thread waited; the
  unbounded queue (the control) holds more on the same sequence; the sums are the inline ones bit for bit
- a closed group's buffer set is freed once its close is folded: alive while queued (the control), gone after
"""

from __future__ import annotations

import threading
import time
import weakref
from itertools import pairwise
from typing import ClassVar

import pytest
import torch

from tsrl_cli.config import LossConfig
from tsrl_cli.core.accumulator import BufferSet, RoundGradAccumulator, axpy
from tsrl_cli.core.advantages import group_stats
from tsrl_cli.errors import UsageError
from tsrl_cli.rl import hostfold
from tsrl_cli.rl.hostfold import MIN_SLICE, HostFold, ParallelAxpy, auto_threads, slices
from tsrl_cli.rl.learner import Objective, StreamLearner


def tensors(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3 * MIN_SLICE + 7,), (5, 11), (2 * MIN_SLICE // 64, 64 + 3), (MIN_SLICE // 8, 9)]
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_slices_cover_every_element_once(parts):
    for n in (1, MIN_SLICE - 1, 2 * MIN_SLICE, 3 * MIN_SLICE + 7, 10 * MIN_SLICE + 1):
        cut = slices(n, parts)
        assert cut[0][0] == 0 and cut[-1][1] == n and all(a[1] == b[0] for a, b in pairwise(cut))
        assert len(cut) == max(1, min(parts, n // MIN_SLICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_split_add_is_the_single_add_bit_for_bit(dtype, threads, monkeypatch):
    buf_a = tensors(dtype, 1)
    buf_a.append(torch.randn(64, 48, dtype=dtype).t())  # non-contiguous: added whole
    buf_b = [b.clone() for b in buf_a]
    grads = tensors(torch.bfloat16, 2) + [None]  # a gradient in another dtype; none for the last tensor
    workers = set()
    real_add = torch.Tensor.add_

    def spy(self, *a, **k):
        workers.add(threading.current_thread().name)
        return real_add(self, *a, **k)

    add = ParallelAxpy(threads)
    monkeypatch.setattr(torch.Tensor, "add_", spy)
    for alpha in (0.3, -1.7):
        add(buf_a, grads, alpha)
    monkeypatch.undo()
    add.close()
    for alpha in (0.3, -1.7):
        axpy(buf_b, grads, alpha)
    assert all(torch.equal(a, b) for a, b in zip(buf_a, buf_b, strict=True))
    assert any(w.startswith("tsrl-fold") for w in workers) == (threads > 1)
    assert threading.current_thread().name in workers
    assert not torch.equal(buf_a[0], tensors(dtype, 1)[0])  # the folds changed the buffers


def stream_fold(hf: HostFold, bufs, grads_per_backward, mutate_list=False):
    """GRPO-style: each backward's gradients folded twice (alpha, then 1); mutate_list: one list object whose
    tensors are replaced between backwards, as the group's reduce-scatter hook does."""
    shared = [None] * len(bufs[0])
    for grads in grads_per_backward:
        if mutate_list:
            shared[:] = grads
            grads = shared
        hf([(bufs[0], 0.5), (bufs[1], 1.0)], grads)
    hf.sync()


@pytest.mark.parametrize("mutate_list", [False, True])
def test_one_gradient_into_several_buffers_is_staged_once(mutate_list):
    backwards = [tensors(seed=s) for s in range(3)]
    bufs = [[torch.zeros_like(t) for t in backwards[0]] for _ in range(2)]
    ref = [[torch.zeros_like(t) for t in backwards[0]] for _ in range(2)]
    hf = HostFold(cuda=False, threaded=True, threads=2)
    stream_fold(hf, bufs, backwards, mutate_list)
    hf.close()
    for grads in backwards:
        axpy(ref[0], grads, 0.5)
        axpy(ref[1], grads, 1.0)
    assert all(torch.equal(a, b) for x, y in zip(bufs, ref, strict=True) for a, b in zip(x, y, strict=True))
    assert (hf.folds, hf.copies) == (6, 3)


def test_a_list_whose_tensor_was_replaced_is_copied_again():
    """The group hook's case within one backward: the same list object, grads[i] replaced per source rank."""
    a, b = tensors(seed=4), tensors(seed=5)
    shared = list(a)
    bufs = [torch.zeros_like(t) for t in a]
    hf = HostFold(cuda=False, threaded=True)
    hf([(bufs, 1.0)], shared)
    shared[0] = b[0]
    hf([(bufs, 1.0)], shared)
    hf.close()
    assert hf.copies == 2 and torch.equal(bufs[0], a[0] + b[0]) and torch.equal(bufs[1], a[1] + a[1])


class FakeStream:
    made: ClassVar[list] = []

    def __init__(self, device=None):
        FakeStream.made.append(device)

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class FakeEvent:
    recorded: ClassVar[list] = []

    def record(self, stream=None):
        FakeEvent.recorded.append(stream)


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on a GPU, so the fold takes its device path (record_stream, the event)."""

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        pass


def test_the_copy_stream_and_event_live_on_the_learners_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current", device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    FakeStream.made, FakeEvent.recorded = [], []
    hf = HostFold(cuda=True, device="cuda:3")
    hf._to_host = lambda grads, event: grads  # the pinned copy needs a GPU; the order and the sums do not
    g = [t.as_subclass(OnDevice) for t in tensors(seed=6)]
    buf = [torch.zeros_like(t.as_subclass(torch.Tensor)) for t in g]
    hf([(buf, 1.0), (buf, 2.0)], g)  # one gradient into two buffers: one event, one copy
    hf([(buf, 1.0)], [t.as_subclass(torch.Tensor).clone() for t in g])  # host tensors (a close's): no event
    hf.close()
    assert FakeStream.made == [torch.device("cuda", 3)]
    assert FakeEvent.recorded == [("current", torch.device("cuda", 3))]
    assert torch.equal(buf[0], g[0].as_subclass(torch.Tensor) * 4)
    assert HostFold(cuda=True).device == torch.device("cuda", 0)  # no device given: the current one


def test_auto_threads_share_this_process_cpus_over_the_ranks(monkeypatch):
    monkeypatch.setattr(hostfold.os, "sched_getaffinity", lambda pid: set(range(48)))
    assert [auto_threads(r, True) for r in (1, 4, 8, 64)] == [8, 8, 6, 1]
    assert auto_threads(1, False) == 1  # no GPU: the one-thread rule of every process here


def test_a_negative_thread_count_is_a_usage_error():
    with pytest.raises(UsageError, match=r"host fold threads -1: must be >= 0 \(0: auto\)"):
        Objective("grpo", LossConfig(host_fold_threads=-1))


# ---- fresh buffer sets: the first fold assigns -----------------------------------------------------

INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}


def same_bits(a, b) -> bool:
    return all(torch.equal(x.contiguous().view(INT_OF[x.dtype]), y.contiguous().view(INT_OF[y.dtype]))
               for x, y in zip(a, b, strict=True))


def nan_set(like, cls=BufferSet):
    return cls([torch.full_like(t, float("nan")) for t in like])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_fresh_sets_first_split_add_is_the_add_into_zeros_bit_for_bit(dtype, threads):
    like = tensors(dtype, 1)
    like.append(torch.empty(64, 48, dtype=dtype).t())  # non-contiguous: added whole
    first = tensors(torch.bfloat16, 2) + [torch.randn(64, 48, dtype=dtype).t()]  # bf16: the chunked cast
    first[0][:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    first[1] = None  # tensor 1's first gradient comes with the second fold
    second = tensors(dtype, 3) + [torch.randn(64, 48, dtype=dtype).t()]
    fresh, zeros = nan_set(like), [torch.zeros_like(t) for t in like]
    garbage = nan_set(like, list)  # a plain list is added into: the control
    add = ParallelAxpy(threads)
    for grads, alpha in ((first, 0.3), (second, -1.7)):
        for buf in (fresh, zeros, garbage):
            add(buf, grads, alpha)
    add.close()
    assert fresh.written == [True] * len(like) and same_bits(fresh, zeros)
    assert all(torch.isnan(t).all() for t in garbage)


def test_threaded_folds_and_closes_into_fresh_sets_are_the_inline_ones_bit_for_bit():
    """A group's two sets and R, all fresh (NaN), folded and closed through the thread; tensor 1 of the group
    never gets a gradient, so its close skips it and R's tensor 1 is 0 at round close."""
    like = tensors(seed=7)
    backwards = [tensors(seed=s) for s in range(8, 11)]
    for g in backwards:
        g[1] = None
    out = {}
    for threaded in (False, True):
        hf = HostFold(cuda=False, threaded=threaded, threads=2)
        acc = RoundGradAccumulator(like, device="cpu", fold=hf, sync=hf.sync)
        acc._fresh = lambda: nan_set(like)  # what an allocator may leave in the memory
        for r, grads in zip((1.0, 0.0, 1.0), backwards, strict=True):
            acc.add_member("g", r, grads)
        acc.close_group("g", group_stats(torch.tensor([1.0, 0.0, 1.0])))
        out[threaded] = acc.finalize(0.5)
        hf.close()
    assert same_bits(out[True], out[False]) and all(torch.isfinite(t).all() for t in out[True])
    assert torch.equal(out[True][1], torch.zeros_like(like[1]))


FILLS = ((torch, "zeros"), (torch, "zeros_like"), (torch.Tensor, "zero_"), (torch.Tensor, "fill_"))


def test_neither_thread_fills_a_fresh_set(monkeypatch):
    like = tensors(seed=12)
    calls = []
    for owner, name in FILLS:
        real = getattr(owner, name)

        def spy(*a, _real=real, _name=name, **k):
            out = _real(*a, **k)
            if out.numel() > 1:  # a buffer's fill, not the 0-dim zero of a first fold
                calls.append(_name)
            return out

        monkeypatch.setattr(owner, name, spy)
    for zero_filled in (False, True):
        hf = HostFold(cuda=False, threaded=True, threads=2)
        acc = RoundGradAccumulator(like, device="cpu", fold=hf, sync=hf.sync)
        if zero_filled:  # the control: sets zero-filled where they open, then added into
            acc._fresh = lambda: [torch.zeros(t.shape) for t in like]
        acc.add_member("g", 1.0, tensors(seed=13))
        acc.add_to_bucket("b", 0.5, tensors(seed=14))
        acc.add_to_unit("u", tensors(seed=15))
        hf.sync()
        hf.close()
        assert len(calls) == (4 * len(like) if zero_filled else 0), calls


# ---- the bounded queue ------------------------------------------------------------------------------

class SlowAdd(ParallelAxpy):
    """The add of a host slower than the GPU: each fold sleeps first."""

    def __init__(self, seconds: float):
        super().__init__(1)
        self.seconds = seconds

    def __call__(self, buf, grads, alpha):
        time.sleep(self.seconds)
        super().__call__(buf, grads, alpha)


def run_passes(pending, passes=6, units=3, seconds=0.02):
    """A sharded learner's passes: per pass one fold per unit, each its own gradient list with one tensor (the
    group hook's shape). Returns (most passes with a gradient alive after any call, HostFold, buffers)."""
    shapes = [(4096,)] * units
    bufs = [torch.zeros(s) for s in shapes]
    current = [0]
    hf = HostFold(cuda=False, threaded=True, pending=pending, pass_of=lambda: current[0])
    hf._add = SlowAdd(seconds)
    alive: list[tuple[int, weakref.ref]] = []
    most = 0
    for p in range(passes):
        current[0] = p
        for u in range(units):
            grads: list = [None] * units
            grads[u] = torch.full(shapes[u], float(p + 1))
            alive.append((p, weakref.ref(grads[u])))
            hf([(bufs, 0.5)], grads)
            del grads
            most = max(most, len({q for q, ref in alive if ref() is not None}))
    hf.sync()
    assert all(ref() is None for _, ref in alive)  # nothing is kept once folded
    hf.close()
    return most, hf, bufs


@pytest.mark.parametrize("k", [1, 2])
def test_the_queue_keeps_k_passes_of_gradients_at_most(k):
    most, hf, bufs = run_passes(pending=k)
    assert most <= k and hf.waits > 0 and hf.wait_s > 0
    unbounded, hf_u, bufs_u = run_passes(pending=None)  # the control: the same sequence, no bound
    assert unbounded > k + 1 and hf_u.waits == 0
    assert all(torch.equal(a, b) for a, b in zip(bufs, bufs_u, strict=True))
    assert all(torch.equal(b, torch.full_like(b, 0.5 * sum(range(1, 7)))) for b in bufs)


def test_pending_below_one_is_refused():
    with pytest.raises(ValueError, match="host fold pending 0"):
        HostFold(cuda=False, pending=0)
    with pytest.raises(UsageError, match=r"host fold pending 0: must be >= 1"):
        Objective("grpo", LossConfig(host_fold_pending=0))


def test_the_learner_bounds_its_folds_by_its_own_passes(tiny64):
    obj = Objective("grpo", LossConfig(buffer_device="cpu", host_fold_pending=3))
    sl = StreamLearner(tiny64, obj, {}, threaded_host_fold=True)
    assert sl.host_fold.pending == 3 and sl.host_fold._pass_of() == sl.grads.passes == 0
    sl.grads.passes = 5
    assert sl.host_fold._pass_of() == 5
    assert StreamLearner(tiny64, Objective("grpo", LossConfig()), {}).host_fold.pending == 1  # the default


def test_a_closed_groups_sets_are_freed_once_their_close_is_folded():
    like = tensors(seed=20)
    gate = threading.Event()

    class Gated(ParallelAxpy):
        def __call__(self, buf, grads, alpha):
            gate.wait(10)
            super().__call__(buf, grads, alpha)

    hf = HostFold(cuda=False, threaded=True, pending=None)
    hf._add = Gated(1)
    acc = RoundGradAccumulator(like, device="cpu", fold=hf, sync=hf.sync)
    acc.add_member("g", 1.0, tensors(seed=21))
    acc.add_member("g", 0.0, tensors(seed=22))
    sets = [weakref.ref(acc._groups["g"].s_r[0]), weakref.ref(acc._groups["g"].s_1[0])]
    acc.close_group("g", group_stats(torch.tensor([1.0, 0.0])))
    assert acc.open_groups == 0 and all(ref() is not None for ref in sets)  # queued: the queue holds them
    gate.set()
    hf.sync()
    assert all(ref() is None for ref in sets)
    acc.finalize(1.0)
    hf.close()
