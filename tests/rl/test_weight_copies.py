"""Copies of the weights on their way from the learner to an engine, counted per sync on the CPU (gloo).

One sync = the learner's live_state (rl/ranks.py) -> Publisher.offer -> the bus's buckets -> an hf engine's
apply_sync, with both bus members in this process (the publisher's thread sends, the test's thread receives).
Every torch call that copies a weight tensor (to, cpu, clone, contiguous, copy_, cat, pin_memory) is counted
while it runs, and so is every pickle; the engine's own write into its parameters is counted apart.

- on-policy: the live tensors, one copy of each into its bucket; none when each tensor is a bucket alone
- async: one copy of each into the bus's buffers, which the bus then sends as they lie
- a learner group (2 CPU ranks, float32 masters of a bf16 model): the shards are cast before the gather, so
  the gather moves bf16 bytes, and rank 0 copies each tensor once, into the bus's buffers
- the publisher lets go of a version's tensors once it has sent them (a group's gathered copy does not
  outlive its sync), and keeps them while no sync has taken them
Positive controls: the staging these replace (a host copy, then the bucket; on a group, the float32 gather, the
host copy's refresh and a cast) is counted at 2 and 3 copies per tensor, and a pickled state is seen.
The engine ends with the learner's weights bit for bit in every case.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed.tensor import DTensor
from worker_procs import run_ranks

from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.weight_sync import apply_sync
from tsrl_cli.rl.ranks import OneProcess, Policy
from tsrl_cli.rl.weightbus import Publisher, WeightBus, serve_store

SHAPE = (64, 128)  # every weight: 8,192 elements, far above the header's bytes
LAYERS = 6
TENSOR_BYTES = 64 * 128 * 4  # float32


class Layers(torch.nn.Module):
    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False, dtype=dtype)
                                          for _ in range(LAYERS))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(SHAPE, generator=g))


class Copies:
    """Counts, on every thread while installed, the copies of tensors of at least `min_numel` elements:
    `staging` (anything but the engine's write), `applied` (copy_ into one of `engine`'s parameters), and the
    bytes pickled. A rank's own shard (a DTensor) is cast where it lives: not counted."""

    METHODS = ("to", "cpu", "clone", "contiguous", "pin_memory")

    def __init__(self, engine_params, min_numel=SHAPE[0] * SHAPE[1] // 2):
        self.engine = {p.data_ptr() for p in engine_params}
        self.min_numel = min_numel
        self.staging = self.applied = self.pickled = 0
        self._lock = threading.Lock()
        self._saved = []

    def _big(self, t) -> bool:
        return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.numel() >= self.min_numel

    def _wrap_method(self, name):
        orig = getattr(torch.Tensor, name)

        def wrapped(t, *a, **k):
            out = orig(t, *a, **k)
            if self._big(out) and self._big(t) and out.data_ptr() != t.data_ptr():
                with self._lock:
                    self.staging += 1
            return out
        return orig, wrapped

    def __enter__(self):
        for name in self.METHODS:
            orig, wrapped = self._wrap_method(name)
            self._saved.append((torch.Tensor, name, vars(torch.Tensor).get(name)))
            setattr(torch.Tensor, name, wrapped)
        copy_, cat, dumps = torch.Tensor.copy_, torch.cat, pickle.dumps

        def counted_copy(dst, src, *a, **k):
            if self._big(src):
                with self._lock:
                    if dst.data_ptr() in self.engine:
                        self.applied += 1
                    else:
                        self.staging += 1
            return copy_(dst, src, *a, **k)

        def counted_cat(ts, *a, **k):
            with self._lock:
                self.staging += sum(1 for t in ts if self._big(t))
            return cat(ts, *a, **k)

        def counted_dumps(obj, *a, **k):
            out = dumps(obj, *a, **k)
            with self._lock:
                self.pickled += len(out)
            return out

        self._saved += [(torch.Tensor, "copy_", vars(torch.Tensor).get("copy_")), (torch, "cat", cat),
                        (pickle, "dumps", dumps)]
        torch.Tensor.copy_, torch.cat, pickle.dumps = counted_copy, counted_cat, counted_dumps
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._saved):
            if orig is None:  # inherited (torch.Tensor's methods from its C base): drop the override
                delattr(owner, name)
            else:
                setattr(owner, name, orig)


