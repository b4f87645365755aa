"""Procedural terminal tasks in the Harbor layout, short enough for a tiny policy (1-3 shell commands).

`build_terminal_suite(out_dir, seed)` writes `out_dir/terminal/{train,heldout}/<task_id>/`:

    task.toml          Harbor fields: version, [metadata], [verifier], [agent], [environment]
    instruction.md     what the agent is asked, naming files relative to its working directory
    environment/       the starting files, plus a Dockerfile that copies them to /app (WORKDIR /app)
    tests/test.sh      checks the result, writes 1 or 0 to /logs/verifier/reward.txt
    solution/solve.sh  the reference solution

Working directory convention: the agent, solve.sh and test.sh all run with the task's working
directory as cwd (Docker: /app, the WORKDIR from which Harbor runs /tests/test.sh; tsrl's local
executor: a copy of environment/), so every path in instructions, solutions and checks is
relative. test.sh needs only bash and python3 (the Dockerfile's python:3.12-slim has both).

Each task family is a function `(rng, words, exts) -> Spec`. Held-out tasks draw every name and
content word (file and directory stems, column names, file words, extensions) from pools disjoint
from training's, and HELDOUT_ONLY families never appear in training; each of them is one step from
a training family (head -> tail, sort -> sort -u, count_words/delete_glob -> count files), so
they measure transfer rather than being out of reach. Integers (counts, summands) come from the
same ranges in both splits: a number is not what identifies an instance.

Every task is validated when built (validate_task): on a fresh copy of environment/ in tsrl's
sandbox, test.sh gives 0 on the untouched start state and 1 after solve.sh.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tsrl_cli.sandbox import IsolationError, Mount, open_sandbox

# Lowercase words a tiny tokenizer sees often, none naming a common command or shell keyword. No word
# is a substring of another (_WORDS enforces it), so `grep w` and `sed s/w/x/g` touch exactly that word.
_WORD_TEXT = """
    apple amber anchor autumn badge banjo basket beacon berry birch blossom bottle breeze brick
    bridge bucket butter cabin camel candle canyon carpet castle cedar cherry cloud clover cobalt comet
    copper coral cotton crayon dancer delta desert dragon eagle ember engine falcon feather fern fiddle
    forest fossil garden ginger glacier grape gravel guitar hammer harbor hazel helmet honey island
    ivory jacket jasmine jelly jungle kettle kite ladder lagoon lantern lemon lizard lotus magnet mango
    maple marble meadow melon mirror monkey mosaic napkin nectar noodle oasis ocean olive orbit otter
    paddle panda parrot pebble pepper piano pillow planet plum pocket pony puzzle quartz quilt rabbit
    radio raven ribbon river rocket saddle salmon sandal shadow silver sketch sparrow spider spruce
    squash stable summer sunset thimble thunder tiger timber tomato tulip turtle velvet violin walnut
    willow window winter wizard yogurt zebra
