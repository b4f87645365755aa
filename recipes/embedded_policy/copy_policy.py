"""Candidate embedded policy that copies names: induction drill, family first moves, then demo SFT.

RL on held-out tasks needs a policy with a held-out base above 0 %. A student fine-tuned on
demonstrations alone recalls its training instances and never copies an unseen name (results/LOG.md,
2026-11-30). The pilots of `copy_drill.py` showed that a model with the word-stable tokenizer learns copying from
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
through the real agent loop and sandbox (evals.probe). The phases are
tsrl_cli/embedded/policy/copy_curriculum.py, which `tsrl prepare-data embedded` runs for the shipped
default (tsrl_cli/embedded/policy/build.py: both branches at epoch 3, repair demos 4x for the student,
the teacher taught the solved demonstrations only, repair 8x).

  .venv/bin/python recipes/embedded_policy/copy_policy.py --out /tmp/copy-policy --stop-after 2 \
      --export data/copy_policy

(the first copy policy: student = epoch 1, teacher = epoch 2 of the default 6-epoch schedule; about
25 min on 2 shared cores, results/LOG.md 2026-12-01)

Student and teacher as two runs from one cached phase-B state, each repair demonstration 4 times per
epoch, epoch 3 of each (the pilot of the shipped recipe, results/LOG.md 2026-12-01):

  .venv/bin/python recipes/embedded_policy/copy_policy.py --out /tmp/cr_student --sft-skip-terminal-train \
      --repair-repeat 4 --stop-after 3 --probe-repair 10 --pretrain-cache /tmp/phaseB.pt
  .venv/bin/python recipes/embedded_policy/copy_policy.py --out /tmp/cr_teacher \
      --repair-repeat 4 --stop-after 3 --probe-repair 10 --pretrain-cache /tmp/phaseB.pt
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch


def main() -> None:
    from dataclasses import replace

    from tsrl_cli.datasets.store import open_dataset
    from tsrl_cli.embedded.policy.build import repeat_repair
    from tsrl_cli.embedded.policy.copy_curriculum import CopyCurriculum, CopyTrainer
    from tsrl_cli.embedded.policy.demos import train_policy_tokenizer
    from tsrl_cli.engines.hf import HFEngine
    from tsrl_cli.evals.probe import probe_policy
    from tsrl_cli.policy import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", default="data/embedded_policy/demos.jsonl")
    ap.add_argument("--data", default="data", help="folder holding the prepared embedded splits")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--drill-steps", type=int, default=2000)
    ap.add_argument("--family-steps", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=6,
                    help="phase C epochs over the demonstrations (sets the lr schedule)")
    ap.add_argument("--stop-after", type=int, default=None, help="end after this many epochs (schedule kept)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--sft-lr", type=float, default=5e-4, help="phase C peak lr (cosine down to a tenth)")
    ap.add_argument("--probe-train", type=int, default=20, help="training terminal tasks probed at T=1, x4")
    ap.add_argument("--demo-limit", type=int, default=None, help="use only the first N demonstrations (smoke runs)")
    ap.add_argument("--probe-heldout", type=int, default=None, help="held-out terminal tasks probed (default all)")
    ap.add_argument("--sft-skip-terminal-train", action="store_true",
                    help="phase C leaves out the demonstrations of the terminal training split (the tokenizer "
                         "still sees every demo, so it is the same as without this flag): RL then trains on "
                         "instances the policy has never been shown solved")
    ap.add_argument("--repair-repeat", type=int, default=1,
                    help="each repair demonstration appears this many times per phase-C epoch")
    ap.add_argument("--probe-repair", type=int, default=0, help="training repair tasks probed at T=1, x4")
    ap.add_argument("--probe-from", type=int, default=1, help="first epoch that is saved and probed")
    ap.add_argument("--pretrain-cache", default=None,
                    help="file with the phase-A/B state: loaded if it exists, else written after phase B")
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
    model = build_tiny_model(a.seed, vocab_size=len(tok), hidden=a.hidden, layers=a.layers, max_positions=4096,
                             pad_id=tok.pad_token_id, eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cur = CopyCurriculum(drill_steps=a.drill_steps, family_steps=a.family_steps, lr=a.lr, sft_lr=a.sft_lr,
                         schedule_epochs=a.epochs)
    trainer = CopyTrainer(model, tok, cur, a.seed)

    def log(rec: dict) -> None:
        rec["s"] = round(time.perf_counter() - t0)
        print(json.dumps(rec), flush=True)
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    t0 = time.perf_counter()
    cache = Path(a.pretrain_cache) if a.pretrain_cache else None
    if cache is not None and cache.is_file():
        trainer.load_state(torch.load(cache, weights_only=False))
        log({"phase": "pretrain", "loaded": str(cache)})
    else:
        trainer.pretrain(log)
        if cache is not None:
            torch.save(trainer.state(), cache)
    if a.sft_skip_terminal_train:  # aug-* are made-up-name instances, in no split
        demos = [d for d in demos if d["kind"] != "terminal" or d["task_id"].startswith("aug-")]
        log({"phase": "sft", "demos": len(demos), "skipped": "terminal training split"})
    if a.repair_repeat > 1:
        demos = repeat_repair(demos, a.repair_repeat)
        log({"phase": "sft", "demos": len(demos), "repair_repeat": a.repair_repeat})
    probe_sets = {}

    def on_epoch(e: int) -> None:
        if e < a.probe_from:
            return
        if not probe_sets:  # read here, not at the start: the splits may still be being prepared
            probe_sets["heldout"] = open_dataset(Path(a.data) / "embedded_terminal_heldout", a.probe_heldout)
            for key, name, n in (("train", "embedded_terminal_train", a.probe_train),
                                 ("repair", "embedded_repair_train", a.probe_repair)):
                ds = open_dataset(Path(a.data) / name)
                probe_sets[key] = replace(ds, tasks=random.Random(0).sample(ds.tasks, min(n, len(ds.tasks))))
        model.save_pretrained(out / f"epoch{e}")
        tok.save_pretrained(out / f"epoch{e}")
        pol = (HFEngine(model, pad_id=tok.pad_token_id), tok)  # HFEngine puts the model in eval mode

        def probe(name, samples, temperature):
            return probe_policy(out / f"epoch{e}", [probe_sets[name]], samples=samples, temperature=temperature,
                                policy=pol, out_dir=out / f"epoch{e}-probe-{name}")

        g, t = probe("heldout", 1, 0.0), probe("train", 4, 1.0)
        r = probe("repair", 4, 1.0) if probe_sets["repair"].tasks else None
        model.train()
        if r is not None:
            log({"phase": "probe", "epoch": e, "repair_t1": r["repair"]["success_rate"],
                 "repair_groups_var": r["repair"]["groups_nonzero_var"], "repair_turns": r["repair"].get("mean_turns")})
        log({"phase": "probe", "epoch": e, "heldout_greedy": g["terminal"]["success_rate"],
             "heldout_solved": sorted(x["instance_id"] for x in g["results"] if x["reward"]),
             "train_t1": t["terminal"]["success_rate"], "train_groups_var": t["terminal"]["groups_nonzero_var"]})

    trainer.sft(demos, a.stop_after or a.epochs, on_epoch, log)
    if a.export:
        for role, e in (("student", a.student_epoch), ("teacher", a.teacher_epoch)):
            dest = Path(a.export) / role
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(out / f"epoch{e}", dest)


if __name__ == "__main__":
    main()
