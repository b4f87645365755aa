"""The weight bus: new weights go from the learner to every rollout engine over torch.distributed.

Members: rank 0 is the learner (its leader on a group), ranks 1..N are the engine hosts (local
replica processes, the rollout process's own engine, or remote `tsrl serve` servers). They meet
through a TCPStore that the run's main process serves (host:port travel as text, so a server on
another node can join). The group is a stateless process group of its own (gloo, or NCCL when every
member holds CUDA tensors on a GPU of its own: NCCL refuses two ranks on one device, so members that
share a GPU meet over gloo through host copies): it never touches the learner group's default process group.

One sync = a header broadcast (version, publish time, the manifest of names/dtypes/shapes) and then
the tensors in buckets of at most `bucket_bytes`, each one flat tensor of one dtype. A receiver
hands every bucket to `apply` as soon as it has arrived, so an engine holds one bucket beyond its
own weights. Nothing of the weights passes through a multiprocessing queue or a pickle.
"""

from __future__ import annotations

import datetime
import json
import math
import threading
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import learner_devices, rollout_replicas

BUCKET_BYTES = 256 << 20  # per broadcast: large enough to keep NCCL/gloo busy, small beside any engine
TIMEOUT = datetime.timedelta(minutes=30)  # a sync waits for a learner step at most this long


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def plan_buckets(manifest: list[tuple[str, str, list[int]]], bucket_bytes: int) -> list[list[int]]:
    """Indices of the manifest per bucket: consecutive tensors of one dtype, at most bucket_bytes each
    (a tensor larger than that is a bucket of its own)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, dt, shape) in enumerate(manifest):
        n = math.prod(shape) * _dtype(dt).itemsize
        if not buckets or dt != dtype or size + n > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += n
    return buckets


class WeightBus:
    """One member of the bus. `device` is where this member's bucket tensors live (cuda:N for NCCL)."""

    def __init__(self, pg, rank: int, world: int, device: str, bucket_bytes: int = BUCKET_BYTES):
        self.pg, self.rank, self.world, self.device, self.bucket_bytes = pg, rank, world, device, bucket_bytes

    @classmethod
    def join(cls, host: str, port: int, rank: int, world: int, backend: str = "gloo", device: str = "cpu",
             bucket_bytes: int = BUCKET_BYTES, timeout: datetime.timedelta = TIMEOUT, epoch: int = 0) -> WeightBus:
        """Connect to the run's TCPStore and form the bus (blocks until all `world` members joined).
        `epoch` names one membership: after a remote server is lost, the others form epoch + 1."""
        store = dist.PrefixStore(f"tsrl-weight-bus-{epoch}", dist.TCPStore(host, int(port), is_master=False,
                                                                            timeout=timeout))
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        elif backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, world, timeout)
        else:
            raise ValueError(f"weight bus backend {backend!r}: use gloo or nccl")
        return cls(pg, rank, world, device if backend == "nccl" else "cpu", bucket_bytes)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()
        return t

    def _bcast_json(self, obj=None):
        if self.rank == 0:
            data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(self.device)
            self._bcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device))
            self._bcast(data)
            return obj
        n = int(self._bcast(torch.zeros(1, dtype=torch.int64, device=self.device)).item())
        data = self._bcast(torch.empty(n, dtype=torch.uint8, device=self.device))
        return json.loads(bytes(data.cpu().numpy()).decode())

    def send(self, version: int, tensors: dict[str, torch.Tensor], published_at: float) -> int:
        """Rank 0: broadcast `tensors` as `version`; returns the bytes sent (the tensors' payload)."""
        names = list(tensors)
        manifest = [(n, str(tensors[n].dtype).removeprefix("torch."), list(tensors[n].shape)) for n in names]
        self._bcast_json({"version": version, "published_at": published_at, "manifest": manifest,
                          "bucket_bytes": self.bucket_bytes})
        sent = 0
        with torch.no_grad():
            for idx in plan_buckets(manifest, self.bucket_bytes):
                flat = torch.cat([tensors[names[i]].detach().reshape(-1).to(self.device) for i in idx])
                self._bcast(flat)
                sent += flat.numel() * flat.element_size()
        return sent

    def send_nothing(self) -> None:
        """Rank 0: answer a sync with "nothing newer" (a header alone)."""
        self._bcast_json({"version": None, "published_at": None, "manifest": [], "bucket_bytes": self.bucket_bytes})

    def receive(self, apply: Callable[[dict[str, torch.Tensor]], None]) -> dict:
        """Ranks 1..N: take one sync, calling apply(named tensors) per bucket as it arrives.
        Returns {"version", "published_at", "bytes"}; version None when rank 0 had nothing newer."""
        head = self._bcast_json()
        manifest = [(n, dt, shape) for n, dt, shape in head["manifest"]]
        got = 0
        for idx in plan_buckets(manifest, head["bucket_bytes"]):
            sizes = [math.prod(manifest[i][2]) for i in idx]
            flat = self._bcast(torch.empty(sum(sizes), dtype=_dtype(manifest[idx[0]][1]), device=self.device))
            got += flat.numel() * flat.element_size()
            parts = flat.split(sizes)
            apply({manifest[i][0]: p.view(manifest[i][2]) for i, p in zip(idx, parts)})
        return {"version": head["version"], "published_at": head["published_at"], "bytes": got}

    def close(self) -> None:
        self.pg = None


