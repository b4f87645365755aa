"""Weight sync cost on this machine: the weight bus (gloo broadcast in buckets) against pickling a
safetensors blob through a multiprocessing queue (what a queue-based sync costs), for one payload.

    python experiments/weight_sync.py [--mb 512] [--receivers 1,2] [--repeats 3] [--json]

Each receiver copies what it got into its own parameters (as an engine does), so both paths end
with the weights in place. Times are from the sender's first byte to the last receiver's ack.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
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


def run(mb: int, receivers: int, repeats: int) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--receivers", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = [run(a.mb, int(n), a.repeats) for n in a.receivers.split(",")]
    print(json.dumps(res) if a.json else "\n".join(json.dumps(r) for r in res))


if __name__ == "__main__":
    main()
