"""The embedded default policy and teacher: demonstrations -> tokenizer -> SFT -> two checkpoints.

Data (all demonstrations run in real sandboxes of real tasks, with their true final rewards):
  * every training task of the embedded suite (repair and terminal), with a second, failing or
    self-corrected demonstration for about half of them (demos.choose_variants);
  * extra terminal instances of the training families, written with made-up names (pseudo-words and
    extensions that appear in no split), for SFT only: they teach the model to copy names out of
    the instruction instead of recalling the training tasks' names (a 15-epoch model trained on the
    training tasks alone scored 59 % on them and 0 % on held-out tasks, results/LOG.md).
Two recipes (`PolicyBuildConfig.recipe`); the default build is the preset copy_repair (DEFAULT_PRESET):
  two_stage  SFT stage 1 on every demo, stage 2 on the training tasks' demos; the student is stage
             2's snapshot after `student_epochs`, the teacher its final weights ("trained longer" in
             issue 4). 4 layers. Recalls its training tasks: 0 % on held-out tasks. The default until
             session 9 (the PolicyBuildConfig defaults).
  copy       the copy curriculum (copy_curriculum.py: word-stable tokenizer, induction drill, family
             first moves, then SFT with copying mixed in), 2 layers. From one phase-B state, two
             phase-C branches: the student sees no demonstration of a terminal training task (so RL
             on that split trains on instances it was never shown solved) for `student_epochs`; the
             teacher sees every demonstration (or only the solved ones, `teacher_solved_only`, with its
             own repair repeat) for `teacher_epochs`; the teacher's branch runs in a
             second process (bit-identical to running it after the student's, tested). Copies names:
             about 35 % on held-out terminal tasks at T=1 (results/LOG.md, 2026-12-01); 0 % on repair.
             `COPY_RECIPE` is its config.
Both models are saved in bfloat16 and load in any dtype with load_policy. Deterministic for a seed
on one machine (one torch thread, fixed data order).
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tsrl_cli.embedded.copy_curriculum import CopyCurriculum, CopyTrainer
from tsrl_cli.embedded.demos import DemoConfig, dataset_tasks, demo_stats, make_demos, train_policy_tokenizer
from tsrl_cli.embedded.sft import SFTConfig, build_policy_model, encode_demos, num_params, train_sft

POLICY_DIR = "embedded_policy"  # under the data root: student/, teacher/, build.json
TRAIN_SETS = ("embedded_repair_train", "embedded_terminal_train")

_CONS, _VOWS = "bcdfghjklmnprstvwz", "aeiou"
AUG_EXTS = ["txt", "csv1", "note", "rec", "data", "conf", "text", "lg", "bk", "dump"]


@dataclass(frozen=True)
class PolicyBuildConfig:
    seed: int = 0
    recipe: str = "two_stage"  # or "copy" (see the module docstring)
    aug_terminal: int = 400  # extra terminal instances (SFT only) with made-up names
    vocab_size: int = 2048
    # stage 1: every demonstration (training tasks + made-up-name instances): format and copying
    stage1_epochs: int = 4
    # stage 2, from stage 1's bf16 weights: the training tasks' demos plus a share of the extra ones
    aug_share_stage2: float = 0.25
    stage2_lr: float = 1e-3
    student_epochs: int = 6  # the student is stage 2's snapshot after this many epochs ...
    teacher_epochs: int = 8  # ... the teacher is stage 2's final weights (trained longer)
    sft: SFTConfig = field(default_factory=SFTConfig)  # its `epochs` and `lr` are set per stage
    demos: DemoConfig = field(default_factory=lambda: DemoConfig(concurrency=6))
    copy: CopyCurriculum = field(default_factory=CopyCurriculum)  # the copy recipe's phases (stage* unused)
    # copy recipe, teacher branch only: repair demonstrations per epoch (0: copy.repair_repeat, as the student)
    teacher_repair_repeat: int = 0
    # copy recipe, teacher branch only: teach only the demonstrations that end solved (reward 1), not the
    # wrong / no-fix attempts the student sees, so that the teacher samples fewer failures
    teacher_solved_only: bool = False

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"policy recipe {self.recipe!r}: use one of {', '.join(RECIPES)}")
        if self.teacher_repair_repeat < 0:
            raise ValueError(f"teacher_repair_repeat {self.teacher_repair_repeat}: use 0 (as the student) or more")

    def teacher_demos(self, demos: list[dict]) -> list[dict]:
        """The copy recipe teacher's phase-C epoch: every (or every solved) demonstration, repair ones repeated."""
        kept = [d for d in demos if d["reward"] == 1.0] if self.teacher_solved_only else demos
        return repeat_repair(kept, self.teacher_repair_repeat or self.copy.repair_repeat)