"""
_WORDS = sorted({w for w in _WORD_TEXT.split() if not any(w != v and w in v for v in _WORD_TEXT.split())})
# Fixed, seed-independent split: every 4th word is held out, so no seed can leak one into training.
POOLS = {"train": [w for i, w in enumerate(_WORDS) if i % 4], "heldout": _WORDS[::4]}
EXTS = {"train": ["log", "tmp", "bak", "md", "dat", "cfg"], "heldout": ["old", "out", "lst", "ini"]}
HELDOUT_ONLY = ("tail_lines", "count_files", "unique_sorted")


@dataclass
class Spec:
    """One task instance. Paths are relative to the working directory."""

    instruction: str
    files: dict[str, str]  # starting files: relative path -> text (all mode 0644)
    solution: list[str]  # shell commands, one per line of solve.sh; each one works alone from the working
    # directory, since an agent's turns do not share a shell (a `cd` does not carry over)
    check: list[str]  # Python boolean expressions; the task is solved when all hold
    difficulty: str = "easy"
    category: str = "file-operations"
    tags: list[str] = field(default_factory=list)


def _lines(rng: random.Random, words: list[str], n: int, per_line: tuple[int, int]) -> list[str]:
    return [" ".join(rng.sample(words, rng.randint(*per_line))) for _ in range(n)]


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


# -- families: (rng, words, exts) -> Spec --------------------------------------------------------------

def create_file(rng, words, exts):
    stem, a, b = rng.sample(words, 3)
    return Spec(f"Create a file named `{stem}.txt` containing exactly one line: `{a} {b}`",
                {}, [f"echo '{a} {b}' > {stem}.txt"], [f"lines({stem + '.txt'!r}) == [{f'{a} {b}'!r}]"],
                tags=["echo", "redirect"])


def make_dirs(rng, words, exts):
    top, x, y = rng.sample(words, 3)
    return Spec(f"Create the directories `{top}/{x}` and `{top}/{y}`.", {}, [f"mkdir -p {top}/{x} {top}/{y}"],
                [f"Path({f'{top}/{x}'!r}).is_dir()", f"Path({f'{top}/{y}'!r}).is_dir()"], tags=["mkdir"])


def chmod_x(rng, words, exts):
    stem, w = rng.sample(words, 2)
    body = f"#!/bin/sh\necho {w}\n"
    return Spec(f"Make the script `{stem}.sh` executable.", {f"{stem}.sh": body}, [f"chmod +x {stem}.sh"],
                [f"os.stat({stem + '.sh'!r}).st_mode & 0o100", f"Path({stem + '.sh'!r}).read_text() == {body!r}"],
                tags=["chmod", "permissions"])


def count_matches(rng, words, exts):
    src, out, target, *others = rng.sample(words, 7)
    while True:  # some lines but not all hold the word, so `wc -l` is not the answer
        lines = _lines(rng, [target, *others], rng.randint(5, 9), (2, 4))
        n = sum(target in line.split() for line in lines)
        if 0 < n < len(lines):
            break
    return Spec(f"Count the lines of `{src}.txt` that contain the word `{target}` and write the number to "
                f"`{out}.txt`.", {f"{src}.txt": _text(lines)}, [f"grep -c {target} {src}.txt > {out}.txt"],
                [f"lines({out + '.txt'!r}) == [{str(n)!r}]"], "medium", "text-processing", ["grep", "count"])


def count_words(rng, words, exts):
    src, out, *vocab = rng.sample(words, 8)
    lines = _lines(rng, vocab, rng.randint(2, 5), (1, 5))
    n = sum(len(line.split()) for line in lines)
    return Spec(f"Write the number of words in `{src}.txt` to `{out}.txt`.", {f"{src}.txt": _text(lines)},
                [f"wc -w < {src}.txt > {out}.txt"], [f"lines({out + '.txt'!r}) == [{str(n)!r}]"],
                category="text-processing", tags=["wc", "count"])


def sort_lines(rng, words, exts):
    src, out = rng.sample(words, 2)
    items = rng.sample([w for w in words if w not in (src, out)], rng.randint(4, 8))
    while items == sorted(items):
        rng.shuffle(items)
    # lowercase a-z words only: C and en_US collation agree, so plain `sort` passes in any locale
    return Spec(f"Sort the lines of `{src}.txt` alphabetically and write them to `{out}.txt`.",
                {f"{src}.txt": _text(items)}, [f"sort {src}.txt > {out}.txt"],
                [f"lines({out + '.txt'!r}) == {sorted(items)!r}"], category="text-processing", tags=["sort"])


def replace_word(rng, words, exts):
    src, old, new, *vocab = rng.sample(words, 7)
    while True:
        lines = _lines(rng, [old, *vocab], rng.randint(3, 6), (2, 4))
        if any(old in line.split() for line in lines):
            break
    want = [" ".join(new if w == old else w for w in line.split()) for line in lines]
    return Spec(f"In `{src}.txt`, replace every `{old}` with `{new}`, editing the file in place.",
                {f"{src}.txt": _text(lines)}, [f"sed -i 's/{old}/{new}/g' {src}.txt"],
                [f"lines({src + '.txt'!r}) == {want!r}"], "medium", "text-processing", ["sed", "in-place"])


def rename_ext(rng, words, exts):
    d, *stems = rng.sample(words, rng.randint(3, 5))
    old, new, other = rng.sample(exts, 3)
    keep = rng.choice([w for w in words if w != d and w not in stems])
    files = {f"{d}/{s}.{old}": f"{s}\n" for s in stems} | {f"{d}/{keep}.{other}": f"{keep}\n"}
    want = sorted([f"{s}.{new}" for s in stems] + [f"{keep}.{other}"])
    return Spec(f"In the directory `{d}`, rename every `.{old}` file to `.{new}`, keeping the part of the name "
                f"before the extension.", files,
                [f'for f in {d}/*.{old}; do mv "$f" "${{f%.{old}}}.{new}"; done'],
                [f"sorted(os.listdir({d!r})) == {want!r}",
                 *(f"lines({f'{d}/{s}.{new}'!r}) == [{s!r}]" for s in stems)],
                "medium", tags=["mv", "loop", "rename"])


def csv_column(rng, words, exts):
    src, *header = rng.sample(words, 4)
    k = rng.randrange(3)
    rows = [[rng.choice(words), str(rng.randint(1, 99)), rng.choice(words)] for _ in range(rng.randint(3, 6))]
    out = rng.choice([w for w in words if w not in header and w != src])
    return Spec(f"`{src}.csv` is comma-separated with a header line. Write the values of its column "
                f"`{header[k]}` (without the header) to `{out}.txt`, one per line.",
                {f"{src}.csv": _text([",".join(header)] + [",".join(r) for r in rows])},
                [f"cut -d, -f{k + 1} {src}.csv | tail -n +2 > {out}.txt"],
                [f"lines({out + '.txt'!r}) == {[r[k] for r in rows]!r}"], "medium", "text-processing",
                ["csv", "cut"])


def sum_numbers(rng, words, exts):
    src, out = rng.sample(words, 2)
    nums = [rng.randint(1, 99) for _ in range(rng.randint(3, 7))]
    return Spec(f"`{src}.txt` holds one integer per line. Write their sum to `{out}.txt`.",
                {f"{src}.txt": _text([str(x) for x in nums])},
                [f"awk '{{s += $1}} END {{print s}}' {src}.txt > {out}.txt"],
                [f"lines({out + '.txt'!r}) == [{str(sum(nums))!r}]"], "medium", "text-processing", ["awk", "sum"])


def delete_glob(rng, words, exts):
    d, *stems = rng.sample(words, rng.randint(4, 6))
    ext, other = rng.sample(exts, 2)
    doomed, kept = stems[: len(stems) // 2], stems[len(stems) // 2:]
    files = {f"{d}/{s}.{ext}": f"{s}\n" for s in doomed} | {f"{d}/{s}.{other}": f"{s}\n" for s in kept}
    return Spec(f"Delete every `.{ext}` file in the directory `{d}`; leave the other files alone.", files,
                [f"rm {d}/*.{ext}"], [f"sorted(os.listdir({d!r})) == {sorted(f'{s}.{other}' for s in kept)!r}"],
                tags=["rm", "glob"])


def concat_files(rng, words, exts):
    *parts, out = rng.sample(words, 4)
    vocab = [w for w in words if w not in parts and w != out]
    contents = {p: _lines(rng, vocab, rng.randint(1, 3), (1, 3)) for p in parts}
    names = [f"{p}.txt" for p in parts]
    return Spec(f"Concatenate `{names[0]}`, `{names[1]}` and `{names[2]}`, in that order, into `{out}.txt`.",
                {f"{p}.txt": _text(c) for p, c in contents.items()}, [f"cat {' '.join(names)} > {out}.txt"],
                [f"lines({out + '.txt'!r}) == {[x for p in parts for x in contents[p]]!r}"], tags=["cat"])


def uppercase(rng, words, exts):
    src, out, *vocab = rng.sample(words, 8)
    lines = _lines(rng, vocab, rng.randint(2, 4), (1, 4))
    return Spec(f"Write the contents of `{src}.txt` converted to uppercase to `{out}.txt`.",
                {f"{src}.txt": _text(lines)}, [f"tr a-z A-Z < {src}.txt > {out}.txt"],
                [f"lines({out + '.txt'!r}) == {[x.upper() for x in lines]!r}"], category="text-processing",
                tags=["tr", "case"])


def _slice_task(rng, words, which: str):
    src, out = rng.sample(words, 2)
    lines = _lines(rng, [w for w in words if w not in (src, out)], rng.randint(5, 9), (1, 3))
    n = rng.randint(2, len(lines) - 2)
    want = lines[:n] if which == "first" else lines[-n:]
    cmd = "head" if which == "first" else "tail"
    return Spec(f"Write the {which} {n} lines of `{src}.txt` to `{out}.txt`.", {f"{src}.txt": _text(lines)},
                [f"{cmd} -n {n} {src}.txt > {out}.txt"], [f"lines({out + '.txt'!r}) == {want!r}"],
                category="text-processing", tags=[cmd])


def head_lines(rng, words, exts):
    return _slice_task(rng, words, "first")


def tail_lines(rng, words, exts):
    return _slice_task(rng, words, "last")


def count_files(rng, words, exts):
    d, out, *stems = rng.sample(words, rng.randint(5, 8))
    ext, other = rng.sample(exts, 2)
    k = rng.randint(1, len(stems) - 1)
    files = {f"{d}/{s}.{ext if i < k else other}": f"{s}\n" for i, s in enumerate(stems)}
    return Spec(f"Write the number of `.{ext}` files in the directory `{d}` to `{out}.txt`.", files,
                [f"ls {d}/*.{ext} | wc -l > {out}.txt"], [f"lines({out + '.txt'!r}) == [{str(k)!r}]"],
                "medium", tags=["ls", "wc", "count"])


def unique_sorted(rng, words, exts):
    src, out, *vocab = rng.sample(words, rng.randint(5, 7))
    items = vocab + rng.choices(vocab, k=rng.randint(2, 4))  # some lines twice
    rng.shuffle(items)
    return Spec(f"Write the distinct lines of `{src}.txt`, sorted alphabetically, to `{out}.txt`.",
                {f"{src}.txt": _text(items)}, [f"sort -u {src}.txt > {out}.txt"],
                [f"lines({out + '.txt'!r}) == {sorted(set(items))!r}"], "medium", "text-processing",
                ["sort", "uniq"])


FAMILIES: dict[str, Callable[[random.Random, list[str], list[str]], Spec]] = {
    f.__name__: f for f in (create_file, make_dirs, chmod_x, count_matches, count_words, sort_lines, replace_word,
                            rename_ext, csv_column, sum_numbers, delete_glob, concat_files, uppercase, head_lines,
                            tail_lines, count_files, unique_sorted)
}
SPLIT_FAMILIES = {"train": [f for f in FAMILIES if f not in HELDOUT_ONLY], "heldout": list(FAMILIES)}


# -- writing a task folder -------------------------------------------------------------------------------

DOCKERFILE = "FROM python:3.12-slim\nWORKDIR /app\nCOPY . /app\n"  # python3 for test.sh; /app is the cwd

_TEST_SH = """#!/bin/bash
# Verifier for {task_id} ({family}). Paths are relative to the working directory: Harbor runs
# `bash /tests/test.sh` in the container, whose WORKDIR is /app; tsrl runs it locally with the
# agent's copy of environment/ as cwd. python3 -I (isolated mode) keeps files the agent left in
# the cwd from shadowing the standard library.
mkdir -p /logs/verifier
if python3 -I - <<'CHECK'
import os, sys
from pathlib import Path