def bus_pair(bucket_bytes: int):
    """(store, rank 0's bus, rank 1's bus): both members in this process."""
    store = serve_store()
    with ThreadPoolExecutor(2) as ex:
        joins = [ex.submit(WeightBus.join, "127.0.0.1", store.port, r, 2, bucket_bytes=bucket_bytes) for r in (0, 1)]
        return store, joins[0].result(timeout=120), joins[1].result(timeout=120)


def sync_once(bucket_bytes: int, stage):
    """One sync of Layers() into a zeroed engine; stage(policy, publisher) -> the tensors offered.
    Returns (the copies counted, the learner's weights, the engine's)."""
    store, sender, receiver = bus_pair(bucket_bytes)
    learner = Layers()
    policy = Policy(learner, None, None, None, list(learner.parameters()), None)
    engine_model = Layers(seed=1)
    engine = HFEngine(engine_model)
    want = queue.Queue()
    pub = Publisher(sender, want, version=0)
    try:
        with Copies(engine_model.parameters()) as copies:
            state = stage(policy, pub)
            pub.offer(1, state, 0.0)
            want.put((1, 0))
            info = apply_sync(engine, receiver.receive)
    finally:
        want.put(None)
        pub.close(timeout=30)
        del store
    assert info["version"] == 1 and info["bytes"] == LAYERS * TENSOR_BYTES
    return copies, dict(learner.named_parameters()), dict(engine_model.named_parameters())


def exact(learner, engine) -> bool:
    return learner.keys() == engine.keys() and all(torch.equal(learner[n], engine[n]) for n in learner)


BUCKETS_OF_3 = 3 * TENSOR_BYTES


@pytest.mark.parametrize("bucket_bytes,staging", [(BUCKETS_OF_3, LAYERS), (1, 0)], ids=["buckets-of-3", "alone"])
def test_on_policy_sync_copies_each_tensor_at_most_once(bucket_bytes, staging):
    copies, learner, engine = sync_once(bucket_bytes, lambda policy, pub: OneProcess().live_state(policy, False))
    assert exact(learner, engine)
    assert copies.staging == staging  # into its bucket; a tensor alone is its own bucket: no copy
    assert copies.applied == LAYERS and copies.pickled == 0


def test_async_sync_copies_once_into_the_bus_buffers():
    copies, learner, engine = sync_once(BUCKETS_OF_3, lambda policy, pub: OneProcess().live_state(
        policy, True, into=pub.buffers))
    assert exact(learner, engine)
    assert copies.staging == LAYERS and copies.applied == LAYERS and copies.pickled == 0


def test_positive_control_a_host_copy_then_the_bucket_counts_twice_and_pickles_are_seen():
    def host_copy(policy, pub):  # a copy on the host, which the bus then copies into its buckets
        return {n: t.detach().to("cpu", copy=True) for n, t in policy.model.named_parameters()}

    copies, learner, engine = sync_once(BUCKETS_OF_3, host_copy)
    assert exact(learner, engine)
    assert copies.staging == 2 * LAYERS  # over the one-copy limit the tests above hold
    with Copies([]) as seen:
        pickle.dumps(learner)
    assert seen.pickled >= LAYERS * TENSOR_BYTES


class FakeBus:
    def __init__(self):
        self.sent = []

    def send(self, version, tensors, at):
        self.sent.append(version)
        return 0

    def send_nothing(self):
        self.sent.append(None)


def test_the_publisher_lets_go_of_weights_once_sent():
    bus, want = FakeBus(), queue.Queue()
    pub = Publisher(bus, want, version=0)
    sent, kept = torch.zeros(4), torch.zeros(4)
    refs = weakref.ref(sent), weakref.ref(kept)
    pub.offer(1, {"w": sent}, 0.0)
    del sent
    want.put((1, 0))  # the sync: every member takes version 1
    want.put((1, 1))  # a member asks again: nothing newer, without the tensors
    t0 = time.monotonic()
    while len(bus.sent) < 2:
        assert time.monotonic() - t0 < 60, "the publisher did not answer"
        time.sleep(0.01)
    assert bus.sent == [1, None]
    assert refs[0]() is None  # let go once sent, before any newer offer
    pub.offer(2, {"w": kept}, 1.0)  # offered, not yet asked for: held
    del kept
    want.put(None)
    pub.close(timeout=30)
    assert refs[1]() is not None  # the positive control: an offer no sync has taken is held