RECIPES = ("two_stage", "copy")  # how a build trains (PolicyBuildConfig.recipe); PRESETS name whole configs
# the copy recipe as measured (results/LOG.md 2026-12-01): the student is phase C's first epoch
# without terminal-training demos, the teacher two epochs with every demo
COPY_RECIPE = PolicyBuildConfig(recipe="copy", student_epochs=1, teacher_epochs=2, sft=SFTConfig(layers=2))
# the copy recipe with every repair demonstration 4 times per phase-C epoch, so the repair training tasks
# are learned too (results/LOG.md 2026-12-01 session 8: 0 % repair after 4 passes, 10 % after 8, 32 % after 12)
# (student); its teacher is taught only the solved demonstrations, the repair ones 8x per epoch (24 passes),
# since the session-8 teacher, taught like the student, was only about 1.25x the student's success
COPY_REPAIR_RECIPE = PolicyBuildConfig(recipe="copy", student_epochs=3, teacher_epochs=3,
                                       sft=SFTConfig(layers=2), copy=CopyCurriculum(repair_repeat=4),
                                       teacher_repair_repeat=8, teacher_solved_only=True)
# `tsrl prepare-data embedded --policy-recipe NAME`
PRESETS = {"two_stage": PolicyBuildConfig(), "copy": COPY_RECIPE, "copy_repair": COPY_REPAIR_RECIPE}
# what `tsrl prepare-data embedded` builds and ships in data/embedded_policy/ (the dataclass defaults above
# are the earlier two_stage default, kept as they were so that its build key does not change)
DEFAULT_PRESET = "copy_repair"


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    """n distinct pronounceable made-up words (2-3 syllables), e.g. 'bozeka', 'tulim'."""
    out: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice(_CONS) + rng.choice(_VOWS) for _ in range(rng.randint(2, 3)))
        out.add(w + (rng.choice(_CONS) if rng.random() < 0.5 else ""))
    return sorted(out)


def augment_terminal(root: Path, n: int, seed: int = 0) -> list[tuple[Path, object]]:
    """Write n terminal tasks of the training families with made-up names under root/tasks/ (not validated:
    each demonstration's reward is measured anyway); returns (root, TerminalTask) pairs."""
    from tsrl_cli.datasets.harbor import read_task_dir
    from tsrl_cli.embedded import terminal_suite as ts

    words = pseudo_words(random.Random(f"tsrl-aug-words:{seed}"), 500)
    families = ts.SPLIT_FAMILIES["train"]
    out, seen = [], set()
    for j in range(n):
        family = families[j % len(families)]
        spec = ts.FAMILIES[family](random.Random(f"tsrl-aug-terminal:{seed}:{family}:{j}"), words, AUG_EXTS)
        if spec.instruction in seen:
            continue
        seen.add(spec.instruction)
        d = root / "tasks" / f"aug-{family.replace('_', '-')}-{j:04d}"
        ts.write_task(d, spec, family=family, split="train", seed=seed)
        out.append((root, read_task_dir(d, source="embedded-aug", split="train", rel=str(d.relative_to(root)))))
    return out