class Publisher:
    """The learner's side of the bus: it holds the newest published weights and sends them when the
    rollout side asks, from a thread, so the learner's loop never waits for the rollout side.

    The rollout side asks with (need, have[, epoch, world]) on `want_q` (None: no more syncs): the
    publisher waits until it holds a version >= need, then broadcasts it, or "nothing newer" when
    that version <= have. A new epoch (remote servers were lost) first forms the bus anew with
    `rejoin(epoch, world)`. A failure is reported on report_q as the learner's error, so the run stops.
    """

    def __init__(self, bus: WeightBus, want_q, version: int, report_q=None,
                 rejoin: Callable[[int, int], WeightBus] | None = None):
        self.bus, self.want_q, self.report_q, self.rejoin = bus, want_q, report_q, rejoin
        self.epoch = 0
        self._cond = threading.Condition()
        self._latest: tuple[int, dict | None, float | None] = (version, None, None)
        self.sent: list[tuple[int, int]] = []  # (version, bytes) per sync served
        self._thread = threading.Thread(target=self._serve, name="tsrl-weight-publisher", daemon=True)
        self._thread.start()

    def offer(self, version: int, tensors: dict[str, torch.Tensor], published_at: float) -> None:
        """Make `tensors` the newest weights (the caller must not change them until the next offer)."""
        with self._cond:
            self._latest = (version, tensors, published_at)
            self._cond.notify_all()

    def _serve(self) -> None:
        try:
            while (msg := self.want_q.get()) is not None:
                need, have = msg[:2]
                if len(msg) > 2 and msg[2] != self.epoch:
                    self.epoch = msg[2]
                    self.bus = self.rejoin(msg[2], msg[3])
                with self._cond:  # a version >= need, and its tensors unless the asker has that version
                    self._cond.wait_for(lambda need=need, have=have: self._latest[0] >= need and (
                        self._latest[1] is not None or self._latest[0] <= have))
                    version, tensors, at = self._latest
                if version <= have or tensors is None:
                    self.bus.send_nothing()
                else:
                    self.sent.append((version, self.bus.send(version, tensors, at)))
        except BaseException:
            if self.report_q is not None:
                self.report_q.put(("error", "learner", "weight publisher: " + traceback.format_exc()))
            raise

    def close(self, timeout: float | None = None) -> None:
        """Wait until the rollout side said it needs no more syncs."""
        self._thread.join(timeout)


# ---- the bus of one run (its config decides the members and the backend) -------------------------
def bus_members(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(name, device) of each local member: the learner (its rank 0), then each engine replica, whose bus
    tensors live on its first device (a vLLM replica of several devices receives on the first)."""
    replicas = rollout_replicas(cfg)
    engines = [("engine", replicas[0][0])] if len(replicas) == 1 else [(f"engine-{i}", r[0]) for i, r in enumerate(replicas)]
    return [("learner", learner_devices(cfg)[0]), *engines]


def nccl_problem(members: list[tuple[str, str]]) -> str | None:
    """Why these (name, device) members cannot form one NCCL group, or None when they can.

    NCCL takes one rank per GPU: two ranks of one communicator on one device are refused (NCCL's
    "duplicate GPU" error). Processes that share a GPU therefore meet over gloo, through host copies.
    """
    cpu = [f"{n} ({d})" for n, d in members if not d.startswith("cuda")]
    if cpu:
        return f"NCCL needs every member on a CUDA device; {', '.join(cpu)} is not"
    by_device: dict[str, list[str]] = {}
    for n, d in members:
        by_device.setdefault(d, []).append(n)
    shared = [f"{d} holds {' and '.join(ns)}" for d, ns in by_device.items() if len(ns) > 1]
    if shared:
        return f"{'; '.join(shared)}: NCCL joins at most one rank per GPU"
    return None


def choose_backend(members: list[tuple[str, str]], forced: str = "auto") -> str:
    """The bus's backend for these local members: `forced` unless auto; auto = nccl when every member is on
    its own CUDA device, else gloo (co-located members, or any member on the CPU)."""
    if forced != "auto":
        return forced
    return "nccl" if nccl_problem(members) is None else "gloo"


def bus_backend(cfg: TrainConfig) -> str:
    """The run's bus backend (rollout.weight_sync_backend; auto: choose_backend over bus_members)."""
    if cfg.rollout.weight_sync_backend != "auto":
        return cfg.rollout.weight_sync_backend
    if cfg.rollout.engine == "openai":
        return "gloo"
    return choose_backend(bus_members(cfg))


def bus_size(cfg: TrainConfig) -> int:
    """Members of the weight bus: the learner and one per engine host."""
    hosts = len(cfg.rollout.servers) if cfg.rollout.engine == "openai" else len(rollout_replicas(cfg))
    return 1 + hosts


def join_bus(cfg: TrainConfig, addr: tuple[str, int], rank: int, device: str, epoch: int = 0,
             world: int | None = None) -> WeightBus:
    return WeightBus.join(addr[0], addr[1], rank, world or bus_size(cfg), bus_backend(cfg), device,
                          bucket_bytes=cfg.rollout.weight_bucket_mb << 20, epoch=epoch)


def serve_store(host: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
    """The run's TCPStore server (in the main process); members join it with WeightBus.join(host, store.port)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