def lines(path):
    \"\"\"The file's lines, each stripped of surrounding blanks, without trailing empty lines.\"\"\"
    out = [x.strip() for x in Path(path).read_text().splitlines()]
    while out and not out[-1]:
        out.pop()
    return out


try:
    ok = all([
{checks}
    ])
except (OSError, UnicodeDecodeError) as e:
    print(f"check failed: {{e}}", file=sys.stderr)
    ok = False
sys.exit(0 if ok else 1)
CHECK
then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt
fi
"""

_SOLVE_SH = """#!/bin/bash
# Reference solution for {task_id}; runs from the working directory (Docker: /app).
set -e
{commands}
"""


def _task_toml(spec: Spec, family: str, split: str, seed: int) -> str:
    tags = ", ".join(f'"{t}"' for t in ["bash", *spec.tags])
    return f"""version = "1.0"

[metadata]
author_name = "tsrl embedded generator"
difficulty = "{spec.difficulty}"
category = "{spec.category}"
tags = [{tags}]
family = "{family}"
split = "{split}"
seed = {seed}

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 300.0
cpus = 1
memory_mb = 512
storage_mb = 1024
allow_internet = false
"""


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def write_task(task_dir: Path, spec: Spec, *, family: str, split: str, seed: int) -> None:
    """One Harbor task folder (task_dir must not exist)."""
    task_id = task_dir.name
    task_dir.mkdir(parents=True)
    _write(task_dir / "task.toml", _task_toml(spec, family, split, seed))
    _write(task_dir / "instruction.md", spec.instruction + "\n")
    _write(task_dir / "environment" / "Dockerfile", DOCKERFILE)
    for rel, text in spec.files.items():
        _write(task_dir / "environment" / rel, text)
    checks = "\n".join(f"        {c}," for c in spec.check)
    _write(task_dir / "tests" / "test.sh", _TEST_SH.format(task_id=task_id, family=family, checks=checks), 0o755)
    _write(task_dir / "solution" / "solve.sh",
           _SOLVE_SH.format(task_id=task_id, commands="\n".join(spec.solution)), 0o755)


def solution_commands(task_dir: Path) -> list[str]:
    """The commands of solution/solve.sh, one per agent turn (for demonstrations): comments and `set -e` dropped."""
    lines = (task_dir / "solution" / "solve.sh").read_text().splitlines()
    return [x for x in lines if x.strip() and not x.startswith("#") and x.strip() != "set -e"]


# -- validation -------------------------------------------------------------------------------------------

def reward_trace(task_dir: Path, commands: list[str], timeout_s: float = 30.0) -> list[float]:
    """test.sh's reward on a fresh copy of environment/, then after each command (bash, run in that copy).

    As a tsrl verifier runs it: in the local sandbox, with tests/ mounted read-only at /tests and a
    fresh host folder read-write at /logs/verifier, both shown to the test command only. Where
    this machine has no sandbox isolation (IsolationError: neither bwrap nor unshare), plain
    subprocesses instead (_trace_unsandboxed).
    """
    try:
        sandbox = open_sandbox(task_dir / "environment")
    except IsolationError:
        return _trace_unsandboxed(task_dir, commands, timeout_s)
    rewards = []
    with sandbox, tempfile.TemporaryDirectory(prefix="tsrl-term-") as tmp:
        for i, command in enumerate([None, *commands]):
            if command is not None:
                sandbox.run(command, timeout_s)
            logs = Path(tmp) / f"logs{i}"
            logs.mkdir()
            sandbox.run("bash /tests/test.sh", timeout_s, mounts=[
                Mount(str(task_dir / "tests"), "/tests"), Mount(str(logs), "/logs/verifier", read_only=False)])
            rewards.append(_read_reward(logs / "reward.txt"))
    return rewards


def _trace_unsandboxed(task_dir: Path, commands: list[str], timeout_s: float) -> list[float]:
    """reward_trace with plain subprocesses and /logs/verifier in test.sh rewritten to a temporary folder.

    Only for machines without isolation, and only sound because the commands are this generator's
    own (solve.sh, tests): never use it for agent-written commands.
    """
    rewards = []
    with tempfile.TemporaryDirectory(prefix="tsrl-term-") as tmp:
        work = Path(tmp) / "work"
        shutil.copytree(task_dir / "environment", work)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmp}
        for i, command in enumerate([None, *commands]):
            if command is not None:
                subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, timeout=timeout_s,
                               check=False)
            logs = Path(tmp) / f"logs{i}"
            test = (task_dir / "tests" / "test.sh").read_text().replace("/logs/verifier", str(logs))
            subprocess.run(["bash", "-c", test], cwd=work, env=env, capture_output=True, timeout=timeout_s,
                           check=False)
            rewards.append(_read_reward(logs / "reward.txt"))
    return rewards


def _read_reward(path: Path) -> float:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return float("nan")  # no reward written: neither 0 nor 1, so validation fails loudly


def reward_after(task_dir: Path, command: str) -> float:
    """test.sh's reward after one command on a fresh copy of environment/."""
    return reward_trace(task_dir, [command])[-1]