def _save_bf16(model, tokenizer, out: Path, info: dict) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "policy.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def build_policy(data_root: str | Path = "data", cfg: PolicyBuildConfig = PRESETS[DEFAULT_PRESET],
                 progress: Callable[[str], None] = lambda m: None, out_dir: str | Path | None = None,
                 on_epoch: Callable[[int, object, object], None] | None = None) -> dict:
    """Build data_root/embedded_policy/{student,teacher}; returns the build record (also build.json).

    on_epoch(epoch, model, tokenizer) runs after every SFT epoch (e.g. to keep every epoch while tuning).
    """
    t0 = time.perf_counter()
    root = Path(data_root)
    out = Path(out_dir) if out_dir is not None else root / POLICY_DIR
    out.mkdir(parents=True, exist_ok=True)
    stage = out / ".stage"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        pairs = [p for name in TRAIN_SETS for p in dataset_tasks(root / name)]
        aug = augment_terminal(stage, cfg.aug_terminal, cfg.seed)
        progress(f"demonstrations: {len(pairs)} training tasks + {len(aug)} extra terminal instances")
        demos = make_demos(pairs + aug, cfg.demos, progress=lambda d, n: progress(f"demonstrations {d}/{n}"))
        (out / "demos.jsonl.tmp").write_text("".join(json.dumps(d) + "\n" for d in demos))
        (out / "demos.jsonl.tmp").rename(out / "demos.jsonl")  # kept beside the models: what they were taught
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    t_demos = time.perf_counter() - t0
    if cfg.recipe == "copy":
        return _build_copy(demos, root, out, cfg, progress, t0, t_demos)
    tok = train_policy_tokenizer(demos, cfg.vocab_size)
    stats = demo_stats(demos, tok)
    progress(f"tokenizer: vocab {len(tok)}; {stats['demos']} demos, {stats['tokens_mean']} tokens each on average")

    pad = tok.pad_token_id
    seqs = encode_demos(demos, tok, cfg.sft.max_len)
    model = build_policy_model(len(tok), cfg.sft.hidden, cfg.sft.layers, cfg.sft.max_positions, cfg.seed, pad_id=pad,
                               eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    t1 = time.perf_counter()
    s1 = SFTConfig(**{**asdict(cfg.sft), "epochs": cfg.stage1_epochs, "seed": cfg.seed})
    log1 = sft_stage(model, seqs, s1, pad, "stage 1", progress)
    model = bf16_round_trip(model)  # stage 2 starts from the bf16 checkpoint: what a saved stage 1 would give
    rng = random.Random(f"tsrl-stage2:{cfg.seed}")
    keep = [q for d, q in zip(demos, seqs) if not d["task_id"].startswith("aug-") or rng.random() < cfg.aug_share_stage2]
    s2 = SFTConfig(**{**asdict(cfg.sft), "epochs": cfg.teacher_epochs, "lr": cfg.stage2_lr, "seed": cfg.seed + 1,
                      "warmup_steps": 10})
    snapshots: dict[int, dict] = {}

    def epoch_end(e: int) -> None:
        if e == cfg.student_epochs:
            snapshots[e] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if on_epoch is not None:
            on_epoch(e, model, tok)

    log2 = sft_stage(model, keep, s2, pad, "stage 2", progress, epoch_end)
    t_sft = time.perf_counter() - t1
    info = {"params": num_params(model), "vocab": len(tok), "sequences": {"stage1": len(seqs), "stage2": len(keep)},
            "config": key_config(cfg), "demo_stats": stats,
            "epoch_loss": {"stage1": _epoch_losses(log1), "stage2": _epoch_losses(log2)}}
    _save_bf16(model, tok, out / "teacher", {**info, "role": "teacher", "stage2_epochs": cfg.teacher_epochs})
    if cfg.student_epochs in snapshots:
        model.load_state_dict(snapshots[cfg.student_epochs])
    _save_bf16(model, tok, out / "student", {**info, "role": "student", "stage2_epochs": cfg.student_epochs})
    progress(f"policy: student ({cfg.student_epochs} epochs) and teacher ({cfg.teacher_epochs} epochs) in {out}")
    return _write_record(info, root, out, cfg, t0, t_demos, t_sft)


def _write_record(info: dict, root: Path, out: Path, cfg: PolicyBuildConfig, t0: float, t_demos: float,
                  t_sft: float) -> dict:
    record = {**info, "key": build_key(root, cfg), "seconds": {"demos": round(t_demos, 1), "sft": round(t_sft, 1),
                                  "total": round(time.perf_counter() - t0, 1)}}
    tmp = out / "build.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.rename(out / "build.json")
    return record


def _build_copy(demos: list[dict], root: Path, out: Path, cfg: PolicyBuildConfig, progress, t0: float,
                t_demos: float) -> dict:
    """The copy recipe: phases A-B once, then the student's and the teacher's phase C from that state,
    the teacher's in a second process (the two branches share nothing, so this only halves the wall time)."""
    import multiprocessing as mp

    from tsrl_cli.rl.process import sigterm_raises

    tok = train_policy_tokenizer(demos, cfg.vocab_size, word_stable=True)
    stats = demo_stats(demos, tok)
    progress(f"tokenizer (word-stable): vocab {len(tok)}; {stats['demos']} demos, "
             f"{stats['tokens_mean']} tokens each on average")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-reproducible on any core count; the branches run side by side
    stage = out / ".branch"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    proc = None
    with sigterm_raises():  # a killed build stops its teacher branch too (the finally below)
        try:
            model = _new_model(tok, cfg)
            t1 = time.perf_counter()
            losses: dict[str, list] = {}
            student = CopyTrainer(model, tok, cfg.copy, cfg.seed)
            student.pretrain(_copy_log("", losses, progress))
            # aug-* are made-up-name instances in no split; the terminal training split stays unseen by the student
            unseen = [d for d in demos if d["kind"] != "terminal" or d["task_id"].startswith("aug-")]
            student_epoch = repeat_repair(unseen, cfg.copy.repair_repeat)
            info = {"recipe": "copy", "params": num_params(model), "vocab": len(tok),
                    "sequences_per_epoch": {"student": len(student_epoch),
                                            "teacher": len(cfg.teacher_demos(demos))},
                    "config": key_config(cfg),
                    "demo_stats": stats}
            tok.save_pretrained(str(stage / "tokenizer"))
            torch.save(student.state(), stage / "phase_b.pt")
            ctx = mp.get_context("spawn")
            proc = ctx.Process(target=_teacher_branch, daemon=True,
                               args=(str(stage), demos, cfg, out / "teacher", info))
            proc.start()
            progress("teacher branch started in a second process")
            student.sft(student_epoch, cfg.student_epochs,
                        log=_copy_log("student ", losses, progress), max_len=cfg.sft.max_len)
            _save_bf16(student.model, tok, out / "student", {**info, "role": "student", "sft_epochs": cfg.student_epochs,
                                                            "logged_loss": losses})
            progress(f"student saved; waiting for the teacher branch ({cfg.teacher_epochs} epochs)")
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"the teacher's SFT branch failed (exit code {proc.exitcode}; its traceback is above)")
        finally:
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join()
            torch.set_num_threads(threads)
            shutil.rmtree(stage, ignore_errors=True)
    t_sft = time.perf_counter() - t1
    progress(f"policy (copy recipe): student ({cfg.student_epochs} epoch) and teacher ({cfg.teacher_epochs}) in {out}")
    return _write_record(info, root, out, cfg, t0, t_demos, t_sft)


