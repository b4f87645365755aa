"""Streaming buffers in host memory (`loss.buffer_device: cpu`), folded off the learner's critical path.

A fold is `buf += alpha * grads` with `buf` in pinned host memory and `grads` on the GPU. Done
inline it would stall the learner on a device-to-host copy per backward. Here the learner records
an event on its stream and queues the fold; one host thread copies the gradients on a copy stream
(after that event) into pinned staging tensors and adds them on the CPU, while the GPU goes on with
the next backward. The accumulator calls `sync()` before it reads any buffer (group close, unit
close, round close), so every fold queued before a read is in the buffer when it is read.
Folds run in the order they were queued (one thread), so the sums are the inline ones, bit for bit.

The gradients' memory is kept from the caching allocator until the copy is done (`record_stream`).
Without CUDA there is nothing to overlap: the same class folds inline unless `threaded` is forced
(tests run the threaded path on CPU tensors to check the ordering and the sums).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from tsrl_cli.core.accumulator import axpy


class HostFold:
    def __init__(self, cuda: bool, threaded: bool | None = None):
        self.cuda = cuda
        self.threaded = cuda if threaded is None else threaded
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream() if cuda else None
        self.folds = 0

    def __call__(self, buf: list[torch.Tensor], grads: Sequence[torch.Tensor | None], alpha: float) -> None:
        self.folds += 1
        if not self.threaded:
            axpy(buf, grads, alpha)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tsrl-host-fold", daemon=True)
            self._thread.start()
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            for g in grads:
                if g is not None and g.is_cuda:
                    g.record_stream(self._stream)
        self._q.put((buf, list(grads), alpha, event))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                buf, grads, alpha, event = item
                if self._error is None:
                    axpy(buf, self._to_host(grads, event), alpha)
            except BaseException as e:  # noqa: BLE001 - re-raised in the learner's thread by sync()
                self._error = e
            finally:
                self._q.task_done()

    def _to_host(self, grads: list, event) -> list:
        if not self.cuda:
            return grads
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            host = [None if g is None else torch.empty(g.shape, dtype=g.dtype, pin_memory=True).copy_(g, non_blocking=True)
                    for g in grads]
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
