"""The batchers that serve one engine to many concurrent agent sessions.

An engine answers a batch of TurnRequests (one model turn each) in one inference loop: measured
here, calling `generate` from many Python threads was slower than sequential calls, while
batching 8 requests gave 5-6x the throughput of one. A batcher owns the engine on one thread and
serves `await batcher.generate(request)` from every session:

  ContinuousBatcher  (rollout.batching continuous, the default for engines with add/step/running:
                     hf, vllm) a turn joins the running batch at the engine's next step and returns
                     when its own sequence ends, whatever else runs (vLLM's continuous batching).
  TurnBatcher        (static; engines with generate only: the scripted one) takes the turns waiting
                     at that moment, runs one blocking engine.generate, and only then looks again.

`make_batcher` is the one place a batcher is made (train's engine and replicas, `tsrl serve`,
evaluations). Both record BatchingStats (engines/batching_stats.py).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tsrl_cli.engines.batching_stats import BatchingStats
from tsrl_cli.engines.protocol import PolicyEngine, SteppingEngine, TurnOutput, TurnRequest, can_step
from tsrl_cli.errors import UsageError

BATCHING = ("continuous", "static")  # rollout.batching


@dataclass
class _Pending:
    request: TurnRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop = field(repr=False)
    submitted_at: float = 0.0  # the batcher's clock when generate() was called

    def answer(self, out: TurnOutput) -> None:
        self._resolve(_set_result, out)

    def fail(self, exc: BaseException) -> None:
        self._resolve(_set_exception, exc)

    def _resolve(self, how, value) -> None:
        try:
            self.loop.call_soon_threadsafe(how, self.future, value)
        except RuntimeError:  # the session's event loop is closed (it stopped waiting): nobody to tell
            pass


class _Queued:
    """What both batchers share: a session's turn goes on the worker thread's queue and is awaited."""

    _q: queue.Queue
    clock: Callable[[], float]

    async def generate(self, request: TurnRequest) -> TurnOutput:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put(_Pending(request, fut, loop, self.clock()))
        return await fut


class TurnBatcher(_Queued):
    """Serve `await batcher.generate(req)` from many asyncio sessions with batched engine calls (static).

    One worker thread owns the engine: it takes every request waiting at that moment (up to
    `max_batch`), runs one engine.generate, and resolves the futures. Tool calls of other sessions
    keep running on the event loop meanwhile (torch releases the GIL inside its kernels).
    `pause()` waits for the engine call in progress and holds the next off until `resume()`.
    """

    def __init__(self, engine: PolicyEngine, max_batch: int = 8, clock: Callable[[], float] = time.monotonic):
        self.engine, self.max_batch, self.clock = engine, max_batch, clock
        self.stats = BatchingStats()
        self.batches: list[int] = []  # batch sizes served, for tests
        self._gate = threading.Lock()  # held by an engine call, or by pause() until resume()
        self._q: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="tsrl-batcher", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                batch.append(nxt)
            self.batches.append(len(batch))
            with self._gate:
                t = self.clock()
                self.stats.stepped([t - p.submitted_at for p in batch], len(batch))
                try:
                    outs = self.engine.generate([p.request for p in batch])
                    if len(outs) != len(batch):
                        raise RuntimeError(f"{type(self.engine).__name__}.generate answered {len(outs)} turns "
                                           f"of {len(batch)}")
                except BaseException as e:  # noqa: BLE001 - the engine failed: every session of the call gets the error
                    for p in batch:
                        p.fail(e)
                    continue
            t = self.clock()
            for p, o in zip(batch, outs, strict=True):  # lengths checked above
                self.stats.returned(p.submitted_at, t, len(o.token_ids))
                p.answer(o)

    def take_stats(self) -> dict:
        """{"batching": "static", **BatchingStats.take()}: this batcher's figures since the last take."""
        return {"batching": "static", **self.stats.take()}

    def pause(self) -> None:
        self._gate.acquire()

    def resume(self) -> None:
        self._gate.release()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


_WAKE = object()  # put on a ContinuousBatcher's queue to wake its worker (a pause asked)