def repeat_repair(demos: list[dict], k: int) -> list[dict]:
    """Each repair demonstration k times (an epoch then holds k passes over them): repair is learned by
    recall of the training tasks, which needs more passes than the terminal families' copying."""
    return demos + [d for d in demos if d["kind"] == "repair"] * (k - 1)


def _new_model(tok, cfg: PolicyBuildConfig):
    """The untrained policy model for this tokenizer and config (the same weights for a seed in any process)."""
    return build_policy_model(len(tok), cfg.sft.hidden, cfg.sft.layers, cfg.sft.max_positions, cfg.seed,
                              pad_id=tok.pad_token_id, eos_id=tok.convert_tokens_to_ids("<|im_end|>"))


def _copy_log(role: str, losses: dict, progress):
    def f(rec: dict) -> None:
        losses.setdefault(f"{role}{rec['phase']}", []).append(rec["loss"])
        progress(f"{role}{rec['phase']}: step {rec['step']}/{rec['of']}, loss {rec['loss']:.3f}")
    return f


def _teacher_branch(stage: str, demos: list[dict], cfg: PolicyBuildConfig, dest: Path, info: dict) -> None:
    """The teacher's phase C, in a spawned process: phase B's saved state, every demonstration."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(Path(stage) / "tokenizer"))
    teacher = CopyTrainer(_new_model(tok, cfg), tok, cfg.copy, cfg.seed)
    teacher.load_state(torch.load(Path(stage) / "phase_b.pt", weights_only=False))
    losses: dict[str, list] = {}
    teacher.sft(cfg.teacher_demos(demos), cfg.teacher_epochs,
                log=_copy_log("teacher ", losses, lambda m: None), max_len=cfg.sft.max_len)
    _save_bf16(teacher.model, tok, dest, {**info, "role": "teacher", "sft_epochs": cfg.teacher_epochs,
                                          "logged_loss": losses})


def build_key(data_root: str | Path, cfg: PolicyBuildConfig) -> str:
    """What a build depends on: the training sets' content hashes and the config (and the torch version,
    since SFT is only reproducible bit for bit with the same kernels)."""
    import hashlib

    from tsrl_cli.datasets.records import load_dataset_dir, records_sha256

    # the records themselves, not the manifest's content hash: that one also covers the evaluation
    # sets' paths, so the same suite prepared in another folder would never match
    parts = [records_sha256(load_dataset_dir(Path(data_root) / name)[1]) for name in TRAIN_SETS]
    blob = json.dumps([parts, key_config(cfg), torch.__version__.split("+")[0]], sort_keys=True)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def bf16_round_trip(model):
    """The model with every weight rounded to bfloat16 and back to float32 (as save + load would give)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