def validate_task(task_dir: Path) -> tuple[float, float]:
    """(reward of the untouched start state, reward after solution/solve.sh); a valid task gives (0, 1).

    One working copy: the test reads files and writes only under /logs/verifier, so checking the
    start state first leaves it as it was for solve.sh.
    """
    before, after = reward_trace(task_dir, [(task_dir / "solution" / "solve.sh").read_text()])
    return before, after


# -- the suite ---------------------------------------------------------------------------------------------

def generate_specs(seed: int, split: str, n: int) -> list[tuple[str, str, Spec]]:
    """(task_id, family, spec) for `n` tasks of `split`, families in round robin.

    Task j is family j % F, instance j // F, drawn from its own RNG: asking for more tasks keeps the
    first ones unchanged. An instruction already drawn in this split is redrawn, so no two tasks read
    the same (`tsrl prepare-data` dedupes terminal tasks by instruction).
    """
    families = SPLIT_FAMILIES[split]
    words, exts = POOLS[split], EXTS[split]
    out, seen = [], set()
    for j in range(n):
        family = families[j % len(families)]
        idx = j // len(families)
        rng = random.Random(f"tsrl-terminal:{seed}:{split}:{family}:{idx}")
        spec = FAMILIES[family](rng, words, exts)
        while spec.instruction in seen:
            spec = FAMILIES[family](rng, words, exts)
        seen.add(spec.instruction)
        out.append((f"{family.replace('_', '-')}-{split[0]}{idx:03d}", family, spec))
    return out


