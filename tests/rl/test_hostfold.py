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
"""

from __future__ import annotations

import threading
from itertools import pairwise
from typing import ClassVar

import pytest
import torch

from tsrl_cli.config import LossConfig
from tsrl_cli.core.accumulator import axpy
from tsrl_cli.errors import UsageError
from tsrl_cli.rl import hostfold
from tsrl_cli.rl.hostfold import MIN_SLICE, HostFold, ParallelAxpy, auto_threads, slices
from tsrl_cli.rl.learner import Objective


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
    assert all(torch.equal(a, b) for x, y in zip(bufs, ref) for a, b in zip(x, y, strict=True))
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
