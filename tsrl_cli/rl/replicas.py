"""The rollout side's engines: one in the rollout process, N replica processes, or remote servers.

Every variant is an *engine pool* with the same face to the rollout process's agent sessions:

    await pool.generate(TurnRequest) -> TurnOutput   # the request goes to the least-loaded engine
    pool.sync() -> {"version", "start", "end", "bytes"} | None   # take one weight-bus sync (rl/weightbus.py)

- LocalPool: the engine lives in the rollout process (one device; the default).
- ReplicaPool: `devices.rollout` names N devices (cpu:N, 0-3): N `engine-k` processes, each one
  engine and one batcher (engines/batching.py make_batcher), fed through a request queue; the pool sends
  each request to the replica with the fewest requests in flight (ties: the lowest index).
- ServerPool: `rollout.engine: openai`, remote OpenAI-compatible servers (`tsrl serve`).

Which replica answers never changes what is generated: a request carries its own seed
(request_seed of seed, round, group, sample, turn), so a rollout is a pure function of (weights,
seed, round, task, sample) for any replica count, up to the floating-point order of batched
kernels (docs/distributed.md, "Engine replicas"). Every engine host is a member of the weight bus:
new weights never pass through a queue.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import rollout_replicas
from tsrl_cli.engines.auth import client_api_key
from tsrl_cli.engines.batching import make_batcher
from tsrl_cli.engines.load import open_client, open_engine
from tsrl_cli.engines.protocol import TurnRequest
from tsrl_cli.engines.weight_sync import apply_sync
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
    sigterm_raises,
)
from tsrl_cli.rl.placement import Placement
from tsrl_cli.rl.reports import Report
from tsrl_cli.rl.weightbus import Bus, WeightBus


def open_replica_engine(cfg: TrainConfig, init_dir: str, policy_dir: str, devices: tuple[str, ...],
                        start_version: int):
    """(engine, the device its tensors live on) for one replica, holding the weights of `init_dir`
    (engines/load.py open_engine with the run's engine settings).

    vLLM's sampling uses per-request seeds (request_seed per turn, as the hf engine), so a round is
    reproducible for fixed weights, but its kernels are not the learner's: behavior_logprobs differ
    from the learner's log-probs by kernel rounding (the float64 exactness checks use hf).
    """
    ro = cfg.rollout
    vllm = {}
    if ro.engine == "vllm":
        max_pos = json.loads((Path(init_dir) / "config.json").read_text()).get("max_position_embeddings")
        vllm = {"max_model_len": min(ro.max_trajectory_tokens, max_pos) if max_pos else ro.max_trajectory_tokens,
                "gpu_memory_utilization": ro.vllm_memory_fraction,
                "max_num_seqs": ro.max_batch}  # the batcher never runs more turns at once on a replica
    engine, device = open_engine(init_dir, ro.engine, devices, cfg.model.dtype, batch_invariant=ro.batch_invariant,
                                 lora=cfg.lora, seed=cfg.seed, base=policy_dir, **vllm)
    engine.version = start_version
    return engine, device


def replica_daemonic(cfg: TrainConfig, name: str) -> bool:
    """Whether worker process `name` of a run (rollout, engine-k, learner...) may be daemonic.

    A vLLM engine starts its engine core in a process of its own (engines/load.py open_engine), and over
    several devices (rollout.tensor_parallel > 1) a worker process per device; multiprocessing forbids a
    daemonic process to have children ("daemonic processes are not allowed to have children"). Such an
    engine lives in `engine-k` when there are several replicas and in the rollout process itself when
    there is one (LocalPool): those processes are started non-daemonic. They still end with the run:
    Workers joins and terminates them, and processes.exit_with ends them when the main process is gone.
    """
    holds_engine = name.startswith("engine-") or (name == "rollout" and len(rollout_replicas(cfg)) == 1)
    return not (holds_engine and cfg.rollout.engine == "vllm")


def close_engine(engine) -> None:
    """End an engine that holds processes of its own (vLLM: its engine core, and over several devices its
    tensor-parallel workers), before its process returns. A multiprocessing child joins its non-daemonic
    children when its target returns (multiprocessing.util._exit_function), before any atexit hook: a
    process holding such an engine never exited (measured: still alive 120 s after its last turn), and
    when terminated it left vLLM's processes running."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


class EngineHost:
    """One engine and its membership of the weight bus."""

    def __init__(self, engine, bus: WeightBus | None):
        self.engine, self.bus = engine, bus

    def sync(self) -> dict | None:
        """Take one sync from the bus into the engine, bucket by bucket; None when the learner had nothing newer."""
        t0 = time.monotonic()
        info = apply_sync(self.engine, self.bus.receive)
        if info["version"] is None:
            return None
        return {**info, "start": t0, "end": time.monotonic()}


def _combine(infos: list[dict | None]) -> dict | None:
    """One sync seen from the rollout side: the slowest member's end, the bytes every member received."""
    got = [i for i in infos if i is not None]
    if not got:
        return None
    if len({i["version"] for i in got}) != 1 or len(got) != len(infos):
        raise RuntimeError(f"engine replicas disagree after a weight sync: {[i and i['version'] for i in infos]}")
    return {"version": got[0]["version"], "published_at": got[0]["published_at"], "bytes": sum(i["bytes"] for i in got),
            "start": min(i["start"] for i in got), "end": max(i["end"] for i in got), "hosts": len(got)}


class _Pool:
    """What every pool shares: the sync request it sends the learner, and where this process's tensors live."""

    device = "cpu"  # the rollout process holds no engine of its own (LocalPool: its engine's device)

    def want(self, need: int, have: int) -> tuple:
        """The request for a sync that the learner's publisher reads."""
        return need, have

    def end(self) -> None:
        """End the engine this process holds at once, turns running or not (the rollout process's last act,
        on failure too: rollout_worker.rollout_main); nothing for pools whose engines live elsewhere."""


class LocalPool(_Pool):
    """The engine in the rollout process (one device)."""

    def __init__(self, cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, bus: Bus | None,
                 devices: tuple[str, ...]):
        self.engine, self.device = open_replica_engine(cfg, init_dir, policy_dir, devices, start_version)
        # no bus: an engine that never syncs (tests replaying rounds in one process)
        self.host = EngineHost(self.engine, bus.join(1, self.device) if bus else None)
        self.batcher = make_batcher(self.engine, cfg.rollout.max_batch, cfg.rollout.batching)
        self.generate = self.batcher.generate
        self.name = type(self.engine).__name__

    @property
    def version(self) -> int:
        return self.engine.version

    def sync(self) -> dict | None:
        return _combine([self.host.sync()])

    def stats(self) -> dict:
        return {"replicas": 1, "batching": [self.batcher.take_stats()]}

    def close(self) -> None:
        self.batcher.close()
        self.end()

    def end(self) -> None:
        close_engine(self.engine)


# ---- replica processes --------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaArgs:
    """What engine replica process `engine-<index>` starts from (rl/train.py Workers)."""

    cfg: TrainConfig
    placement: Placement
    init_dir: str
    policy_dir: str
    start_version: int
    index: int
    req_q: object  # ("gen", rid, request) | ("sync",) | ("stats",) | None
    resp_q: object
    report_q: object


def replica_main(args: ReplicaArgs) -> None:
    """Engine replica `index` (process `engine-<index>`): answer ("gen", rid, request) with ("out", rid, output),
    ("sync",) with ("synced", index, info), ("stats",) with ("stats", index, figures); None ends it."""
    init_worker()
    cfg, index, req_q, resp_q = args.cfg, args.index, args.req_q, args.resp_q
    devices = args.placement.replicas[index]
    engine, device = open_replica_engine(cfg, args.init_dir, args.policy_dir, devices, args.start_version)
    host = EngineHost(engine, args.placement.bus.join(1 + index, device))
    args.report_q.put((Report.ready, f"engine-{index}", None))

    async def serve() -> None:
        batcher = make_batcher(engine, cfg.rollout.max_batch, cfg.rollout.batching)
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task] = set()

        async def answer(rid: int, request: TurnRequest) -> None:
            try:
                resp_q.put(("out", rid, await batcher.generate(request)))
            except Exception:  # noqa: BLE001 - the session that asked gets the error
                resp_q.put(("err", rid, f"engine-{index}: {traceback.format_exc()}"))

        while (msg := await loop.run_in_executor(None, req_q.get)) is not None:
            if msg[0] == "gen":
                task = asyncio.create_task(answer(msg[1], msg[2]))
                pending.add(task)
                task.add_done_callback(pending.discard)
            elif msg[0] == "sync":  # between rounds: nothing is in flight (the rollout process waits for it)
                await asyncio.gather(*pending)
                resp_q.put(("synced", index, await loop.run_in_executor(None, host.sync)))
            elif msg[0] == "stats":
                resp_q.put(("stats", index, {"batching": batcher.take_stats(), "peak_rss": peak_rss_bytes(),
                                             "peak_device": peak_device_bytes(device)}))
                reset_peak_rss()
                reset_peak_device(device)
        await asyncio.gather(*pending)
        batcher.close()

    with sigterm_raises():  # terminated (the run failed elsewhere): the engine's own processes still end
        try:
            asyncio.run(serve())
        finally:
            close_engine(engine)


