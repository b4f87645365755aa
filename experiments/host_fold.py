"""Speed of a fold into host buffers (loss.buffer_device: cpu, rl/hostfold.py), by thread count.

Torch computes with one thread, as in every tsrl process. A fold is buf += alpha * g over one buffer set: the
buffer read and written (4 + 4 bytes per float32 element) and the staged gradient read (its dtype's bytes). On
the CPU this times the add alone (ParallelAxpy); with --device cuda:N the whole fold as the learner runs it (the
event, the copy to pinned memory on the device's copy stream, the add), from the call to sync().

    .venv/bin/python experiments/host_fold.py                         # 64 Mi floats, threads 1,2
    .venv/bin/python experiments/host_fold.py --threads 1,2,4,8 --device cuda:0 --json

The node projection multiplies out what a round of a node recipe folds per rank: `--params` over
`--ranks` elements per buffer set, `--folds` adds per round (GRPO: two per backward of an open group's
members, S_r and S_1, plus two at each group's close), at the fastest measured rate.

`open` times a buffer set's opening and first fold, one thread: zero-filled then added into (`zeros_s`,
`add_s`), against uninitialised then assigned (`empty_s`, `assign_s`, core.accumulator's BufferSet). The
opening runs on the learner's thread (inside a backward's hook on a group), the first fold on the fold thread.
`new`: memory the process never touched (each page faults at its first write); `reused`: a block written
before, as PyTorch's caching host allocator hands pinned blocks back.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tsrl_cli.core.accumulator import BufferSet
from tsrl_cli.rl.hostfold import HostFold, ParallelAxpy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def measure(n: int, threads: int, grad_dtype: torch.dtype, device: str, repeats: int) -> float:
    """Seconds of one fold of n elements, the fastest of `repeats`."""
    buf = [torch.zeros(n, dtype=torch.float32, pin_memory=device.startswith("cuda"))]
    g = [torch.randn(n, dtype=torch.float32).to(device=device, dtype=grad_dtype)]
    if device.startswith("cuda"):
        host = HostFold(cuda=True, device=device, threads=threads)
        fold, sync = (lambda b, g, alpha: host([(b, alpha)], g)), host.sync
        fold.close = host.close
    else:
        fold, sync = ParallelAxpy(threads), (lambda: None)
    best = float("inf")
    try:
        for _ in range(repeats):
            fresh = [t.clone() for t in g]  # a new gradient each time, as each backward gives
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fold(buf, fresh, 0.5)
            sync()
            best = min(best, time.perf_counter() - t0)
    finally:
        fold.close()
    return best


def open_cost(n: int, grad_dtype: torch.dtype, pin: bool, repeats: int) -> dict:
    """Seconds (the fastest of `repeats`) of opening a set of n float32 elements and of its first fold, each way,
    in new memory and in a reused block."""
    g = [torch.randn(n, dtype=torch.float32).to(grad_dtype)]
    add = ParallelAxpy(1)
    block = torch.ones(n, pin_memory=pin)  # written once: its pages are mapped
    ways = {"new": (lambda: [torch.zeros(n, pin_memory=pin)], lambda: BufferSet([torch.empty(n, pin_memory=pin)])),
            "reused": (lambda: [block.zero_()], lambda: BufferSet([block]))}
    out = {}
    for memory, (zeros, empty) in ways.items():
        best = {"zeros_s": float("inf"), "add_s": float("inf"), "empty_s": float("inf"), "assign_s": float("inf")}
        for _ in range(repeats):
            for fill, first, make in (("zeros_s", "add_s", zeros), ("empty_s", "assign_s", empty)):
                t0 = time.perf_counter()
                buf = make()
                t1 = time.perf_counter()
                add(buf, g, 0.5)
                t2 = time.perf_counter()
                best[fill], best[first] = min(best[fill], t1 - t0), min(best[first], t2 - t1)
                del buf
        out[memory] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 26, help="elements of the buffer set (64 Mi: 256 MB)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--grad-dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu (the add alone) or cuda:N (copy and add)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--params", type=float, default=8.19e9, help="node projection: parameters (Qwen3-8B)")
    ap.add_argument("--ranks", type=int, default=4, help="node projection: learner ranks sharing them")
    ap.add_argument("--folds", type=int, default=2 * 128 + 2 * 16,
                    help="node projection: adds per round and rank (default: grpo_full's 16 groups of 8, per-member)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as in every tsrl process (processes.init_worker): the threads here are the fold's own
    gd = DTYPES[a.grad_dtype]
    per_elem = 8 + torch.empty((), dtype=gd).element_size()
    rows = []
    for t in (int(x) for x in a.threads.split(",")):
        s = measure(a.elements, t, gd, a.device, a.repeats)
        rows.append({"threads": t, "seconds": s, "gb_per_s": a.elements * per_elem / s / 1e9})
    best = max(r["gb_per_s"] for r in rows)
    shard = a.params / a.ranks
    fold_s = shard * per_elem / best / 1e9
    out = {"device": a.device, "elements": a.elements, "grad_dtype": a.grad_dtype, "bytes_per_element": per_elem,
           "torch_threads": torch.get_num_threads(), "rows": rows,
           "speedup_of_most_threads": rows[-1]["gb_per_s"] / rows[0]["gb_per_s"],
           "node": {"params": a.params, "ranks": a.ranks, "elements_per_rank": shard, "fold_s": fold_s,
                    "folds_per_round": a.folds, "fold_s_per_round": fold_s * a.folds},
           "open": open_cost(a.elements, gd, a.device.startswith("cuda"), a.repeats)}
    if a.json:
        print(json.dumps(out))
        return
    for r in rows:
        print(f"threads {r['threads']}: {r['seconds'] * 1e3:.1f} ms per fold of {a.elements:,} elements, "
              f"{r['gb_per_s']:.2f} GB/s")
    n = out["node"]
    print(f"node projection at {best:.2f} GB/s: {shard:.3g} elements per rank, {fold_s:.2f} s per fold, "
          f"{n['fold_s_per_round']:.0f} s of folds per round and rank ({a.folds} folds)")
    for memory, o in out["open"].items():
        print(f"a set's opening and first fold, {memory} memory: zero-filled {o['zeros_s'] * 1e3:.1f} + add "
              f"{o['add_s'] * 1e3:.1f} ms, uninitialised {o['empty_s'] * 1e3:.3f} + assign "
              f"{o['assign_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