class ContinuousBatcher(_Queued):
    """Serve `await batcher.generate(req)` from many asyncio sessions; each turn joins the running batch.

    One worker thread owns the engine (a SteppingEngine). Each loop it admits every waiting turn
    (`engine.add`) while fewer than `max_running` run, calls `engine.step()` (one decode step of all of
    them) and resolves the turns that ended in it; it blocks on the queue only when nothing runs. So a
    turn waits for at most one step to start, and returns when its own sequence ends.

    A turn the engine refuses at admission fails alone. An exception from `engine.step()` fails every
    waiting and running turn with it (the batch is lost); if the engine still counts running turns after
    it, it is in an unknown state, and every later turn fails with that error too (`error`).
    `pause()` stops admission and returns once nothing runs (a weight sync goes in then); `resume()`.
    """

    def __init__(self, engine: SteppingEngine, max_running: int = 16, clock: Callable[[], float] = time.monotonic):
        if not can_step(engine):
            raise TypeError(f"{type(engine).__name__} has no add/step/running: use TurnBatcher")
        self.engine, self.max_running, self.clock = engine, max_running, clock
        self.stats = BatchingStats()
        self.steps = 0  # engine steps taken
        self.peak_running = 0  # most turns in one step
        self.error: BaseException | None = None  # the failure that left the engine unusable
        self._pausing = False
        self._paused, self._resumed = threading.Event(), threading.Event()
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="tsrl-batcher", daemon=True)
        self._thread.start()

    def _take(self, block: bool) -> list:
        items = [self._q.get()] if block else []
        while True:
            try:
                items.append(self._q.get_nowait())
            except queue.Empty:
                return items

    def _work(self) -> None:
        waiting: deque[_Pending] = deque()
        running: dict[int, _Pending] = {}
        ids = itertools.count()
        closing = False
        while not (closing and not waiting and not running):
            if self._pausing and not running:  # drained: the caller of pause() may now change the engine
                self._paused.set()
                self._resumed.wait()
                self._resumed.clear()
            idle = not running and (not waiting or self._pausing)
            for item in self._take(block=idle and not closing):
                if item is None:
                    closing = True
                elif item is not _WAKE:
                    waiting.append(item)
            if self.error is not None:  # a failed engine takes no more turns
                for p in waiting:
                    p.fail(self.error)
                waiting.clear()
                continue
            admitted = []
            while waiting and not self._pausing and len(running) < self.max_running:
                p = waiting.popleft()
                rid = next(ids)
                try:
                    self.engine.add(rid, p.request)
                except Exception as e:  # noqa: BLE001 - this turn is refused (e.g. too long); the others go on
                    p.fail(e)
                    continue
                running[rid] = p
                admitted.append(p)
            if not running:
                continue
            t = self.clock()
            self.stats.stepped([t - p.submitted_at for p in admitted], len(running))
            self.steps += 1
            self.peak_running = max(self.peak_running, len(running))
            try:
                ended = self.engine.step()
                if unknown := [rid for rid, _ in ended if rid not in running]:
                    raise RuntimeError(f"{type(self.engine).__name__}.step returned turns it was not given: {unknown}")
            except BaseException as e:  # noqa: BLE001 - the batch is lost: every waiting and running session gets it
                if self.engine.running() != 0:  # and the engine still holds some of it: it takes no more turns
                    self.error = e
                for p in [*running.values(), *waiting]:
                    p.fail(e)
                running.clear()
                waiting.clear()
                continue
            t = self.clock()
            for rid, out in ended:
                p = running.pop(rid)
                self.stats.returned(p.submitted_at, t, len(out.token_ids))
                p.answer(out)

    def take_stats(self) -> dict:
        """{"batching": "continuous", **BatchingStats.take()}: this batcher's figures since the last take."""
        return {"batching": "continuous", **self.stats.take()}

    def pause(self) -> None:
        """Admit nothing more; return once every running turn has returned (the engine is then idle)."""
        self._pausing = True
        self._q.put(_WAKE)
        self._paused.wait()

    def resume(self) -> None:
        self._paused.clear()
        self._pausing = False
        self._resumed.set()

    def close(self) -> None:
        """Stop once the turns already submitted have returned."""
        self._q.put(None)
        self._thread.join(timeout=30)


def make_batcher(engine, max_batch: int = 16, batching: str = "continuous",
                 clock: Callable[[], float] = time.monotonic) -> ContinuousBatcher | TurnBatcher:
    """The batcher over `engine`: the one place one is made (train's engine and replicas, `tsrl serve`,
    evaluations). `continuous` (rollout.batching): a ContinuousBatcher with at most `max_batch` turns
    running, for an engine that can step (hf, vllm); a TurnBatcher (at most `max_batch` turns per engine
    call) for `static` and for engines with generate only (the scripted one)."""
    if batching not in BATCHING:
        raise UsageError(f"rollout.batching {batching!r}: use one of {', '.join(BATCHING)}")
    if max_batch < 1:
        raise UsageError(f"rollout.max_batch {max_batch}: must be >= 1")
    if batching == "continuous" and can_step(engine):
        return ContinuousBatcher(engine, max_running=max_batch, clock=clock)
    return TurnBatcher(engine, max_batch=max_batch, clock=clock)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
