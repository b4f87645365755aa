"""The engine interface and the batcher that serves many concurrent agent sessions.

An engine answers a batch of TurnRequests (one model turn each) in one inference loop: measured
here, calling `generate` from many Python threads was slower than sequential calls, while
batching 8 requests gave 5-6x the throughput of one. `TurnBatcher` collects the requests of all
sessions that are waiting for the model and hands them to the engine together, on one thread.
`apply_sync` takes one weight sync into any engine (train's engines and `tsrl serve` alike).
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128  # per model turn
    stop_token_ids: tuple[int, ...] = ()  # the turn ends after emitting one of these (kept in the turn)
    seed: int = 0  # per request: the same (weights, context, params, seed) gives the same tokens


@dataclass
class TurnRequest:
    context_ids: list[int]
    params: SamplingParams


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw model log-probs of the sampled tokens (kept as behavior_logprobs)
    finish_reason: str  # "stop" (a stop token was emitted) | "length" (max_tokens reached)
    policy_version: int = 0


class PolicyEngine(Protocol):
    version: int

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]: ...

    def update_weights(self, named_tensors, version: int) -> None: ...


def apply_sync(engine: PolicyEngine, receive: Callable[[Callable[[dict], None]], dict],
               first_bucket: Callable[[], None] = lambda: None) -> dict:
    """Take one weight sync into `engine`: `receive(apply)` (rl/weightbus.py WeightBus.receive) calls
    apply(named tensors) per bucket as it arrives, and each bucket goes straight into update_weights.
    The engine keeps its old version until the last bucket is in, then takes the sync's; a version None
    (the learner had nothing newer) leaves it as it was. `first_bucket()` runs before the first bucket
    is applied (`tsrl serve` takes its weights lock there). Returns receive's {"version", "bytes", ...}."""
    started = False

    def apply(bucket: dict) -> None:
        nonlocal started
        if not started:
            first_bucket()
            started = True
        engine.update_weights(bucket, engine.version)

    info = receive(apply)
    if info["version"] is not None:
        engine.version = info["version"]
    return info


def request_seed(*parts: object) -> int:
    """A 63-bit seed from (seed, round, task, sample, turn, ...): stable across processes and runs."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


@dataclass
class _Pending:
    request: TurnRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop = field(repr=False)


class TurnBatcher:
    """Serve `await batcher.generate(req)` from many asyncio sessions with batched engine calls.

    One worker thread owns the engine: it takes every request waiting at that moment (up to
    `max_batch`), runs one engine.generate, and resolves the futures. Tool calls of other sessions
    keep running on the event loop meanwhile (torch releases the GIL inside its kernels).
    """

    def __init__(self, engine: PolicyEngine, max_batch: int = 8):
        self.engine, self.max_batch = engine, max_batch
        self._q: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="tsrl-engine", daemon=True)
        self._thread.start()
        self.batches: list[int] = []  # batch sizes served, for metrics and tests

    async def generate(self, request: TurnRequest) -> TurnOutput:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put(_Pending(request, fut, loop))
        return await fut

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
            try:
                outs = self.engine.generate([p.request for p in batch])
                for p, o in zip(batch, outs, strict=True):
                    p.loop.call_soon_threadsafe(_set_result, p.future, o)
            except BaseException as e:  # the engine failed: every waiting session gets the error
                for p in batch:
                    p.loop.call_soon_threadsafe(_set_exception, p.future, e)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