def sft_stage(model, seqs, sft: SFTConfig, pad: int, name: str, progress, epoch_end=None) -> list[dict]:
    steps = -(-len(seqs) // sft.batch_size) * sft.epochs

    def on_step(rec: dict) -> None:
        if rec.get("event") == "epoch_end":
            progress(f"SFT {name}: epoch {rec['epoch'] + 1}/{sft.epochs} done, loss {rec['loss']:.3f} "
                     f"({rec['seconds']:.0f} s)")
            if epoch_end is not None:
                epoch_end(rec["epoch"] + 1)
        elif rec["step"] % 10 == 0:
            progress(f"SFT {name}: steps {rec['step']}/{steps}")

    return train_sft(model, seqs, sft, pad_id=pad, progress=on_step)


def _epoch_losses(log: list[dict]) -> list[float]:
    by: dict[int, list[float]] = {}
    for r in log:
        by.setdefault(r["epoch"], []).append(r["loss"])
    return [round(sum(v) / len(v), 4) for _, v in sorted(by.items())]


def key_config(cfg: PolicyBuildConfig) -> dict:
    """The config as the build key sees it. A two_stage config leaves out the fields added with the
    recipes (`recipe`, `copy`), so its key is the one computed before they existed and the shipped
    policy (data/embedded_policy/build.json) stays valid instead of being retrained; a copy config
    without repeated repair demos leaves out `copy.repair_repeat` for the same reason."""
    d = _jsonable(cfg)
    for k in ("teacher_repair_repeat", "teacher_solved_only"):  # added later: at their defaults, old keys hold
        if d[k] == getattr(PolicyBuildConfig, k):
            d.pop(k)
    if cfg.recipe == "two_stage":
        d.pop("recipe")
        d.pop("copy")
    elif cfg.copy.repair_repeat == 1:  # likewise for copy builds made before repair_repeat existed
        d["copy"].pop("repair_repeat")
    return d


def _jsonable(cfg) -> dict:
    d = asdict(cfg)
    d["demos"].pop("limits", None)
    return json.loads(json.dumps(d, default=str))
