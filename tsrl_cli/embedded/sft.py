"""Supervised warm start of the tiny default policy on loss-masked demonstration sequences.

Each sequence is a demonstration rendered exactly as the agent loop renders a trajectory
(embedded/demos.py: demo_to_trajectory). The loss is the cross-entropy of the mask-1 tokens (the
assistant turns and their <|im_end|>), computed from raw logits with core.losses.token_logprobs,
averaged over the loss tokens of a batch. Batches are padded on the right; sequences of similar
length are batched together (a seeded shuffle, then sorting inside windows of 8 batches), so little
compute goes to padding. Deterministic for a seed on one thread.

`probe_policy` samples a model through the real agent loop (hf engine, TurnBatcher, run_agent, real
sandboxes and verifiers) and reports success rate, per-group reward variance, turns, tokens and time.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tsrl_cli.core.losses import token_logprobs


@dataclass(frozen=True)
class SFTConfig:
    hidden: int = 256
    layers: int = 4
    max_positions: int = 4096  # >= AgentLimits.max_trajectory_tokens plus one turn
    epochs: int = 3
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_len: int = 2048  # longer sequences are cut (their tail is dropped)
    seed: int = 0


def policy_config(vocab_size: int, hidden: int = 256, layers: int = 4, max_positions: int = 4096):
    """tsrl_cli.models.tiny_qwen3_config at policy size, with room for a whole trajectory."""
    from tsrl_cli.models import tiny_qwen3_config

    return tiny_qwen3_config(vocab_size=vocab_size, hidden=hidden, layers=layers, max_positions=max_positions)


def build_policy_model(vocab_size: int, hidden: int = 256, layers: int = 4, max_positions: int = 4096,
                       seed: int = 0, pad_id: int | None = None, eos_id: int | None = None):
    from transformers import Qwen3ForCausalLM

    cfg = policy_config(vocab_size, hidden, layers, max_positions)
    cfg.pad_token_id, cfg.eos_token_id = pad_id, eos_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    return model


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def encode_demos(demos: list[dict], tokenizer, max_len: int = 2048) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) per demo, as the agent loop would record it; cut to max_len."""
    from tsrl_cli.agent.renderer import ChatMLRenderer
    from tsrl_cli.embedded.demos import demo_to_trajectory

    r = ChatMLRenderer(tokenizer)
    out = []
    for d in demos:
        t = demo_to_trajectory(d, r)
        out.append((t.input_ids[:max_len], t.loss_mask[:max_len]))
    return out


