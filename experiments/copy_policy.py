"""Candidate embedded policy that copies names: induction drill, family first moves, then demo SFT.

Issue 4 item 6 needs a policy with a held-out base above 0 %. The shipped student recalls its
training instances and never copies an unseen name (results/LOG.md, sessions 4-5). The pilots of
`experiments/copy_drill.py` showed that a model with the word-stable tokenizer learns copying from
a drill at lr 5e-4, and then writes exact first commands for held-out words. This script carries
that into a whole policy, in three phases on one AdamW state:

  A  drill    x <|im_start|> x on random letter tokens (loss on the copy only)
  B  family   first moves of the training terminal families with random-token names, a drill
              batch every 4th step
  C  SFT      the shipped demonstrations (`data/embedded_policy/demos.jsonl`, full trajectories),
              with a family batch and a drill batch mixed in (cycle: 3 demo batches, 1 family,
              3 demo, 1 drill), so the copying is not forgotten

After each phase-C epoch it saves the model (fp32) under --out/epoch{e} and probes the held-out
terminal split greedily (one sample) and the training terminal split at T=1 on a fixed sample,
through the real agent loop and sandbox (`probe_policy`). Not part of `tsrl prepare-data embedded`.

  .venv/bin/python experiments/copy_policy.py --out /tmp/copy-policy --stop-after 2 --export data/copy_policy

(what made data/copy_policy/ for experiments/heldout/: student = epoch 1, teacher = epoch 2 of the
default 6-epoch schedule; about 25 min on 2 shared cores, results/LOG.md 2026-12-01)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import time
from pathlib import Path

import torch


def main() -> None:
    from tsrl_cli.agent.loop import SYSTEM_PROMPT  # noqa: F401  (the demos were rendered with it)
    from tsrl_cli.embedded import terminal_suite as ts
    from tsrl_cli.embedded.demos import dataset_tasks, train_policy_tokenizer
    from tsrl_cli.embedded.sft import build_policy_model, collate, encode_demos, masked_nll, probe_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", default="data/embedded_policy/demos.jsonl")
    ap.add_argument("--data", default="data", help="folder holding the prepared embedded splits")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--drill-steps", type=int, default=2000)
    ap.add_argument("--family-steps", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=6, help="phase C epochs over the demonstrations (sets the lr schedule)")
    ap.add_argument("--stop-after", type=int, default=None, help="end after this many epochs (schedule kept)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--sft-lr", type=float, default=5e-4, help="phase C peak lr (cosine down to a tenth)")
    ap.add_argument("--probe-train", type=int, default=20, help="training terminal tasks probed at T=1, x4")
    ap.add_argument("--demo-limit", type=int, default=None, help="use only the first N demonstrations (smoke runs)")
    ap.add_argument("--probe-heldout", type=int, default=None, help="held-out terminal tasks probed (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--export", default=None, help="copy the chosen epochs here as student/ and teacher/")
    ap.add_argument("--student-epoch", type=int, default=1)
    ap.add_argument("--teacher-epoch", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    demos = [json.loads(x) for x in Path(a.demos).read_text().splitlines()][:a.demo_limit]
    tok = train_policy_tokenizer(demos, 2048, word_stable=True)
    V, sep = len(tok), tok.convert_tokens_to_ids("<|im_start|>")
    alpha = sorted(t for t in tok.get_vocab() if re.fullmatch("[a-z]+", t))
    alpha_ids = [tok.convert_tokens_to_ids(t) for t in alpha]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model = build_policy_model(V, a.hidden, a.layers, 4096, a.seed, pad_id=tok.pad_token_id, eos_id=im_end)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = random.Random(f"copy-policy:{a.seed}")
    pad = tok.pad_token_id

    def drill_loss(bs: int = 32):
        n = rng.randint(6, 16)
        x = torch.tensor([[rng.choice(alpha_ids) for _ in range(n)] for _ in range(bs)])
        logits = model(input_ids=torch.cat([x, torch.full((bs, 1), sep), x], 1), use_cache=False).logits[:, n:-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), x.reshape(-1))

    def name(g: random.Random) -> str:
        while True:
            w = "".join(g.choice(alpha) for _ in range(g.randint(1, 3)))
            if 3 <= len(w) <= 12:
                return w

    def family_loss(bs: int = 16):
        batch = []
        for _ in range(bs):
            words = sorted({name(rng) for _ in range(40)})
            exts = sorted({name(rng)[:4] for _ in range(6)})
            spec = ts.FAMILIES[rng.choice(ts.SPLIT_FAMILIES["train"])](rng, words, exts)
            batch.append({"task_id": "drill", "kind": "terminal", "instruction": spec.instruction,
                          "messages": [{"role": "assistant", "content":
                                        f"THOUGHT: This does what the task asks.\n```bash\n{spec.solution[0]}\n```"}]})
        return masked_nll(model, *collate(encode_demos(batch, tok), list(range(bs)), pad))[0]

    def step(loss, lr) -> None:
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def log(rec: dict) -> None:
        rec["s"] = round(time.perf_counter() - t0)
        print(json.dumps(rec), flush=True)
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    t0 = time.perf_counter()
    for s in range(a.drill_steps):
        step(loss := drill_loss(), a.lr * min(1.0, (s + 1) / 50))
        if s % 250 == 0:
            log({"phase": "drill", "step": s, "loss": round(loss.item(), 3)})
    for s in range(a.family_steps):
        step(loss := (drill_loss() if s % 4 == 3 else family_loss()), a.lr)
        if s % 100 == 0:
            log({"phase": "family", "step": s, "loss": round(loss.item(), 3)})

    seqs = encode_demos(demos, tok)
    srng = random.Random(f"copy-policy-sft:{a.seed}")
    per_epoch = math.ceil(len(seqs) / 8)
    total = per_epoch * a.epochs
    k = 0  # demo batches so far
    for e in range(1, a.epochs + 1):
        order = list(range(len(seqs)))
        srng.shuffle(order)
        for b in range(per_epoch):
            lr = a.sft_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / total)))
            loss = masked_nll(model, *collate(seqs, order[b * 8:(b + 1) * 8], pad))[0]
            step(loss, lr)
            k += 1
            if k % 3 == 0:  # keep the copying alive
                step(family_loss() if (k // 3) % 2 else drill_loss(), lr)
            if k % 50 == 0:
                log({"phase": "sft", "epoch": e, "step": k, "loss": round(loss.item(), 3)})
        model.eval()
        if e == 1:  # read here, not at the start: the splits may still be being prepared
            heldout = dataset_tasks(Path(a.data) / "embedded_terminal_heldout", a.probe_heldout)
            train_t = dataset_tasks(Path(a.data) / "embedded_terminal_train")
            train_t = random.Random(0).sample(train_t, min(a.probe_train, len(train_t)))
        model.save_pretrained(out / f"epoch{e}")
        tok.save_pretrained(out / f"epoch{e}")
        g = probe_policy(model, tok, heldout, samples=1, temperature=0.0)
        t = probe_policy(model, tok, train_t, samples=4, temperature=1.0)
        log({"phase": "probe", "epoch": e, "heldout_greedy": g["terminal"]["success_rate"],
             "heldout_solved": sorted(x["task_id"] for x in g["results"] if x["reward"] > 0),
             "train_t1": t["terminal"]["success_rate"], "train_groups_var": t["terminal"]["groups_nonzero_var"]})
        model.train()
        if e == a.stop_after:
            break
    if a.export:
        for role, e in (("student", a.student_epoch), ("teacher", a.teacher_epoch)):
            dest = Path(a.export) / role
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(out / f"epoch{e}", dest)


if __name__ == "__main__":
    main()
