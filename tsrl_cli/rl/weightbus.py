"""The weight bus: new weights go from the learner to every rollout engine over torch.distributed.

Members: rank 0 is the learner (its leader on a group), ranks 1..N are the engine hosts (local
replica processes, the rollout process's own engine, or remote `tsrl serve` servers). They meet
through a TCPStore that the run's main process serves (host:port travel as text, so a server on
another node can join). The group is a stateless process group of its own (gloo, or NCCL when every
member holds CUDA tensors on a GPU of its own: NCCL refuses two ranks on one device, so members that
share a GPU meet over gloo through host copies): it never touches the learner group's default process group.

One sync = a header broadcast (version, publish time, the manifest of names/dtypes/shapes) and then
the tensors in buckets of at most `bucket_bytes`, each one flat tensor of one dtype, broadcast as a
tensor from where it lies (the learner's GPU on NCCL). A receiver hands every bucket to `apply` as soon
as it has arrived, so an engine holds one bucket beyond its own weights. Nothing of the weights passes
through a multiprocessing queue or a pickle. A bucket costs the sender at most one copy of each tensor
(into the flat bucket), none when the tensors already are the bucket: the learner writes what it
publishes into `buffers()`, which are laid out as the bus's buckets on the bus's device.
"""

from __future__ import annotations

import datetime
import json
import math
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import learner_devices, physical_device, rollout_replicas
from tsrl_cli.rl.reports import Report

BUCKET_BYTES = 256 << 20  # per broadcast: large enough to keep NCCL/gloo busy, small beside any engine
TIMEOUT = datetime.timedelta(minutes=30)  # a sync waits for a learner step at most this long


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _manifest(specs: dict[str, tuple[torch.dtype, Sequence[int]]]) -> list[tuple[str, str, list[int]]]:
    """(name, dtype name, shape) per tensor, in order: the header's manifest, which plan_buckets reads."""
    return [(n, str(dt).removeprefix("torch."), list(shape)) for n, (dt, shape) in specs.items()]


