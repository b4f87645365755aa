"""The embedded default policy and teacher: demonstrations -> tokenizer -> copy curriculum -> two checkpoints.

Data (every demonstration runs in a real sandbox of a real task, with its true final reward):
  * every training task of the embedded suite (repair and terminal), with a second, failing or
    self-corrected demonstration for about half of them (demos.choose_variants);
  * extra terminal instances of the training families, written with made-up names (pseudo-words and
    extensions that appear in no split), for fine-tuning only: they teach the model to copy names
    out of the instruction instead of recalling the training tasks' names (a policy fine-tuned on the
    training tasks alone scored 59 % on them and 0 % on held-out tasks, results/LOG.md).

Training: the copy curriculum (copy_curriculum.py: word-stable tokenizer, induction drill, family
first moves, then fine-tuning on demonstrations with copying mixed in), a 2-layer Qwen3. From one
phase-B state, two phase-C branches:
  student  sees no demonstration of a terminal training task (so RL on that split trains on instances
           it was never shown solved); every repair demonstration `copy.repair_repeat` times per epoch
           (repair is learned by recall, which needs many passes); `student_epochs` epochs.
  teacher  sees only the demonstrations that end solved (`teacher_solved_only`), the repair ones
           `teacher_repair_repeat` times per epoch, for `teacher_epochs`; it runs in a second process
           (bit-identical to running it after the student's, tested).
Both models are saved in bfloat16 and load in any dtype (policy.load_policy). Deterministic for a
seed on one machine (one torch thread, fixed data order). The research that chose this recipe lives
in recipes/embedded_policy/ (outside the package).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tsrl_cli.datasets.harbor import read_task_dir
from tsrl_cli.datasets.records import records_sha256
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.embedded import terminal_suite as ts
from tsrl_cli.embedded.policy.copy_curriculum import CopyCurriculum, CopyTrainer
from tsrl_cli.embedded.policy.demos import DemoConfig, demo_stats, make_demos, train_policy_tokenizer
from tsrl_cli.files import write_atomic, write_json_atomic
from tsrl_cli.policy import build_tiny_model, load_tokenizer, num_params, save_policy
from tsrl_cli.processes import sigterm_raises

POLICY_DIR = "embedded_policy"  # under the data root: student/, teacher/, build.json, demos.jsonl
TRAIN_SETS = ("embedded_repair_train", "embedded_terminal_train")

_CONS, _VOWS = "bcdfghjklmnprstvwz", "aeiou"
AUG_EXTS = ["txt", "csv1", "note", "rec", "data", "conf", "text", "lg", "bk", "dump"]


@dataclass(frozen=True)
class PolicyBuildConfig:
    """The recipe's knobs; the defaults build the shipped data/embedded_policy (its build key hashes them)."""

    seed: int = 0
    aug_terminal: int = 400  # extra terminal instances (fine-tuning only) with made-up names
    vocab_size: int = 2048
    hidden: int = 256  # the model: a Qwen3 of this width and depth (policy.tiny_qwen3_config)
    layers: int = 2
    max_positions: int = 4096  # >= AgentLimits.max_trajectory_tokens plus one turn
    max_len: int = 2048  # demonstrations are cut to this many tokens
    student_epochs: int = 3  # phase-C epochs of each branch
    teacher_epochs: int = 3
    demos: DemoConfig = field(default_factory=lambda: DemoConfig(concurrency=6))
    copy: CopyCurriculum = field(default_factory=lambda: CopyCurriculum(repair_repeat=4))
    teacher_repair_repeat: int = 8  # repair demonstrations per teacher epoch (0: copy.repair_repeat)
    # teach the teacher only the demonstrations that end solved (reward 1), not the wrong / no-fix
    # attempts the student sees, so that it samples fewer failures (taught like the student, a teacher
    # was only about 1.25x the student's success, results/LOG.md)
    teacher_solved_only: bool = True

    def __post_init__(self):
        if self.teacher_repair_repeat < 0:
            raise ValueError(f"teacher_repair_repeat {self.teacher_repair_repeat}: use 0 (as the student) or more")

    def student_demos(self, demos: list[dict]) -> list[dict]:
        """The student's phase-C epoch: no terminal training task (aug-* instances are in no split)."""
        unseen = [d for d in demos if d["kind"] != "terminal" or d["task_id"].startswith("aug-")]
        return repeat_repair(unseen, self.copy.repair_repeat)

    def teacher_demos(self, demos: list[dict]) -> list[dict]:
        """The teacher's phase-C epoch: every (or every solved) demonstration, repair ones repeated."""
        kept = [d for d in demos if d["reward"] == 1.0] if self.teacher_solved_only else demos
        return repeat_repair(kept, self.teacher_repair_repeat or self.copy.repair_repeat)


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
    save_policy(model, tokenizer, out, dtype=torch.bfloat16,
                extra=lambda d: (d / "policy.json").write_text(json.dumps(info, indent=1)))