# ---- a learner group: 2 CPU ranks, float32 masters of a bf16 model ---------------------------------------
WORLD = 2


def _stage_as_before(group, policy):
    """The staging a group's publish is measured against: the float32 masters gathered to the host, the host
    copy refreshed from them, then cast to its dtype (the bus then copies each into its bucket)."""
    full = group.full_trainable_state(policy.model)
    if full is None:
        return None
    host = dict(policy.host.named_parameters())
    with torch.no_grad():
        for n, t in full.items():
            host[n].copy_(t)
    return {n: t.to(host[n].dtype) for n, t in full.items()}


def _group_rank(rank: int, store_path: str, q) -> None:
    try:
        import copy

        import torch.distributed as dist

        from tsrl_cli.rl.group import LearnerGroup
        from tsrl_cli.rl.masters import upcast_for_group
        from tsrl_cli.rl.ranks import ShardedRanks

        torch.set_num_threads(1)
        group = LearnerGroup.join(rank, WORLD, "cpu", store_path)
        model = Layers(torch.bfloat16)
        host = copy.deepcopy(model) if rank == 0 else None
        compute = upcast_for_group(list(model.parameters()), torch.float32)
        group.shard(model, compute_dtype=compute)
        with torch.no_grad():  # masters that a bf16 cast rounds: what the engine gets is their cast
            for p in model.parameters():
                p.add_(1e-4)
        policy = Policy(model, None, host, None, list(model.parameters()), None)
        ranks = ShardedRanks(group)
        expected = {n: p.full_tensor().to(torch.bfloat16) for n, p in model.named_parameters()}
        gathered = [0]
        gather = dist.gather

        def counted_gather(t, gather_list=None, *a, **k):
            gathered[0] += sum(x.numel() * x.element_size() for x in gather_list or [])
            return gather(t, gather_list, *a, **k)

        dist.gather = counted_gather
        results = {}
        for name, stage in (("live_state", None), ("before", _stage_as_before)):
            gathered[0] = 0
            if rank != 0:
                ranks.live_state(policy, False) if stage is None else stage(group, policy)
                continue
            store, sender, receiver = bus_pair(BUCKETS_OF_3 // 2)  # bf16: 3 tensors a bucket
            engine_model = Layers(torch.bfloat16, seed=1)
            engine = HFEngine(engine_model)
            want = queue.Queue()
            pub = Publisher(sender, want, version=0)
            with Copies(engine_model.parameters()) as copies:
                state = ranks.live_state(policy, False, into=pub.buffers) if stage is None else stage(group, policy)
                pub.offer(1, state, 0.0)
                want.put((1, 0))
                apply_sync(engine, receiver.receive)
            want.put(None)
            pub.close(timeout=30)
            got = dict(engine_model.named_parameters())
            results[name] = {"staging": copies.staging, "applied": copies.applied, "pickled": copies.pickled,
                             "gathered": gathered[0], "exact": all(torch.equal(got[n], expected[n]) for n in got)}
            del store
        dist.gather = gather
        q.put(("ok", rank, results))
        group.close()
    except BaseException:  # noqa: BLE001 - the test reports it
        q.put(("error", rank, traceback.format_exc()))


@pytest.mark.slow  # two spawned ranks import torch and tsrl
def test_a_group_gathers_the_engine_dtype_and_copies_each_tensor_once(tmp_path):
    got = run_ranks(_group_rank, lambda r: (r, str(tmp_path / "store")), WORLD, timeout_s=300)
    now, before = got[0]["live_state"], got[0]["before"]
    bf16_bytes = LAYERS * TENSOR_BYTES // 2
    assert now["exact"] and before["exact"]  # the same bf16 weights either way
    assert now["gathered"] == bf16_bytes  # 64 rows over 2 ranks: no padding row
    assert before["gathered"] == 2 * now["gathered"]  # the positive control gathers float32
    assert now["staging"] == LAYERS and now["pickled"] == 0  # each tensor once: into the bus's buffers
    assert before["staging"] == 3 * LAYERS  # the host copy's refresh, the cast, the bucket
    assert now["applied"] == before["applied"] == LAYERS