def build_terminal_suite(out_dir: Path, seed: int = 0, n_train: int = 120, n_heldout: int = 30,
                         progress: Callable[[str], None] = lambda msg: None) -> dict[str, list[Path]]:
    """Write and validate out_dir/terminal/{train,heldout}/<task_id>/; returns the task folders per split.

    Earlier contents of those two folders are removed first, so a rebuild never mixes suites.
    Raises RuntimeError naming the task when a task does not give reward 0 before and 1 after solve.sh.
    """
    dirs: dict[str, list[Path]] = {}
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        root = Path(out_dir) / "terminal" / split
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        dirs[split] = []
        for task_id, family, spec in generate_specs(seed, split, n):
            write_task(root / task_id, spec, family=family, split=split, seed=seed)
            dirs[split].append(root / task_id)
        progress(f"terminal {split}: wrote {n} tasks")
    # Validation is sandbox start-ups and subprocesses, not Python: threads overlap them.
    todo = dirs["train"] + dirs["heldout"]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for k, (task_dir, rewards) in enumerate(zip(todo, pool.map(validate_task, todo), strict=True)):
            if rewards != (0.0, 1.0):
                raise RuntimeError(f"terminal task {task_dir.name}: reward {rewards[0]} before any action and "
                                   f"{rewards[1]} after solution/solve.sh (a valid task gives 0, then 1); "
                                   f"folder {task_dir}")
            if (k + 1) % 10 == 0 or k + 1 == len(todo):
                progress(f"terminal: validated {k + 1}/{len(todo)} tasks (0 before, 1 after solve.sh)")
    return dirs