def _consecutive(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The flat tensor the contiguous tensors `ts` make up when each starts where the one before ends in one
    storage on `device` (a bucket of buffers(), or a tensor alone), else None."""
    first = ts[0]
    if first.device != device or any(not t.is_contiguous() for t in ts):
        return None
    at, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in ts:
        if t.device != device or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != at:
            return None
        at += t.numel()
    return first.as_strided((at - first.storage_offset(),), (1,), first.storage_offset())


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
    """One member of the bus. `device` is where this member's bucket tensors live (cuda:N for NCCL); `pin`:
    its host buckets are page-locked (a member on a GPU meeting over gloo), so the copies between them and
    its GPU are DMA transfers."""

    def __init__(self, pg, rank: int, world: int, device: str, bucket_bytes: int = BUCKET_BYTES, pin: bool = False):
        self.pg, self.rank, self.world, self.device, self.bucket_bytes = pg, rank, world, device, bucket_bytes
        self.pin = pin

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
        return cls(pg, rank, world, device if backend == "nccl" else "cpu", bucket_bytes,
                   pin=backend == "gloo" and device.startswith("cuda"))

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

    def buffers(self, specs: dict[str, tuple[torch.dtype, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Empty tensors for `specs` ({name: (dtype, shape)}, in the order they will be sent) laid out as this
        bus's buckets: each bucket one flat tensor on the bus's device (page-locked when a GPU fills it for a
        gloo bus), each name a view of it. send() broadcasts such a bucket as it lies, without a copy."""
        names = list(specs)
        manifest = _manifest(specs)
        out = {}
        for idx in plan_buckets(manifest, self.bucket_bytes):
            sizes = [math.prod(manifest[i][2]) for i in idx]
            flat = torch.empty(sum(sizes), dtype=specs[names[idx[0]]][0], device=self.device, pin_memory=self.pin)
            for i, part in zip(idx, flat.split(sizes), strict=True):
                out[names[i]] = part.view(manifest[i][2])
        return out

    def _bucket(self, ts: list[torch.Tensor]) -> torch.Tensor:
        """One bucket's tensors as one flat tensor on the bus's device: their own memory when they are
        consecutive in one storage there (buffers(), or a tensor alone), else one copy of each into a new
        flat tensor (from a GPU into page-locked memory for gloo, waited for before the broadcast reads it)."""
        ts = [t.detach() for t in ts]
        whole = _consecutive(ts, torch.device(self.device))
        if whole is not None:
            return whole
        flat = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=self.device, pin_memory=self.pin)
        for part, t in zip(flat.split([t.numel() for t in ts]), ts, strict=True):
            part.copy_(t.reshape(-1), non_blocking=self.pin)
        if self.pin:
            for d in {t.device for t in ts if t.is_cuda}:
                torch.cuda.synchronize(d)
        return flat

    def send(self, version: int, tensors: dict[str, torch.Tensor], published_at: float) -> int:
        """Rank 0: broadcast `tensors` as `version`; returns the bytes sent (the tensors' payload)."""
        names = list(tensors)
        manifest = _manifest({n: (t.dtype, t.shape) for n, t in tensors.items()})
        self._bcast_json({"version": version, "published_at": published_at, "manifest": manifest,
                          "bucket_bytes": self.bucket_bytes})
        sent = 0
        with torch.no_grad():
            for idx in plan_buckets(manifest, self.bucket_bytes):
                flat = self._bucket([tensors[names[i]] for i in idx])
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
            flat = self._bcast(torch.empty(sum(sizes), dtype=_dtype(manifest[idx[0]][1]), device=self.device,
                                           pin_memory=self.pin))
            got += flat.numel() * flat.element_size()
            parts = flat.split(sizes)
            apply({manifest[i][0]: p.view(manifest[i][2]) for i, p in zip(idx, parts, strict=True)})
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

    Once a version is sent the publisher lets go of its tensors: a broadcast reaches every member, and
    members only leave, so no one asks for it again. The copy a learner group gathers on rank 0 (on its
    GPU under NCCL) therefore lives from the publish to the sync, not through the next round.
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

    def buffers(self, specs: dict[str, tuple[torch.dtype, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Where to write the next offer's tensors ({name: (dtype, shape)}): the bus sends them without a copy
        (WeightBus.buffers). Fresh ones per offer: the bus may still be sending the last."""
        return self.bus.buffers(specs)

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
                    with self._cond:  # every member has them now: let go of them unless a newer offer did
                        if self._latest[1] is tensors:
                            self._latest = (version, None, at)
                del tensors
        except BaseException:
            if self.report_q is not None:
                self.report_q.put((Report.error, "learner", "weight publisher: " + traceback.format_exc()))
            raise

    def close(self, timeout: float | None = None) -> None:
        """Wait until the rollout side said it needs no more syncs."""
        self._thread.join(timeout)


# ---- the bus of one run (its config decides the members and the backend) -------------------------
def bus_members(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(name, device) of each local member: the learner (its rank 0), then each engine replica, whose bus
    tensors live on its first device (a vLLM replica of several devices receives on the first)."""
    replicas = rollout_replicas(cfg)
    engines = ([("engine", replicas[0][0])] if len(replicas) == 1
               else [(f"engine-{i}", r[0]) for i, r in enumerate(replicas)])
    return [("learner", learner_devices(cfg)[0]), *engines]


def nccl_problem(members: list[tuple[str, str]]) -> str | None:
    """Why these (name, device) members cannot form one NCCL group, or None when they can.

    NCCL takes one rank per GPU: two ranks of one communicator on one device are refused (NCCL's
    "duplicate GPU" error). Processes that share a GPU therefore meet over gloo, through host copies.
    Members are compared by physical GPU (devices.physical_device: the CUDA_VISIBLE_DEVICES entry each names).
    """
    cpu = [f"{n} ({d})" for n, d in members if not d.startswith("cuda")]
    if cpu:
        return f"NCCL needs every member on a CUDA device; {', '.join(cpu)} is not"
    by_gpu: dict[str, list[tuple[str, str]]] = {}  # by physical GPU: the CUDA_VISIBLE_DEVICES entry of each cuda:k
    for n, d in members:
        by_gpu.setdefault(physical_device(d, n), []).append((n, d))
    shared = [f"{'/'.join(dict.fromkeys(d for _, d in ms))} holds {' and '.join(n for n, _ in ms)}"
              for ms in by_gpu.values() if len(ms) > 1]
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


@dataclass(frozen=True)
class Bus:
    """One run's weight bus, resolved once (rl/placement.py): where its store is and who meets there."""

    host: str
    port: int
    world: int  # members: the learner and one per engine host (bus_size)
    backend: str  # gloo | nccl (bus_backend)
    bucket_bytes: int  # rollout.weight_bucket_mb

    def join(self, rank: int, device: str, epoch: int = 0, world: int | None = None) -> WeightBus:
        """Join as `rank`; epoch and world re-form the bus without lost members (remote servers)."""
        return WeightBus.join(self.host, self.port, rank, world or self.world, self.backend, device,
                              bucket_bytes=self.bucket_bytes, epoch=epoch)


def serve_store(host: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
    """The run's TCPStore server (in the main process); members join it with WeightBus.join(host, store.port)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
