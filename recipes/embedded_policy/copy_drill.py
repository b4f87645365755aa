"""Pilot: does an induction drill teach the policy architecture to copy names?

The embedded student never copies a name it has not seen from the instruction into its command
(held-out terminal tasks: 0 %, results/LOG.md). This pilot trains the policy architecture (Qwen3
h256, 4 layers, from scratch, with the embedded tokenizer trained on the shipped demonstrations) in
two phases and measures copying alone, with no sandbox:

  drill    x <|im_start|> x, where x is 6-16 random letter tokens; loss on the second x only. Its
           token accuracy is the induction skill itself (chance: 1/1436).
  family   first moves of the training terminal families, rendered as the agent loop renders them
           (system prompt, instruction, "THOUGHT ... ```bash cmd```"), with every name drawn as 1-3
           random letter tokens, so that only copying predicts a name; every 4th step a drill batch.

Eval (after every --eval-every family steps): greedy first command on 40 instances of the training
families written with the held-out word pool and extensions (English words the model never saw as
names); a hit is an exact match with the family's reference command.

Not part of `tsrl prepare-data embedded`: a measurement. CPU, one thread.
  .venv/bin/python recipes/embedded_policy/copy_drill.py --drill-steps 2500 --family-steps 500
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch


def main() -> None:
    from tsrl_cli.agent.loop import SYSTEM_PROMPT
    from tsrl_cli.agent.renderer import ChatMLRenderer
    from tsrl_cli.embedded import terminal_suite as ts
    from tsrl_cli.embedded.policy.demos import train_policy_tokenizer
    from tsrl_cli.embedded.policy.sft import collate, encode_demos, masked_nll
    from tsrl_cli.policy import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", default="data/embedded_policy/demos.jsonl", help="tokenizer corpus")
    ap.add_argument("--tokenizer", choices=["word-stable", "gpt2"], default="word-stable")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--drill-steps", type=int, default=2500)
    ap.add_argument("--family-steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="save the model here after each eval")
    a = ap.parse_args()
    torch.set_num_threads(1)

    demos = [json.loads(x) for x in Path(a.demos).read_text().splitlines()]
    tok = train_policy_tokenizer(demos, 2048, word_stable=a.tokenizer == "word-stable")
    V, sep = len(tok), tok.convert_tokens_to_ids("<|im_start|>")
    alpha = sorted(t for t in tok.get_vocab() if re.fullmatch("[a-z]+", t))
    alpha_ids = [tok.convert_tokens_to_ids(t) for t in alpha]
    r = ChatMLRenderer(tok)
    model = build_tiny_model(a.seed, vocab_size=V, hidden=256, layers=a.layers, max_positions=4096,
                             pad_id=tok.pad_token_id, eos_id=r.im_end).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = random.Random(f"copy-drill:{a.seed}")

    def drill_loss(bs: int = 32):
        n = rng.randint(6, 16)
        x = torch.tensor([[rng.choice(alpha_ids) for _ in range(n)] for _ in range(bs)])
        logits = model(input_ids=torch.cat([x, torch.full((bs, 1), sep), x], 1), use_cache=False).logits[:, n:-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), x.reshape(-1)), \
            float((logits.argmax(-1) == x).float().mean())

    def name(g: random.Random) -> str:
        while True:
            w = "".join(g.choice(alpha) for _ in range(g.randint(1, 3)))
            if 3 <= len(w) <= 12:
                return w

    def first_move(g, words, exts, families):
        spec = ts.FAMILIES[g.choice(families)](g, words, exts)
        return {"task_id": "drill", "kind": "terminal", "instruction": spec.instruction,
                "messages": [{"role": "assistant",
                              "content": "THOUGHT: This does what the task asks.\n"
                                         f"```bash\n{spec.solution[0]}\n```"}]}, spec

    def family_batch(bs: int = 16):
        out = []
        for _ in range(bs):
            words = sorted({name(rng) for _ in range(40)})
            exts = sorted({name(rng)[:4] for _ in range(6)})
            out.append(first_move(rng, words, exts, ts.SPLIT_FAMILIES["train"])[0])
        return out

    erng = random.Random("copy-drill-eval")
    evals = [first_move(erng, ts.POOLS["heldout"], ts.EXTS["heldout"], ts.SPLIT_FAMILIES["train"]) for _ in range(40)]

    @torch.no_grad()
    def evaluate() -> dict:
        model.eval()
        hits, shown = 0, []
        for d, spec in evals:
            p = r.prompt(SYSTEM_PROMPT, d["instruction"])
            out = model.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=r.im_end)
            m = re.search(r"```bash\n(.*?)\n```", tok.decode(out[0, len(p):], skip_special_tokens=True), re.DOTALL)
            cmd = m.group(1).strip() if m else ""
            hits += cmd == spec.solution[0].strip()
            if len(shown) < 3:
                shown.append({"want": spec.solution[0], "got": cmd})
        model.train()
        return {"exact_first_command": hits / len(evals), "examples": shown}

    def step(loss) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    t0 = time.perf_counter()
    for s in range(a.drill_steps):
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (s + 1) / 50)
        loss, acc = drill_loss()
        step(loss)
        if s % 100 == 0 or s == a.drill_steps - 1:
            print(json.dumps({"phase": "drill", "step": s, "loss": round(loss.item(), 3), "copy_acc": round(acc, 3),
                              "s": round(time.perf_counter() - t0)}), flush=True)
    for s in range(a.family_steps):
        if s % 4 == 3:
            loss, _ = drill_loss()
        else:
            batch = family_batch()
            loss, _ = masked_nll(model, *collate(encode_demos(batch, tok), list(range(len(batch))), tok.pad_token_id))
        step(loss)
        if (s + 1) % a.eval_every == 0:
            rec = {"phase": "family", "step": s + 1, "loss": round(loss.item(), 3), **evaluate(),
                   "s": round(time.perf_counter() - t0)}
            print(json.dumps(rec), flush=True)
            if a.out:
                model.save_pretrained(a.out)
                tok.save_pretrained(a.out)


if __name__ == "__main__":
    main()
