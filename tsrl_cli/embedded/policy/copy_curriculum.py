"""Copy curriculum: teach a tiny policy to copy names out of its instruction before it learns tasks.

Why: a policy fine-tuned only on demonstrations recalls its training instances and never copies an
unseen name (`plum.sh` -> `chmod +x pony.sh`; held-out terminal 0 %, results/LOG.md, 2026-11-30).
With the word-stable tokenizer (a word has the same tokens in any context) and three phases on one
AdamW state, a 2-layer model copies held-out names (results/LOG.md, 2026-12-01):

  A  drill    `x <|im_start|> x` on random letter tokens, loss on the second x only (induction)
  B  family   first moves of the training terminal families, every name drawn as 1-3 random letter
              tokens so only copying predicts it; every `family_drill_every`-th step a drill batch
  C  SFT      demonstrations (full trajectories, loss on assistant turns), after every
              `mix_every` demo batches one family or drill batch (alternating) so copying is kept;
              cosine lr over `schedule_epochs`, stopped after any epoch

Phase C can start several times from one phase-B state (`CopyTrainer.fork`): the default student and
teacher are two such branches. Deterministic for a seed on one thread (python RNGs drive every
batch; the model has no dropout). recipes/embedded_policy/copy_policy.py runs the same code with probes.
"""

from __future__ import annotations

import copy
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tsrl_cli.embedded import terminal_suite as ts
from tsrl_cli.embedded.policy.sft import collate, encode_demos, masked_nll


@dataclass(frozen=True)
class CopyCurriculum:
    drill_steps: int = 2000  # phase A (about 0.11 s per step, 2 layers h256, one idle core)
    family_steps: int = 500  # phase B
    lr: float = 5e-4  # phases A and B (1e-3 failed to learn the drill in the pilots)
    warmup_steps: int = 50
    drill_batch: int = 32
    family_batch: int = 16
    family_drill_every: int = 4
    sft_lr: float = 5e-4  # phase C peak, cosine down to a tenth
    sft_batch: int = 8
    schedule_epochs: int = 6  # phase C's cosine length (a branch may stop earlier)
    mix_every: int = 3
    repair_repeat: int = 1  # each repair demonstration this many times per phase-C epoch (policy_build)


def letter_tokens(tokenizer) -> tuple[list[str], list[int]]:
    """The tokenizer's all-lowercase-letter tokens (sorted) and their ids: the names' alphabet."""
    alpha = sorted(t for t in tokenizer.get_vocab() if re.fullmatch("[a-z]+", t))
    return alpha, [tokenizer.convert_tokens_to_ids(t) for t in alpha]


def drill_ids(rng: random.Random, alpha_ids: list[int], sep: int, batch: int) -> tuple[torch.Tensor, int]:
    """A drill batch [batch, 2n+1] = x, sep, x with n in [6, 16]; returns (ids, n). Targets: ids[:, n+1:]."""
    n = rng.randint(6, 16)
    x = torch.tensor([[rng.choice(alpha_ids) for _ in range(n)] for _ in range(batch)])
    return torch.cat([x, torch.full((batch, 1), sep), x], 1), n