def build_policy(data_root: str | Path = "data", cfg: PolicyBuildConfig = PolicyBuildConfig(),
                 progress: Callable[[str], None] = lambda m: None, out_dir: str | Path | None = None) -> dict:
    """Build data_root/embedded_policy/{student,teacher}; returns the build record (also build.json)."""
    t0 = time.perf_counter()
    root = Path(data_root)
    out = Path(out_dir) if out_dir is not None else root / POLICY_DIR
    out.mkdir(parents=True, exist_ok=True)
    stage = out / ".stage"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        pairs = [p for name in TRAIN_SETS for p in open_dataset(root / name).pairs]
        aug = augment_terminal(stage, cfg.aug_terminal, cfg.seed)
        progress(f"demonstrations: {len(pairs)} training tasks + {len(aug)} extra terminal instances")
        demos = make_demos(pairs + aug, cfg.demos, progress=lambda d, n: progress(f"demonstrations {d}/{n}"))
        # kept beside the models: what they were taught
        write_atomic(out / "demos.jsonl", "".join(json.dumps(d) + "\n" for d in demos))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    t_demos = time.perf_counter() - t0
    info, t_sft = _train(demos, out, cfg, progress)
    records = train_records_sha256(root)
    seconds = {"demos": round(t_demos, 1), "sft": round(t_sft, 1), "total": round(time.perf_counter() - t0, 1)}
    record = {**info, "key": key_of(records, cfg, torch_version()), "train_records_sha256": records,
              "torch": torch_version(), "seconds": seconds}
    write_json_atomic(out / "build.json", record)
    return record


def _train(demos: list[dict], out: Path, cfg: PolicyBuildConfig, progress) -> tuple[dict, float]:
    """Phases A-B once, then the student's and the teacher's phase C from that state, the teacher's in a
    second process (the two branches share nothing, so this only halves the wall time)."""
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
            model = new_model(tok, cfg)
            t1 = time.perf_counter()
            losses: dict[str, list] = {}
            student = CopyTrainer(model, tok, cfg.copy, cfg.seed)
            student.pretrain(_copy_log("", losses, progress))
            student_epoch = cfg.student_demos(demos)
            info = {"recipe": "copy", "params": num_params(model), "vocab": len(tok),
                    "sequences_per_epoch": {"student": len(student_epoch), "teacher": len(cfg.teacher_demos(demos))},
                    "config": key_config(cfg), "demo_stats": stats}
            tok.save_pretrained(str(stage / "tokenizer"))
            torch.save(student.state(), stage / "phase_b.pt")
            ctx = mp.get_context("spawn")
            proc = ctx.Process(target=_teacher_branch, daemon=True,
                               args=(str(stage), demos, cfg, out / "teacher", info))
            proc.start()
            progress("teacher branch started in a second process")
            student.sft(student_epoch, cfg.student_epochs, log=_copy_log("student ", losses, progress),
                        max_len=cfg.max_len)
            _save_bf16(student.model, tok, out / "student",
                       {**info, "role": "student", "sft_epochs": cfg.student_epochs, "logged_loss": losses})
            progress(f"student saved; waiting for the teacher branch ({cfg.teacher_epochs} epochs)")
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"the teacher's SFT branch failed (exit code {proc.exitcode}; "
                                   "its traceback is above)")
        finally:
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join()
            torch.set_num_threads(threads)
            shutil.rmtree(stage, ignore_errors=True)
    progress(f"policy: student ({cfg.student_epochs} epochs) and teacher ({cfg.teacher_epochs}) in {out}")
    return info, time.perf_counter() - t1


