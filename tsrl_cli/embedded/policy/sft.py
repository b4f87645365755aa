"""Supervised warm start of the tiny default policy on loss-masked demonstration sequences.

Each sequence is a demonstration rendered exactly as the agent loop renders a trajectory
(embedded/demos.py: demo_to_trajectory). The loss is the cross-entropy of the mask-1 tokens (the
assistant turns and their <|im_end|>), computed from raw logits with core.losses.token_logprobs,
averaged over the loss tokens of a batch. Batches are padded on the right; sequences of similar
length are batched together (a seeded shuffle, then sorting inside windows of 8 batches), so little
compute goes to padding. Deterministic for a seed on one thread.

Used by the copy curriculum's phase C (copy_curriculum.py) and by the builtin:toy policy (rl/toy.py).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.core.losses import token_logprobs
from tsrl_cli.embedded.policy.demos import demo_to_trajectory


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


def encode_demos(demos: list[dict], tokenizer, max_len: int = 2048) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) per demo, as the agent loop would record it; cut to max_len."""
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


def train_sft(model, seqs: list[tuple[list[int], list[int]]], cfg: SFTConfig = SFTConfig(), *, pad_id: int = 0,
              progress: Callable[[dict], None] | None = None) -> list[dict]:
    """AdamW on the masked NLL; returns the log (one dict per step: step, epoch, loss, tokens, lr, seconds)."""
    rng = random.Random(f"tsrl-sft:{cfg.seed}")
    steps_per_epoch = math.ceil(len(seqs) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
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
            if progress is not None:  # the caller may snapshot the model here (student = an earlier epoch)
                progress({**log[-1], "event": "epoch_end"})
    model.eval()
    return log