def drill_logits(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Logits [batch, n, vocab] at the positions that predict the copy."""
    return model(input_ids=ids, use_cache=False).logits[:, n:-1]


def random_name(rng: random.Random, alpha: list[str]) -> str:
    """1-3 letter tokens, 3-12 characters: a name only copying can predict."""
    while True:
        w = "".join(rng.choice(alpha) for _ in range(rng.randint(1, 3)))
        if 3 <= len(w) <= 12:
            return w


def first_move(rng: random.Random, words: list[str], exts: list[str], families: list[str]) -> tuple[dict, object]:
    """A one-turn demonstration (instruction -> the reference's first command) and its task spec."""
    spec = ts.FAMILIES[rng.choice(families)](rng, words, exts)
    return {"task_id": "drill", "kind": "terminal", "instruction": spec.instruction,
            "messages": [{"role": "assistant",
                          "content": "THOUGHT: This does what the task asks.\n```bash\n"
                                     f"{spec.solution[0]}\n```"}]}, spec


def family_demos(rng: random.Random, alpha: list[str], batch: int) -> list[dict]:
    """`batch` first moves of the training families, each with its own random names and extensions."""
    out = []
    for _ in range(batch):
        words = sorted({random_name(rng, alpha) for _ in range(40)})
        exts = sorted({random_name(rng, alpha)[:4] for _ in range(6)})
        out.append(first_move(rng, words, exts, ts.SPLIT_FAMILIES["train"])[0])
    return out


class CopyTrainer:
    """One model, its AdamW state and the batch RNG, through phases A-C. Steps clip the grad norm at 1."""

    def __init__(self, model, tokenizer, cfg: CopyCurriculum = CopyCurriculum(), seed: int = 0):
        self.model, self.tok, self.cfg, self.seed = model, tokenizer, cfg, seed
        self.alpha, self.alpha_ids = letter_tokens(tokenizer)
        self.sep = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.rng = random.Random(f"copy-policy:{seed}")  # drill and family batches, in every phase

    def drill_loss(self) -> torch.Tensor:
        ids, n = drill_ids(self.rng, self.alpha_ids, self.sep, self.cfg.drill_batch)
        logits = drill_logits(self.model, ids, n)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, n + 1:].reshape(-1))

    def family_loss(self) -> torch.Tensor:
        batch = family_demos(self.rng, self.alpha, self.cfg.family_batch)
        return masked_nll(self.model, *collate(encode_demos(batch, self.tok), list(range(len(batch))),
                                               self.tok.pad_token_id))[0]

    def step(self, loss: torch.Tensor, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def pretrain(self, log: Callable[[dict], None] = lambda r: None) -> None:
        """Phases A and B."""
        c = self.cfg
        for s in range(c.drill_steps):
            self.step(loss := self.drill_loss(), c.lr * min(1.0, (s + 1) / c.warmup_steps))
            if s % 250 == 0:
                log({"phase": "drill", "step": s, "of": c.drill_steps, "loss": round(loss.item(), 3)})
        for s in range(c.family_steps):
            drill = s % c.family_drill_every == c.family_drill_every - 1
            self.step(loss := (self.drill_loss() if drill else self.family_loss()), c.lr)
            if s % 100 == 0:
                log({"phase": "family", "step": s, "of": c.family_steps, "loss": round(loss.item(), 3)})

    def state(self) -> dict:
        """Everything phase C continues from (model, optimizer, batch RNG): torch.save-able."""
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "rng": self.rng.getstate()}

    def load_state(self, st: dict) -> None:
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.rng.setstate(st["rng"])

    def fork(self) -> CopyTrainer:
        """An independent copy (model, optimizer state, RNG): a second phase C from the same point."""
        return copy.deepcopy(self, {id(self.tok): self.tok})  # the tokenizer is shared, never trained

    def sft(self, demos: list[dict], epochs: int, on_epoch: Callable[[int], None] = lambda e: None,
            log: Callable[[dict], None] = lambda r: None, max_len: int = 2048) -> None:
        """Phase C for `epochs` epochs (<= schedule_epochs) of the cosine schedule; on_epoch(e) after each."""
        c = self.cfg
        seqs = encode_demos(demos, self.tok, max_len)
        srng = random.Random(f"copy-policy-sft:{self.seed}")
        per_epoch = math.ceil(len(seqs) / c.sft_batch)
        total = per_epoch * c.schedule_epochs
        k = 0  # demo batches so far
        for e in range(1, epochs + 1):
            order = list(range(len(seqs)))
            srng.shuffle(order)
            for b in range(per_epoch):
                lr = c.sft_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / total)))
                loss = masked_nll(self.model, *collate(seqs, order[b * c.sft_batch:(b + 1) * c.sft_batch],
                                                       self.tok.pad_token_id))[0]
                self.step(loss, lr)
                k += 1
                if k % c.mix_every == 0:  # keep the copying alive
                    self.step(self.family_loss() if (k // c.mix_every) % 2 else self.drill_loss(), lr)
                if k % 50 == 0:
                    log({"phase": "sft", "epoch": e, "step": k, "of": per_epoch * epochs,
                         "loss": round(loss.item(), 3)})
            on_epoch(e)
