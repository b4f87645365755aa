"""One rank of a 4-rank FSDP2 learner group at Qwen3-8B's shapes, on one GPU, against `tsrl plan`.

Rank 0 of a fake process group of --world ranks (torch.testing._internal.distributed.fake_pg: its collectives
return without communicating), so one GPU holds and computes what one rank of a real group does, through the
plan's own set-up (tsrl_cli/memtrace.py learner_rank): the model built and sharded on the meta device
(LearnerGroup.shard: FSDP2, float32 masters of the bf16 weights, the folding all-to-all), then this rank's shards
allocated on the GPU. Then, with experiments/node8/grpo_full.yaml's learner settings (activation checkpointing,
chunked logits, 1 x 32768 positions, buffers in pinned host memory) and one GRPO group open:
  --passes passes   each a forward and backward whose gradient HostFold folds into the group's pinned S_r and S_1
  the group's close R += s (S_r - (mu - b) S_1) on the host, then R handed to FSDP's sharded p.grad
                    (ShardedGrads.emit) and one AdamW step (foreach) on the float32 masters
Measured, against the plan of the same experiment (plan.learner_processes, loss.max_open_groups 1: 3 sets):
  pass memory       torch.cuda.max_memory_allocated over the passes, against the plan's pass less AdamW's moments
                    (a first round has none yet); the fold backlog the plan adds is an upper bound (the queue may
                    have drained), so the figure must lie within [plan - backlog, plan] widened by --tolerance
  step memory       the same over the hand-over and AdamW's step, against the plan's step (--tolerance)
  pinned memory     the buffer sets the accumulator opened against the plan's request for one rank (equal), and
                    the pinned allocator's held bytes (torch.cuda.host_memory_stats) against the plan's blocks
  fold queue        passes with folds still queued when each pass ended (at most loss.host_fold_pending), and
                    the learner's waits for the queue
  pass time         seconds of each pass (synchronized), and of the close, the hand-over and the step
ShardedGrads keeps one flat template per FSDP unit on the device (the buffers' shapes): reported beside the
figures as templates_bytes, which the plan does not count.

    python experiments/fsdp_rank.py --json                                   # on a GPU: Qwen3-8B, 4 ranks
    .venv/bin/python experiments/fsdp_rank.py --device cpu --tiny --json     # the CPU run: a tiny Qwen3
Prints one JSON document with --json; exit 1 when a memory check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tsrl_cli.config import load_config
from tsrl_cli.core.accumulator import RoundGradAccumulator
from tsrl_cli.core.advantages import group_stats
from tsrl_cli.memtrace import LearnerShape, learner_rank
from tsrl_cli.plan import learner_processes
from tsrl_cli.policy import TORCH_DTYPES, forward_logprobs, model_config, tiny_qwen3_config
from tsrl_cli.rl.batchloss import zero_loss
from tsrl_cli.rl.hostfold import HostFold, auto_threads
from tsrl_cli.rl.masters import master_dtype

EXPERIMENT = "experiments/node8/grpo_full.yaml"


def within(measured: int, low: int, high: int, tolerance: float) -> dict:
    """measured against a plan's [low, high] (equal for a point figure), each end widened by the tolerance."""
    return {"measured_bytes": measured, "plan_low_bytes": low, "plan_bytes": high, "rel_diff": (measured - high) / high,
            "ok": low * (1 - tolerance) <= measured <= high * (1 + tolerance)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", default=EXPERIMENT, help="whose learner settings and policy config")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 (policy.tiny_qwen3_config), 512 positions")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--world", type=int, default=4, help="ranks of the group this is rank 0 of")
    ap.add_argument("--tokens", type=int, default=None, help="positions of the row (default: the experiment's "
                                                              "max_trajectory_tokens; --tiny 512)")
    ap.add_argument("--passes", type=int, default=2, help="members of the open group, one pass each")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("fsdp_rank: --device cuda needs a CUDA GPU (none here); --device cpu --tiny is the CPU run",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # as in every tsrl process: the host fold's threads are its own
    keys = [f"devices.learner=0-{a.world - 1}", "loss.max_open_groups=1", "loss.buffer_device=cpu"]
    if a.tiny:
        folder = Path(tempfile.mkdtemp(prefix="tsrl-fsdp-rank-"))
        tiny_qwen3_config(vocab_size=4096, hidden=128, layers=4, max_positions=2048).to_json_file(
            str(folder / "config.json"))
        keys += [f"model.policy_config={folder}", "learner.logits_chunk_tokens=128"]
    tokens = a.tokens or (512 if a.tiny else None)
    if tokens:
        keys += [f"rollout.max_trajectory_tokens={tokens}", f"learner.max_microbatch_tokens={tokens}"]
    cfg = load_config(a.experiment, keys)
    config = model_config(cfg.model.policy_config)
    t0 = time.perf_counter()
    procs, host_plan = learner_processes(cfg, config)  # the plan's learner ranks: one fake-tensor trace
    plan_s = time.perf_counter() - t0
    plan, counts = procs[0].parts, procs[0].counts
    dtype = TORCH_DTYPES[cfg.model.dtype]
    shape = LearnerShape(rows=counts["microbatch_rows"], width=counts["microbatch_width"], dtype=dtype, world=a.world,
                         lora=cfg.lora, checkpointing=cfg.learner.activation_checkpointing,
                         chunk_tokens=cfg.learner.logits_chunk_tokens, master_dtype=master_dtype(cfg))
    device = "cuda:0" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out: dict = {"experiment": a.experiment, "config": "tiny" if a.tiny else str(cfg.model.policy_config),
                 "device": a.device, "gpu": torch.cuda.get_device_name(0) if cuda else None, "world": a.world,
                 "rows": shape.rows, "tokens": shape.width, "dtype": cfg.model.dtype,
                 "masters": str(shape.master_dtype).removeprefix("torch."), "chunk_tokens": shape.chunk_tokens,
                 "checkpointing": shape.checkpointing, "passes": a.passes, "plan_trace_s": plan_s}
    t0 = time.perf_counter()
    with learner_rank(config, shape, fake=False, device=device) as (model, grads, templates):
        sync()
        out["setup_s"] = time.perf_counter() - t0
        out["templates_bytes"] = sum(t.numel() * t.element_size() for t in templates)
        fold = HostFold(cuda=cuda, threaded=True, device=device if cuda else None, threads=auto_threads(1, cuda),
                        pending=cfg.loss.host_fold_pending, pass_of=lambda: grads.passes)
        acc = RoundGradAccumulator(templates, device="cpu", fold=fold, sync=fold.sync)
        vocab = model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(0)
        rewards = [float(i % 2) for i in range(a.passes)]  # a group with two reward values: S_r is not zero
        out["pass_s"], out["queued_passes"] = [], []
        for r in rewards:
            ids = torch.randint(0, vocab, (shape.rows, shape.width), generator=gen).to(device)
            sync()
            t0 = time.perf_counter()
            logp, _ = forward_logprobs(model, ids, chunk_tokens=shape.chunk_tokens)
            grads.backward([-logp.sum()], [[("member", r)] + [None] * (a.world - 1)],
                           lambda target, gs: acc.add_member("group", target[1], gs))
            sync()
            out["pass_s"].append(time.perf_counter() - t0)
            out["queued_passes"].append(len(fold._queued))  # passes whose folds the host thread has not finished
            del logp, ids
        pass_peak = torch.cuda.max_memory_allocated() if cuda else None
        t0 = time.perf_counter()
        acc.close_group("group", group_stats(torch.tensor(rewards)))
        sets_opened = acc.peak_open_bytes + acc.param_bytes  # the group's S_r and S_1, and R
        r_buf = acc.finalize(1.0 / (shape.rows * shape.width))
        out["close_s"] = time.perf_counter() - t0
        out["fold_waits"], out["fold_wait_s"] = fold.waits, fold.wait_s
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        grads.emit(r_buf, lambda: zero_loss(model))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, foreach=cuda)
        opt.step()
        sync()
        out["step_s"] = time.perf_counter() - t0
        step_peak = torch.cuda.max_memory_allocated() if cuda else None
        stats = getattr(torch.cuda, "host_memory_stats", None)  # the pinned allocator's counters (recent torch)
        held = stats().get("allocated_bytes.peak") if cuda and stats is not None else None
        fold.close()
    world = a.world
    pinned_asked = host_plan["learner_pinned_buffers"] // world
    out["pinned_buffers"] = {"measured_bytes": sets_opened, "plan_bytes": pinned_asked,
                             "ok": sets_opened == pinned_asked}
    checks = [out["pinned_buffers"]["ok"]]
    if cuda:
        plan_pass = plan["pass"] - plan["optimizer_moments"]  # a first round: no moments during its passes
        out["pass_memory"] = within(pass_peak, plan_pass - plan["fold_backlog"], plan_pass, a.tolerance)
        out["step_memory"] = within(step_peak, plan["step"], plan["step"], a.tolerance)
        plan_held = sum(host_plan[k] for k in ("learner_pinned_buffers", "learner_fold_staging", "pinned_rounding"))
        out["pinned_held"] = None if held is None else within(held, plan_held // world, plan_held // world,
                                                              a.tolerance)
        checks += [out["pass_memory"]["ok"], out["step_memory"]["ok"]]
        checks += [] if out["pinned_held"] is None else [out["pinned_held"]["ok"]]
    out["ok"] = all(checks)
    if a.json:
        print(json.dumps(out))
    else:
        for k in ("pass_memory", "step_memory", "pinned_held", "pinned_buffers"):
            if out.get(k):
                print(f"{k:15s} measured {out[k]['measured_bytes'] / 2**30:.2f} GiB, plan "
                      f"{out[k]['plan_bytes'] / 2**30:.2f} GiB")
        print(f"templates {out['templates_bytes'] / 2**30:.2f} GiB (not in the plan); passes "
              f"{', '.join(f'{s:.1f}' for s in out['pass_s'])} s; queued passes {out['queued_passes']}; "
              f"close {out['close_s']:.1f} s, hand-over and step {out['step_s']:.1f} s")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
