"""Pilot: can a fine-tuned student learn to copy names it never saw by more fine-tuning?

The first default student (4 layers, fine-tuned on demonstrations only) scored 0 % on held-out
terminal tasks. It writes the right command with the
wrong name (`window.sh` -> `wizard.sh`, results/LOG.md). This pilot continues the student's SFT on
a mix: the original demonstrations, plus N synthetic first moves of the training families. The
synthetic moves use made-up names, and each is written from the family's reference solution
(`Spec.solution`), so no sandbox runs. Then it probes held-out terminal tasks greedily.

A synthetic demo is one of:
  look    "Let me look at `X` first." + cat X / ls X          (X: the first starting file named)
  solve   the solution's commands, one per turn, each followed by "[exit code 0]" when the
          command prints nothing (it writes a file), then `submit`; a command that prints
          stops the demo after that turn (its output is not simulated)

Not part of `tsrl prepare-data embedded`: a measurement. CPU only. About 10-15 min for N=3000.
  .venv/bin/python recipes/embedded_policy/copy_pilot.py --model MODEL_DIR --n 3000 --out /tmp/copy_student
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

SILENT = re.compile(r"^(chmod|mv|cp|rm|mkdir|touch|sed -i|for )|>")


def synthetic_demos(n: int, seed: int) -> list[dict]:
    from tsrl_cli.embedded import terminal_suite as ts
    from tsrl_cli.embedded.policy.build import AUG_EXTS, pseudo_words

    rng = random.Random(f"copy-curriculum:{seed}")
    words = pseudo_words(random.Random(f"copy-words:{seed}"), 3000)
    families = ts.SPLIT_FAMILIES["train"]
    out = []
    for j in range(n):
        fam = families[j % len(families)]
        spec = ts.FAMILIES[fam](random.Random(f"copy:{seed}:{fam}:{j}"), words, AUG_EXTS)
        named = re.findall(r"`([^`]+)`", spec.instruction)
        files = set(spec.files)
        dirs = {p.split("/")[0] for p in files if "/" in p}
        ins = [x for x in named if x in files or x in dirs]
        if ins and rng.random() < 0.4:
            x = ins[0]
            msgs = [{"role": "assistant", "content": f"THOUGHT: Let me look at `{x}` first.\n```bash\n"
                                                     f"{'ls' if x in dirs else 'cat'} {x}\n```"}]
        else:
            msgs = []
            for k, cmd in enumerate(spec.solution):
                head = "THOUGHT: This does what the task asks.\n" if k == 0 else ""
                msgs.append({"role": "assistant", "content": f"{head}```bash\n{cmd}\n```"})
                if not SILENT.search(cmd):
                    break
                msgs.append({"role": "observation", "content": "[exit code 0]\n"})
            else:
                msgs.append({"role": "assistant", "content": "```bash\nsubmit\n```"})
        out.append({"task_id": f"copy-{fam}-{j}", "kind": "terminal", "instruction": spec.instruction,
                    "messages": msgs})
    return out


def main() -> None:
    import tempfile
    from dataclasses import replace

    from tsrl_cli.datasets.store import open_dataset
    from tsrl_cli.embedded.policy.sft import SFTConfig, encode_demos, train_sft
    from tsrl_cli.engines.hf import HFEngine
    from tsrl_cli.evals.probe import probe_policy
    from tsrl_cli.policy import load_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="data/embedded_policy/student")
    ap.add_argument("--n", type=int, default=3000, help="synthetic demos")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-train", type=int, default=20, help="training terminal tasks to probe (8 samples, T=1)")
    ap.add_argument("--out", default=None, help="save the continued model here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)

    model, tok = load_policy(a.model, dtype=torch.float32)
    demos = [json.loads(x) for x in Path("data/embedded_policy/demos.jsonl").read_text().splitlines()]
    synth = synthetic_demos(a.n, a.seed)
    seqs = encode_demos(demos + synth, tok)
    cfg = SFTConfig(hidden=256, layers=4, epochs=a.epochs, batch_size=8, lr=a.lr, min_lr_ratio=0.1, warmup_steps=20,
                    seed=a.seed)
    t0 = time.perf_counter()
    log = train_sft(model, seqs, cfg, pad_id=tok.pad_token_id)
    report = {"n_synth": len(synth), "n_demos": len(demos), "steps": len(log),
              "sft_s": round(time.perf_counter() - t0, 1),
              "last_loss": log[-1]["loss"] if log else None}
    if a.out:
        model.to(torch.bfloat16).save_pretrained(a.out)
        tok.save_pretrained(a.out)
        model.to(torch.float32)
    pol = (HFEngine(model, pad_id=tok.pad_token_id), tok)  # eval mode
    scratch = Path(tempfile.mkdtemp(prefix="copy-pilot-"))  # the probes' records
    r = probe_policy(a.model, ["embedded_terminal_heldout"], samples=1, temperature=0.0, policy=pol,
                     out_dir=scratch / "heldout")
    report["heldout_terminal_greedy"] = r["terminal"]["success_rate"]
    report["heldout_terminal_solved"] = sorted(x["instance_id"] for x in r["results"] if x["reward"])
    if a.probe_train:
        ds = open_dataset("embedded_terminal_train")
        tr = replace(ds, tasks=random.Random(0).sample(ds.tasks, min(a.probe_train, len(ds.tasks))))
        rt = probe_policy(a.model, [tr], samples=8, temperature=1.0, policy=pol, out_dir=scratch / "train")
        report["train_terminal_t1"] = rt["terminal"]["success_rate"]
        report["train_groups_nonzero_var"] = rt["terminal"]["groups_nonzero_var"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