class ReplicaPool(_Pool):
    """The rollout process's side of N replica processes: load-balanced requests, syncs, figures."""

    def __init__(self, req_qs, resp_q):
        self.req_qs, self.resp_q = req_qs, resp_q
        self.inflight = [0] * len(req_qs)
        self.served = [0] * len(req_qs)  # requests answered per replica (the load spread, for metrics and tests)
        self._futures: dict[int, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()
        self._control: queue.Queue = queue.Queue()  # synced/stats replies, for the calling thread
        self._reader = threading.Thread(target=self._read, name="tsrl-replica-replies", daemon=True)
        self._reader.start()
        self.version = None
        self.name = None

    def _read(self) -> None:
        while (msg := self.resp_q.get()) is not None:
            if msg[0] in ("out", "err"):
                fut, loop = self._futures.pop(msg[1])
                if msg[0] == "out":
                    loop.call_soon_threadsafe(lambda f=fut, v=msg[2]: f.done() or f.set_result(v))
                else:
                    exc = RuntimeError(msg[2].strip().splitlines()[-1] + f"\n{msg[2]}")
                    loop.call_soon_threadsafe(lambda f=fut, e=exc: f.done() or f.set_exception(e))
            else:
                self._control.put(msg)

    async def generate(self, request: TurnRequest):
        k = min(range(len(self.inflight)), key=lambda i: (self.inflight[i], i))
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._futures[rid] = (fut, loop)
        self.inflight[k] += 1
        try:
            self.req_qs[k].put(("gen", rid, request))
            return await fut
        finally:
            self.inflight[k] -= 1
            self.served[k] += 1

    def _ask(self, what: str) -> list:
        for q in self.req_qs:
            q.put((what,))
        replies = [None] * len(self.req_qs)
        for _ in self.req_qs:
            kind, index, payload = self._control.get()
            assert kind == ("synced" if what == "sync" else what), kind
            replies[index] = payload
        return replies

    def sync(self) -> dict | None:
        info = _combine(self._ask("sync"))
        if info is not None:
            self.version = info["version"]
        return info

    def stats(self) -> dict:
        st = self._ask("stats")
        served, self.served = self.served, [0] * len(self.req_qs)
        return {"replicas": len(st), "replica_requests": served, "batching": [s["batching"] for s in st],
                "peak_rss_replicas": [s["peak_rss"] for s in st],
                "peak_device_replicas": [s["peak_device"] for s in st]}

    def close(self) -> None:
        for q in self.req_qs:
            q.put(None)
        self.resp_q.put(None)
        self._reader.join(timeout=30)


class ServerPool(_Pool):
    """Remote OpenAI-compatible servers (`tsrl serve`): requests over HTTP, weights over the bus.

    A server that fails is marked dead by the client (its requests go to the others). The bus has a
    fixed membership, so the next sync first forms it anew without the dead (a new epoch): the
    learner and the live servers join again with consecutive ranks.
    """

    def __init__(self, cfg: TrainConfig, start_version: int, bus: Bus, log):
        self.cfg, self.bus = cfg, bus
        self.client = open_client(cfg.rollout.servers, timeout_s=cfg.rollout.server_timeout_s, log=log,
                                  api_key=client_api_key(cfg.rollout.server_api_key))
        self.client.join_bus(bus.host, bus.port, 1, bus.world, bus.backend)
        self.generate = self.client.generate
        self.version = start_version
        self.name = "OpenAIEngine"
        self.epoch, self.lost = 0, 0

    def want(self, need: int, have: int) -> tuple:
        if len(self.client.dead) > self.lost:  # re-form the bus without the servers lost since the last one
            self.epoch, self.lost = self.epoch + 1, len(self.client.dead)
            world = 1 + len(self.client.servers) - self.lost
            self.client.join_bus(self.bus.host, self.bus.port, 1, world, self.bus.backend, epoch=self.epoch)
            return need, have, self.epoch, world
        return need, have

    def sync(self) -> dict | None:
        t0 = time.monotonic()
        replies = self.client.sync()
        end = time.monotonic()  # the servers' clocks are not ours: time the sync from here
        got = [r for r in replies if r.get("version") is not None]
        if not got:
            return None
        info = {"version": got[0]["version"], "published_at": None, "bytes": sum(r["bytes"] for r in got),
                "start": t0, "end": end, "hosts": len(got)}
        self.version = info["version"]
        return info

    def stats(self) -> dict:
        live = [u for u in self.client.servers if u not in self.client.dead]
        # the servers batch for themselves: no batching figures here
        return {"replicas": len(live), "replica_requests": list(self.client.served), "batching": None}

    def close(self) -> None:
        self.client.close()


def make_pool(cfg: TrainConfig, placement: Placement, init_dir: str, policy_dir: str, start_version: int, replica_qs,
              log):
    """The rollout process's engine pool for this config (replica_qs: (request queues, reply queue) or None)."""
    if cfg.rollout.engine == "openai":
        return ServerPool(cfg, start_version, placement.bus, log)
    if replica_qs is not None:
        pool = ReplicaPool(*replica_qs)
        pool.version, pool.name = start_version, "VLLMEngine" if cfg.rollout.engine == "vllm" else "HFEngine"
        return pool
    return LocalPool(cfg, init_dir, policy_dir, start_version, placement.bus, placement.replicas[0])