def repeat_repair(demos: list[dict], k: int) -> list[dict]:
    """Each repair demonstration k times (an epoch then holds k passes over them): repair is learned by
    recall of the training tasks, which needs more passes than the terminal families' copying."""
    return demos + [d for d in demos if d["kind"] == "repair"] * (k - 1)


def new_model(tok, cfg: PolicyBuildConfig):
    """The untrained policy model for this tokenizer and config (the same weights for a seed in any process)."""
    return build_tiny_model(cfg.seed, vocab_size=len(tok), hidden=cfg.hidden, layers=cfg.layers,
                            max_positions=cfg.max_positions, pad_id=tok.pad_token_id,
                            eos_id=tok.convert_tokens_to_ids("<|im_end|>"))


def _copy_log(role: str, losses: dict, progress):
    def f(rec: dict) -> None:
        losses.setdefault(f"{role}{rec['phase']}", []).append(rec["loss"])
        progress(f"{role}{rec['phase']}: step {rec['step']}/{rec['of']}, loss {rec['loss']:.3f}")
    return f


def _teacher_branch(stage: str, demos: list[dict], cfg: PolicyBuildConfig, dest: Path, info: dict) -> None:
    """The teacher's phase C, in a spawned process: phase B's saved state, its own demonstrations."""
    torch.set_num_threads(1)
    tok = load_tokenizer(Path(stage) / "tokenizer")
    teacher = CopyTrainer(new_model(tok, cfg), tok, cfg.copy, cfg.seed)
    teacher.load_state(torch.load(Path(stage) / "phase_b.pt", weights_only=False))
    losses: dict[str, list] = {}
    teacher.sft(cfg.teacher_demos(demos), cfg.teacher_epochs,
                log=_copy_log("teacher ", losses, lambda m: None), max_len=cfg.max_len)
    _save_bf16(teacher.model, tok, dest, {**info, "role": "teacher", "sft_epochs": cfg.teacher_epochs,
                                          "logged_loss": losses})


def train_records_sha256(data_root: str | Path) -> list[str]:
    """The training sets' records hashes (the records themselves, not the manifests' content hashes: those
    also cover the evaluation sets' paths, so the same suite prepared in another folder would never match)."""
    return [records_sha256(open_dataset(Path(data_root) / name).tasks) for name in TRAIN_SETS]


def torch_version() -> str:
    return torch.__version__.split("+")[0]


def key_of(records: list[str], cfg: PolicyBuildConfig, torch_ver: str) -> str:
    """What a build depends on: the training records, the config, and the torch version (the fine-tuning
    is reproducible bit for bit only with the same kernels)."""
    blob = json.dumps([records, key_config(cfg), torch_ver], sort_keys=True)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_key(data_root: str | Path, cfg: PolicyBuildConfig) -> str:
    return key_of(train_records_sha256(data_root), cfg, torch_version())


def key_config(cfg: PolicyBuildConfig) -> dict:
    """The config as the build key hashes it (the agent limits of the demonstrations are left out)."""
    d = asdict(cfg)
    d["demos"].pop("limits", None)
    return json.loads(json.dumps(d, default=str))