def make_batches(seqs: list[tuple[list[int], list[int]]], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Indices per batch: shuffled, then sorted by length inside windows of 8 batches (less padding)."""
    idx = list(range(len(seqs)))
    rng.shuffle(idx)
    win = batch_size * 8
    batches = []
    for w in range(0, len(idx), win):
        chunk = sorted(idx[w:w + win], key=lambda i: len(seqs[i][0]))
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(seqs, batch: list[int], pad_id: int):
    T = max(len(seqs[i][0]) for i in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.float32)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    for r, i in enumerate(batch):
        x, m = seqs[i]
        ids[r, :len(x)] = torch.tensor(x)
        mask[r, :len(m)] = torch.tensor(m, dtype=torch.float32)
        attn[r, :len(x)] = 1
    return ids, attn, mask


def masked_nll(model, ids, attn, mask) -> tuple[torch.Tensor, float]:
    """Mean negative log-likelihood over mask-1 tokens, and their count."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    lp = token_logprobs(logits, ids)
    n = mask.sum()
    return -(lp * mask).sum() / n.clamp(min=1), float(n)


@torch.no_grad()
def evaluate_nll(model, seqs, pad_id: int, batch_size: int = 8) -> float:
    model.eval()
    tot, n = 0.0, 0.0
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    for k in range(0, len(order), batch_size):
        loss, cnt = masked_nll(model, *collate(seqs, order[k:k + batch_size], pad_id))
        tot, n = tot + float(loss) * cnt, n + cnt
    return tot / max(n, 1.0)


def train_sft(model, seqs: list[tuple[list[int], list[int]]], cfg: SFTConfig = SFTConfig(), *, pad_id: int = 0,
              progress: Callable[[dict], None] | None = None, eval_seqs=None) -> list[dict]:
    """AdamW on the masked NLL; returns the log (one dict per step: step, epoch, loss, tokens, lr, seconds)."""
    rng = random.Random(f"tsrl-sft:{cfg.seed}")
    steps_per_epoch = math.ceil(len(seqs) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    log, step, t0 = [], 0, time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for epoch in range(cfg.epochs):
            model.train()
            for batch in make_batches(seqs, cfg.batch_size, rng):
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                loss, n = masked_nll(model, *collate(seqs, batch, pad_id))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                rec = {"step": step, "epoch": epoch, "loss": float(loss.detach()), "tokens": int(n),
                       "lr": lr_at(step), "seconds": round(time.perf_counter() - t0, 2)}
                step += 1
                log.append(rec)
                if progress is not None:
                    progress(rec)
            if eval_seqs is not None:
                log[-1]["eval_nll"] = evaluate_nll(model, eval_seqs, pad_id)
            if progress is not None:  # the caller may snapshot the model here (student = an earlier epoch)
                progress({**log[-1], "event": "epoch_end"})
    model.eval()
    return log


def save_policy(model, tokenizer, out_dir: str | Path, log: list[dict] | None = None, extra: dict | None = None):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if log is not None or extra is not None:
        (out / "sft_log.json").write_text(json.dumps({"log": log or [], **(extra or {})}, indent=1))
    return out


def load_policy(model_dir: str | Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    return model, tok


def sft_from_demos(demos: list[dict], tokenizer, cfg: SFTConfig = SFTConfig(), out_dir=None,
                   progress=None, eval_demos=None):
    """Build the model for the tokenizer, train it on the demos, save it (model + tokenizer) when out_dir."""
    seqs = encode_demos(demos, tokenizer, cfg.max_len)
    pad = tokenizer.pad_token_id
    model = build_policy_model(len(tokenizer), cfg.hidden, cfg.layers, cfg.max_positions, cfg.seed, pad_id=pad,
                               eos_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    ev = encode_demos(eval_demos, tokenizer, cfg.max_len) if eval_demos else None
    log = train_sft(model, seqs, cfg, pad_id=pad, progress=progress, eval_seqs=ev)
    if out_dir is not None:
        save_policy(model, tokenizer, out_dir, log, {"config": asdict(cfg), "params": num_params(model),
                                                     "sequences": len(seqs)})
    return model, log


# -- the probe ----------------------------------------------------------------------------------------------

def probe_policy(model, tokenizer, tasks: list[tuple[Path, object]], *, samples: int = 4, temperature: float = 1.0,
                 seed: int = 0, limits=None, concurrency: int = 16, max_batch: int = 16,
                 progress: Callable[[int, int], None] | None = None, executor: str = "local",
                 prior: list[dict] | None = None, on_result: Callable[[dict], None] | None = None) -> dict:
    """Sample each task `samples` times through run_agent; success rate, group variance, turns, tokens, time.

    `prior`: records of an earlier, interrupted probe (ProbeRecords.load); a (task_id, sample) found there is
    not sampled again. Requests are seeded per (task, sample), so a resumed probe samples the same tokens as an
    uninterrupted one. `on_result(record)` is called as each trajectory finishes (to append it to a file)."""
    from tsrl_cli.agent.loop import AgentLimits, run_agent
    from tsrl_cli.agent.renderer import ChatMLRenderer
    from tsrl_cli.engines.base import SamplingParams, TurnBatcher
    from tsrl_cli.engines.hf import HFEngine
    from tsrl_cli.envs.tasks import make_env

    limits = limits or AgentLimits()
    renderer = ChatMLRenderer(tokenizer)
    engine = HFEngine(model.eval(), pad_id=tokenizer.pad_token_id)
    batcher = TurnBatcher(engine, max_batch=max_batch)
    sampling = SamplingParams(temperature=temperature, seed=seed)
    have = {(r["task_id"], r["sample"]): r for r in prior or []}
    jobs = [(d, t, k) for d, t in tasks for k in range(samples)]
    results: list[dict | None] = [have.get((t.task_id, k)) for _, t, k in jobs]
    done = resumed = sum(r is not None for r in results)  # `resumed`: read from `prior`, not sampled

    async def one(j, d, t, k, sem):
        nonlocal done
        async with sem:
            env = make_env(t, d, executor=executor)
            t0 = time.perf_counter()
            await env.start()
            try:
                res = await run_agent(env, batcher.generate, renderer, group_id=t.task_id, sample_index=k,
                                      sampling=sampling, limits=limits, seed_key=("probe", t.task_id, k))
            finally:
                await env.close()
            tool_s = sum(e["duration_s"] for e in res.events if e["event"] == "tool")
            results[j] = {"task_id": t.task_id, "kind": t.kind, "sample": k, "reward": res.rollout.reward,
                          "turns": res.num_turns, "tokens": len(res.rollout.input_ids),
                          "loss_tokens": sum(res.rollout.loss_mask), "exit_reason": res.exit_reason,
                          "tool_s": tool_s, "seconds": time.perf_counter() - t0,
                          "text": tokenizer.decode(res.rollout.input_ids)}
        if on_result is not None:  # without the decoded text: 3,200 of them would be tens of MB
            on_result({k: v for k, v in results[j].items() if k != "text"})
        done += 1
        if progress is not None:
            progress(done, len(jobs))

    async def main():
        sem = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(one(j, *job, sem) for j, job in enumerate(jobs) if results[j] is None))

    if progress is not None and done:
        progress(done, len(jobs))
    t0 = time.perf_counter()
    try:
        asyncio.run(main())
    finally:
        batcher.close()
    wall = time.perf_counter() - t0
    out = summarize_probe(results, wall)
    out["resumed_trajectories"] = resumed
    return out


class ProbeRecords:
    """A probe's per-trajectory records as JSON lines, appended as each trajectory ends, so that an interrupted
    probe (Ctrl-C, a lost machine: the full embedded probe is hours on 2 cores) resumes where it stopped.

    Line 1 is a header naming what was probed (model weights' sha256, samples, temperature, seed, limits);
    resuming with a different header is an error. A torn last line (killed mid-write) is dropped: the file is
    rewritten without it through a temp file and a rename before anything is appended."""

    VERSION = 1

    def __init__(self, path: str | Path, header: dict):
        self.path, self.header = Path(path), {"tsrl_probe_records": self.VERSION, **header}
        self.prior: list[dict] = []
        self.dropped = 0
        self._fh = None

    def load(self) -> list[dict]:
        """Read the records already there (none for a new file); raise ValueError on a different header."""
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        rows = []
        for n, line in enumerate(lines, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if n < len(lines):
                    raise ValueError(f"{self.path}:{n}: not a JSON line; move the file away to start afresh") from None
                self.dropped = 1  # a torn last line
        if rows and rows[0] != self.header:  # checked first: another probe's file is left as it is
            head = rows[0]
            diff = sorted(k for k in set(head) | set(self.header) if head.get(k) != self.header.get(k))
            raise ValueError(f"{self.path}: records of a different probe ({', '.join(diff)} differ); "
                             "pass another --records file or delete this one")
        if self.dropped:  # rewrite without the torn line before anything is appended after it
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(self.path)
        self.prior = rows[1:]
        return self.prior

    def append(self, record: dict) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            self._fh = self.path.open("a")
            if fresh:
                self._fh.write(json.dumps(self.header) + "\n")
        self._fh.write(json.dumps(record, default=str) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def policy_weights_sha256(model_dir: str | Path) -> str:
    """sha256 over a policy directory's config.json and weight files (names and their sha256), to tell probes apart."""
    import hashlib

    from tsrl_cli.datasets.records import file_sha256

    d = Path(model_dir)
    files = [d / "config.json", *sorted(d.glob("*.safetensors")), *sorted(d.glob("*.bin"))]
    return hashlib.sha256("".join(f"{f.name} {file_sha256(f)}\n" for f in files if f.is_file()).encode()).hexdigest()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize_probe(results: list[dict], wall_s: float) -> dict:
    groups: dict[str, list[float]] = {}
    for r in results:
        groups.setdefault(r["task_id"], []).append(r["reward"])
    var = {g: statistics.pvariance(v) if len(v) > 1 else 0.0 for g, v in groups.items()}

    def part(rs):
        if not rs:
            return {}
        gs = {r["task_id"] for r in rs}
        return {"trajectories": len(rs), "success_rate": round(sum(r["reward"] for r in rs) / len(rs), 4),
                "groups": len(gs), "groups_nonzero_var": sum(var[g] > 0 for g in gs),
                "groups_any_success": sum(max(groups[g]) > 0 for g in gs),
                "mean_turns": round(statistics.mean(r["turns"] for r in rs), 2),
                "mean_tokens": round(statistics.mean(r["tokens"] for r in rs), 1),
                "mean_tool_s": round(statistics.mean(r["tool_s"] for r in rs), 3),
                "exit_reasons": {k: sum(r["exit_reason"].split(":")[0] == k for r in rs)
                                 for k in sorted({r["exit_reason"].split(":")[0] for r in rs})}}

    secs = [r["seconds"] for r in results]
    return {"all": part(results), "repair": part([r for r in results if r["kind"] == "repair"]),
            "terminal": part([r for r in results if r["kind"] == "terminal"]),
            "mean_group_variance": round(statistics.mean(var.values()), 4) if var else 0.0,
            "duration_s": {"p10": round(_pct(secs, 0.1), 2), "p50": round(_pct(secs, 0.5), 2),
                           "p90": round(_pct(secs, 0.9), 2), "max": round(max(secs), 2) if secs else 0.0},
            "wall_s": round(wall_s, 1), "results": results}
