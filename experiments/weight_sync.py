"""Weight sync cost on this machine, for one payload.

    python experiments/weight_sync.py bus [--mb 512] [--receivers 1,2] [--repeats 3] [--json]
    python experiments/weight_sync.py group [--mb 512] [--repeats 3] [--no-into] [--json]

bus: the weight bus (gloo broadcast in buckets) against pickling a safetensors blob through a
multiprocessing queue (what a queue-based sync costs). Each receiver copies what it got into its own
parameters (as an engine does), so both paths end with the weights in place. Times are from the
sender's first byte to the last receiver's ack.

group: one publish of a learner group as `tsrl train` runs it: two CPU ranks (gloo) hold float32 masters
of a bfloat16 model of `--mb` MiB (FSDP2 shards, rl/group.py), rank 0 publishes them
(rl/ranks.py ShardedRanks.live_state into the publisher's bus buffers; --no-into: into host tensors)
and one engine process takes the sync into an hf engine (engines/weight_sync.py apply_sync). publish_s
is rank 0's live_state; sync_s runs from its start to the engine's last bucket applied; learner_cpu_s and
engine_cpu_s are the CPU seconds rank 0 (gather, staging, sending) and the engine process spent in that span,
a measure of the work that a loaded machine's waits do not inflate. The engine then checks that it holds the
learner's weights bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time

import torch
from safetensors.torch import load, save

from tsrl_cli.rl.weightbus import WeightBus, serve_store


def payload(mb: int) -> dict[str, torch.Tensor]:
    n = 32  # tensors, as many layers' weights
    per = (mb << 20) // 4 // n
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def bus_receiver(port, rank, world, mb, repeats, done_q):
    bus = WeightBus.join("127.0.0.1", port, rank, world)
    params = {k: torch.empty_like(v) for k, v in payload(1).items()}  # shapes differ: resized on first sync
    for _ in range(repeats):
        def apply(bucket):
            for k, t in bucket.items():
                if params[k].shape != t.shape:
                    params[k] = torch.empty_like(t)
                params[k].copy_(t)
        bus.receive(apply)
        done_q.put(time.perf_counter())


def queue_receiver(q, repeats, done_q):
    params = None
    for _ in range(repeats):
        got = load(q.get())
        if params is None:
            params = {k: torch.empty_like(v) for k, v in got.items()}
        for k, t in got.items():
            params[k].copy_(t)
        done_q.put(time.perf_counter())


def run_bus(mb: int, receivers: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    sd = payload(mb)
    nbytes = sum(t.numel() * 4 for t in sd.values())
    out = {"mb": nbytes / 2**20, "receivers": receivers}
    # the bus
    store = serve_store()
    done = ctx.Queue()
    procs = [ctx.Process(target=bus_receiver, args=(store.port, r + 1, receivers + 1, mb, repeats, done))
             for r in range(receivers)]
    for p in procs:
        p.start()
    bus = WeightBus.join("127.0.0.1", store.port, 0, receivers + 1)
    times = []
    for v in range(repeats):
        t0 = time.perf_counter()
        bus.send(v + 1, sd, t0)
        times.append(max(done.get() for _ in procs) - t0)
    for p in procs:
        p.join()
    out["bus_s"] = statistics.median(times)
    # a blob through a queue per receiver
    qs = [ctx.Queue() for _ in range(receivers)]
    procs = [ctx.Process(target=queue_receiver, args=(q, repeats, done)) for q in qs]
    for p in procs:
        p.start()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        blob = save(sd)
        for q in qs:
            q.put(blob)
        times.append(max(done.get() for _ in procs) - t0)
    for p in procs:
        p.join()
    out["queue_s"] = statistics.median(times)
    out["queue_over_bus"] = out["queue_s"] / out["bus_s"]
    out["bus_gb_per_s"] = nbytes * receivers / out["bus_s"] / 1e9
    return out


# ---- group: a learner group's publish, end to end --------------------------------------------------
WIDTH = 2048  # each layer one WIDTH x WIDTH bfloat16 weight: 8 MiB


class Stack(torch.nn.Module):
    """The shape a learner group shards (policy.decoder_layers): blocks in a `layers` ModuleList."""

    def __init__(self, mb: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.bfloat16)
                                          for _ in range(max(1, mb // 8)))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))


def learner_rank(rank: int, store_path: str, bus_port: int, mb: int, repeats: int, into: bool, out_q, ack_q):
    from tsrl_cli.rl.group import LearnerGroup
    from tsrl_cli.rl.masters import upcast_for_group
    from tsrl_cli.rl.ranks import Policy, ShardedRanks
    from tsrl_cli.rl.weightbus import Publisher

    group = LearnerGroup.join(rank, 2, "cpu", store_path)
    model = Stack(mb)
    host = copy.deepcopy(model) if rank == 0 else None
    compute = upcast_for_group(list(model.parameters()), torch.float32)  # float32 masters, bf16 compute
    group.shard(model, compute_dtype=compute)
    policy = Policy(model, None, host, None, list(model.parameters()), None)
    ranks = ShardedRanks(group)
    pub, want = None, queue.Queue()
    if rank == 0:
        pub = Publisher(WeightBus.join("127.0.0.1", bus_port, 0, 2), want, 0)
    kw = {"into": pub.buffers} if into and pub is not None else {}
    for v in range(1, repeats + 1):
        group.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        state = ranks.live_state(policy, False, **kw)
        t1 = time.perf_counter()
        if rank == 0:
            pub.offer(v, state, t0)
            want.put((v, v - 1))
            ack_q.get()  # the engine applied it: the next publish starts on quiet cores
            out_q.put(("published", v, t0, t1, sum(t.numel() * t.element_size() for t in state.values()),
                       time.process_time() - c0))
        del state
    if rank == 0:
        want.put(None)
        pub.close()
    group.close()


def engine_member(bus_port: int, mb: int, repeats: int, out_q, ack_q):
    from tsrl_cli.engines.hf import HFEngine
    from tsrl_cli.engines.weight_sync import apply_sync

    model = Stack(mb)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    engine = HFEngine(model)
    bus = WeightBus.join("127.0.0.1", bus_port, 1, 2)
    for _ in range(repeats):
        c0 = time.process_time()
        info = apply_sync(engine, bus.receive)
        out_q.put(("applied", info["version"], time.perf_counter(), info["bytes"], time.process_time() - c0))
        ack_q.put(None)
    out_q.put(("exact", all(torch.equal(p, expected[n]) for n, p in model.named_parameters())))


def run_group(mb: int, repeats: int, into: bool) -> dict:
    ctx = mp.get_context("spawn")
    store = serve_store()
    out_q, ack_q = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=learner_rank, args=(r, path, store.port, mb, repeats, into, out_q, ack_q))
                 for r in range(2)]
        procs.append(ctx.Process(target=engine_member, args=(store.port, mb, repeats, out_q, ack_q)))
        for p in procs:
            p.start()
        published, applied, exact = {}, {}, None
        while exact is None:
            msg = out_q.get(timeout=1800)
            if msg[0] == "published":
                published[msg[1]] = msg[2:]
            elif msg[0] == "applied":
                applied[msg[1]] = msg[2:]
            else:
                exact = msg[1]
        for p in procs:
            p.join()
    sync = [applied[v][0] - published[v][0] for v in published]
    pub = [published[v][1] - published[v][0] for v in published]
    med = statistics.median
    return {"mb": sum(p.numel() * 2 for p in Stack(mb).parameters()) / 2**20, "into_bus_buffers": into,
            "publish_s": med(pub), "sync_s": med(sync), "sync_s_all": [round(x, 3) for x in sync],
            "learner_cpu_s": med([published[v][3] for v in published]),
            "engine_cpu_s": med([applied[v][2] for v in applied]),
            "bytes_sent": published[1][2], "bytes_received": applied[1][1], "exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["bus", "group"])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--receivers", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-into", action="store_true", help="group: live_state without the bus's buffers")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.mode == "bus":
        res = [run_bus(a.mb, int(n), a.repeats) for n in a.receivers.split(",")]
    else:
        res = [run_group(a.mb, a.repeats, not a.no_into)]
    print(json.dumps(res) if a.json else "\n".join(json.dumps(r) for r in res))


if __name__ == "__main__":
    main()
