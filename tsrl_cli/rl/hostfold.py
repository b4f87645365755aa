"""Streaming buffers in host memory (`loss.buffer_device: cpu`), folded off the learner's critical path.

A fold is `buf += alpha * grads` with `buf` in pinned host memory and `grads` on the GPU. Done
inline it would stall the learner on a device-to-host copy per backward. Here the learner records
an event on its device's current stream and queues the fold; one host thread copies the gradients
on a copy stream of that same device (after that event) into pinned staging tensors and adds them
on the CPU, while the GPU goes on with the next backward. The accumulator calls `sync()` before it
reads any buffer (group close, unit close, round close), so every fold queued before a read is in
the buffer when it is read. Folds run in the order they were queued (one queue), so the sums are
the inline ones, bit for bit.

The add is split into contiguous slices over `threads` CPU threads (`loss.host_fold_threads`):
torch's kernels leave the GIL while they run, and each element's `b + alpha * g` is the same
operation whichever thread does it, so the split changes the speed and never a bit. At 8B a fold
is about 2e9 floats per rank of four (12 bytes each: buffer read and written, staged gradient
read), which one thread adds at host memory speed of one core (results/LOG.md has the GB/s).

A fold takes every (buffer, alpha) its gradient goes into (GRPO's S_r and S_1,
`core.accumulator.add_member`), so one device-to-host copy serves them all. A set opens uninitialised
(core.accumulator.BufferSet): the first fold into each tensor assigns 0 + alpha * g on this thread, the
bits of adding into zeros, so no zero-fill runs on the learner's thread or here.

A group's close (R += s * S_r ...) and an OPD unit's are folds of host buffers into R through the
same queue, so they too leave the learner's thread, after every fold into those buffers. A fold drops its
references when it is done: a closed group's buffer set is freed once its close has been folded.

The queue is bounded by passes (`loss.host_fold_pending`, K): each queued fold holds its gradients on the
device, and a pass of a sharded learner hands over a whole gradient (one all-to-all output per unit, at 8B
on 4 ranks about 16 GB per rank); unbounded, a queue the host adds slower than the GPU fills grows until the
device runs out of memory. The first fold of a new pass waits while K passes (the one in progress included)
have folds queued, so the queue keeps K passes' gradients alive at most (`tsrl plan` counts them: the
learner's `fold_backlog`). A close never waits (its sets were bounded while open); it is queued behind at
most K passes' folds, so the closed sets waiting for it are those of groups closed in that span.

The gradients' memory is kept from the caching allocator until the copy is done (`record_stream`).
Without CUDA there is nothing to overlap: the same class folds inline unless `threaded` is forced
(tests run the threaded path on CPU tensors to check the ordering and the sums).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tsrl_cli.config import LossConfig
from tsrl_cli.core.accumulator import BufferSet, Targets, add_scaled, fresh, readable

MAX_AUTO_THREADS = 8  # a parallel add saturates a socket's memory bandwidth at a few threads
MIN_SLICE = 1 << 20  # elements: a smaller tensor is added whole (a thread hand-off costs more than its add)
CAST_CHUNK = 1 << 18  # elements cast at a time when the gradient's dtype is not the buffer's (1 MiB of float32)


def auto_threads(ranks_here: int, cuda: bool) -> int:
    """loss.host_fold_threads 0: on a GPU, the CPUs this process may run on shared by the learner ranks of this
    machine, at most MAX_AUTO_THREADS; without one, 1 (every process here computes with one thread,
    processes.thread_env)."""
    if not cuda:
        return 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_AUTO_THREADS, usable // max(1, ranks_here)))


def slices(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous slices of n elements, each at least MIN_SLICE (one if n is small)."""
    parts = max(1, min(parts, n // MIN_SLICE))
    step = -(-n // parts)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _add_slice(fb: torch.Tensor, fg: torch.Tensor, a: int, z: int, alpha: float, first: bool = False) -> None:
    """fb[a:z] += alpha * fg[a:z] (first: fb uninitialised, assigned; core.accumulator.add_scaled). A gradient of
    another dtype (bf16 into float32 buffers) is cast CAST_CHUNK elements at a time into one small reused tensor:
    a whole-slice cast allocates (and page-faults) a copy as large as the slice, which measured 3x slower than the
    chunked cast here. The cast is exact, and the add is the same operation on the same values, so the result is
    the unchunked one bit for bit."""
    if fg.dtype == fb.dtype:
        add_scaled(fb[a:z], fg[a:z], alpha, first)
        return
    tmp = torch.empty(min(CAST_CHUNK, z - a), dtype=fb.dtype)
    for s in range(a, z, CAST_CHUNK):
        e = min(z, s + CAST_CHUNK)
        t = tmp[:e - s]
        t.copy_(fg[s:e])
        add_scaled(fb[s:e], t, alpha, first)


class ParallelAxpy:
    """buf += alpha * grads (core.accumulator.axpy's contract, a BufferSet's first folds assigning), each large
    tensor's add split over `threads` threads (this one included)."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None  # made at the first split add (again after a close)

    def __call__(self, buf: list[torch.Tensor], grads: Sequence[torch.Tensor | None], alpha: float) -> None:
        for i, (b, g) in enumerate(zip(buf, readable(grads), strict=True)):
            if g is None:
                continue
            g, first = g.to(device=b.device), fresh(buf, i)
            if not (b.is_contiguous() and g.is_contiguous()) or b.numel() < 2 * MIN_SLICE:
                add_scaled(b, g.to(dtype=b.dtype), alpha, first)
            else:
                fb, fg = b.view(-1), g.reshape(-1)
                parts = slices(fb.numel(), self.threads)
                if len(parts) > 1 and self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="tsrl-fold")
                futures = [self._pool.submit(_add_slice, fb, fg, a, z, alpha, first) for a, z in parts[1:]]
                _add_slice(fb, fg, *parts[0], alpha, first)
                for f in futures:
                    f.result()
            if isinstance(buf, BufferSet):
                buf.written[i] = True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class HostFold:
    """cuda: the gradients are on `device` (default: the current CUDA device) and the buffers in host memory.
    threaded: fold on a host thread (default: when cuda). threads: CPU threads of each add.
    pending: K, the passes that may have folds queued at once, the one in progress included (None: unbounded).
    pass_of: the pass a fold belongs to, read when it is queued (the learner's count of backward passes;
    default: each call is a pass of its own)."""

    def __init__(self, cuda: bool, threaded: bool | None = None, *, device: torch.device | str | None = None,
                 threads: int = 1, pending: int | None = LossConfig.host_fold_pending,
                 pass_of: Callable[[], Hashable] | None = None):
        if pending is not None and pending < 1:
            raise ValueError(f"host fold pending {pending}: must be >= 1 (or None: unbounded)")
        self.cuda = cuda
        self.threaded = cuda if threaded is None else threaded
        self.device = None
        if cuda:
            self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
        self._add = ParallelAxpy(threads)
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.pending, self._pass_of = pending, pass_of
        self._queued: dict[Hashable, int] = {}  # pass -> its folds queued and not done
        self._done = threading.Condition()  # notified by the fold thread after each fold
        self._calls = 0
        self.folds = 0  # adds into a buffer
        self.copies = 0  # gradient lists staged for them (one per call, whatever the number of targets)
        self.waits = 0  # folds the learner's thread held back because K passes were queued
        self.wait_s = 0.0  # seconds it waited for them

    @property
    def threads(self) -> int:
        return self._add.threads

    def __call__(self, targets: Targets, grads: Sequence[torch.Tensor | None]) -> None:
        """Add grads into each (buffer, alpha) of targets (core.accumulator.fold_into's contract)."""
        self.folds += len(targets)
        # a copy of the list: the group's hook replaces its tensors between calls; a BufferSet (a close) is kept,
        # its written flags read when the fold runs
        grads = grads if isinstance(grads, BufferSet) else list(grads)
        targets = list(targets)
        if not self.threaded:
            for buf, alpha in targets:
                self._add(buf, grads, alpha)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tsrl-host-fold", daemon=True)
            self._thread.start()
        event = None
        on_device = [g for g in grads if g is not None and g.is_cuda]  # none for a close's host buffers
        if on_device:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            for g in on_device:
                g.record_stream(self._stream)
        tag = None  # a close folds host buffers (a BufferSet), no gradient: it never waits
        if not isinstance(grads, BufferSet):
            tag = self._pass_of() if self._pass_of is not None else self._calls
            self._calls += 1
            self._admit(tag)
        self._q.put((tag, targets, grads, event))

    def _admit(self, tag: Hashable) -> None:
        """Count a fold of pass `tag` as queued; the first of a new pass waits while K passes have folds queued."""
        with self._done:
            if self.pending is not None and tag not in self._queued and len(self._queued) >= self.pending:
                self.waits += 1
                t0 = time.perf_counter()
                self._done.wait_for(lambda: len(self._queued) < self.pending)
                self.wait_s += time.perf_counter() - t0
            self._queued[tag] = self._queued.get(tag, 0) + 1

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            tag = item[0]
            try:
                if self._error is None:
                    self._fold(*item[1:])
            except BaseException as e:  # noqa: BLE001 - re-raised in the learner's thread by sync()
                self._error = e
            finally:
                item = None  # this thread keeps no gradient or buffer once its fold is done, before it says so
                if tag is not None:
                    with self._done:
                        left = self._queued.pop(tag) - 1
                        if left:
                            self._queued[tag] = left
                        self._done.notify_all()
                self._q.task_done()

    def _fold(self, targets: list, grads: Sequence, event) -> None:
        host = self._to_host(grads, event)
        for buf, alpha in targets:
            self._add(buf, host, alpha)

    def _to_host(self, grads: Sequence, event) -> Sequence:
        self.copies += 1
        if event is None:  # nothing on the device: host tensors (a close) or no CUDA at all
            return grads
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            host = [g if g is None or not g.is_cuda else
                    torch.empty(g.shape, dtype=g.dtype, pin_memory=True).copy_(g, non_blocking=True) for g in grads]
        self._stream.synchronize()
        return host

    def sync(self) -> None:
        """Wait for every queued fold; raise the first error one of them met."""
        if self._thread is not None:
            self._q.join()
        if self._error is not None:
            raise RuntimeError(f"folding into the host buffers failed: {self._error}") from self._error

    def close(self) -> None:
        if self._thread is not None:
            self.sync()
            self._q.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        self._add.close()
