"""Repair tasks made the SWE-smith way from the small repositories in data/embedded_src/repos/.

For each repository: list one-line bugs with `ast` (operator swaps, off-by-one, flipped
comparisons, wrong constants, removed branches, swapped arguments, negated conditions), run the
repository's pytest suite on each, and keep a bug when at least one test goes from pass to fail
(FAIL_TO_PASS); the tests that still pass are PASS_TO_PASS. Each kept task's start state (the
repository with the bug in place) is written to out_dir/repair/<task_id>/. Whole repositories are
held out, so no held-out task shares a module with a training task.

    from tsrl_cli.embedded.repair_suite import build_repair_suite
    tasks = build_repair_suite(Path("data/embedded"), seed=0, progress=print)  # {"train": [...], "heldout": [...]}

A bug is rendered by editing only its line of the original text (never `ast.unparse` of the whole
file), so every bug patch and gold patch is a one-line unified diff.
"""

from __future__ import annotations

import ast
import difflib
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tsrl_cli.agent.rewards import parse_pytest_log
from tsrl_cli.datasets.records import RepairTask

SRC_DIR = Path(__file__).resolve().parents[2] / "data" / "embedded_src" / "repos"
HELDOUT_REPOS = ("graphs", "money")  # whole repositories: no held-out module is ever seen in training
KINDS = ("swap_operator", "swap_operands", "flip_comparison", "off_by_one", "wrong_constant",
         "remove_branch", "remove_early_return", "swap_arguments", "negate_condition", "swap_boolean")

_BINOP_SWAP = {ast.Add: "-", ast.Sub: "+", ast.Mult: "+", ast.FloorDiv: "%", ast.Mod: "//", ast.Div: "*",
               ast.Pow: "*"}
_BINOP_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%", ast.Div: "/",
               ast.Pow: "**"}
_CMP_FLIP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
             ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"),
             ast.IsNot: ("is not", "is"), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}
_NON_COMMUTATIVE = (ast.Sub, ast.FloorDiv, ast.Mod, ast.Div, ast.Pow)
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclass(frozen=True)
class Mutation:
    """One change to one line of one source file."""

    file: str  # relative to the repository root
    line: int  # 1-based
    kind: str
    function: str  # qualified name of the enclosing function, "<module>" outside any
    old_line: str  # without the newline
    new_line: str


# ---------------------------------------------------------------------------------------------
# Listing bugs


def _functions(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and method."""
    spans = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                spans.append((child.lineno, child.end_lineno, prefix + child.name))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return spans


def _enclosing(spans, line: int) -> str:
    inside = [s for s in spans if s[0] <= line <= s[1]]
    return max(inside)[2] if inside else "<module>"


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the Constant nodes that are docstrings (never mutated)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _atom(text: str, node: ast.AST) -> str:
    """Text of a node, parenthesized unless it binds tighter than any operator."""
    simple = isinstance(node, ast.Name | ast.Constant | ast.Attribute | ast.Call | ast.Subscript)
    return text if simple else f"({text})"


def list_mutations(source: str, file: str) -> list[Mutation]:
    """Every candidate one-line bug in `source`, in source order, each still valid Python.

    Edits are byte-column splices on one line (ast columns are UTF-8 byte offsets).
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    spans = _functions(tree)
    docs = _docstrings(tree)
    original = ast.dump(tree)
    edits: list[tuple[int, int, int, str, str]] = []  # (line, start col, end col, replacement, kind)

    def seg(node) -> str | None:
        """Source text of a node that fits on one line, else None."""
        if node.lineno != node.end_lineno:
            return None
        return lines[node.lineno - 1].encode()[node.col_offset:node.end_col_offset].decode()

    def between(left, right, op_text, new_text, kind):
        """Replace the operator written between two nodes on one line."""
        if left.end_lineno != right.lineno:
            return
        raw = lines[left.end_lineno - 1].encode()
        gap = raw[left.end_col_offset:right.col_offset].decode()
        pos = gap.find(op_text)
        if pos < 0:
            return
        start = left.end_col_offset + len(gap[:pos].encode())
        edits.append((left.end_lineno, start, start + len(op_text.encode()), new_text, kind))

    def replace(node, text, kind):
        if node.lineno == node.end_lineno:
            edits.append((node.lineno, node.col_offset, node.end_col_offset, text, kind))

    str_consts: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            str_consts.setdefault(_enclosing(spans, node.lineno), []).append(node.value)

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
            is_format = isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant | ast.JoinedStr)
            if not is_format:
                between(node.left, node.right, _BINOP_TEXT[type(node.op)], _BINOP_SWAP[type(node.op)], "swap_operator")
            left, right = seg(node.left), seg(node.right)
            if isinstance(node.op, _NON_COMMUTATIVE) and not is_format and left and right:
                op = _BINOP_TEXT[type(node.op)]
                replace(node, f"{_atom(right, node.right)} {op} {_atom(left, node.left)}", "swap_operands")
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAP:
            between(node.target, node.value, _BINOP_TEXT[type(node.op)] + "=", _BINOP_SWAP[type(node.op)] + "=",
                    "swap_operator")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                old, new = _CMP_FLIP[type(op)]
                between(operands[i], operands[i + 1], old, new, "flip_comparison")
        elif isinstance(node, ast.Constant) and id(node) not in docs:
            v = node.value
            if isinstance(v, bool):
                replace(node, str(not v), "wrong_constant")
            elif isinstance(v, int):
                replace(node, str(v + 1), "off_by_one")
                replace(node, str(v - 1), "off_by_one")
                if abs(v) >= 2:
                    replace(node, str(v * 10), "wrong_constant")
            elif isinstance(v, str) and 0 < len(v) <= 12:
                text = seg(node)
                others = sorted(set(str_consts.get(_enclosing(spans, node.lineno), [])) - {v})
                if text and text[0] in "\"'" and others and v.isprintable() and "\\" not in text:
                    new = others[(sorted(set(str_consts[_enclosing(spans, node.lineno)])).index(v)) % len(others)]
                    if new.isprintable() and "\\" not in new and '"' not in new and "'" not in new:
                        replace(node, text[0] + new + text[0], "wrong_constant")
        elif isinstance(node, ast.Call):
            positional = [a for a in node.args if not isinstance(a, ast.Starred)]
            if isinstance(node.func, ast.Name) and node.func.id == "range" and node.args:
                stop = node.args[1] if len(node.args) >= 2 else node.args[0]
                text = seg(stop)
                if text and not isinstance(stop, ast.Constant):
                    replace(stop, f"{_atom(text, stop)} + 1", "off_by_one")
                    replace(stop, f"{_atom(text, stop)} - 1", "off_by_one")
            if len(positional) == len(node.args) >= 2:
                a, b = seg(node.args[0]), seg(node.args[1])
                if a and b and a != b and node.args[0].lineno == node.args[1].lineno:
                    line = node.args[0].lineno
                    raw = lines[line - 1].encode()
                    mid = raw[node.args[0].end_col_offset:node.args[1].col_offset].decode()
                    edits.append((line, node.args[0].col_offset, node.args[1].end_col_offset, b + mid + a,
                                  "swap_arguments"))
        elif isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper):
                text = seg(bound) if bound is not None else None
                if text and isinstance(bound, ast.Name):
                    replace(bound, f"{text} + 1", "off_by_one")
                    replace(bound, f"{text} - 1", "off_by_one")
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            between(node.values[0], node.values[1], old, new, "swap_boolean")
        if isinstance(node, ast.If | ast.While | ast.IfExp):
            text = seg(node.test)
            # `not a == b` / `not x in y` is what flip_comparison already makes, written oddly
            covered = (isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                       and isinstance(node.test.ops[0], ast.Eq | ast.NotEq | ast.In | ast.NotIn | ast.Is | ast.IsNot))
            if text and not covered:
                if isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not):
                    inner = seg(node.test.operand)
                    if inner:
                        replace(node.test, inner, "negate_condition")
                else:
                    wrapped = f"({text})" if isinstance(node.test, ast.BoolOp | ast.IfExp | ast.NamedExpr) else text
                    replace(node.test, f"not {wrapped}", "negate_condition")
        if isinstance(node, ast.If) and len(node.body) == 1:
            stmt = node.body[0]
            one_line = stmt.lineno == stmt.end_lineno and stmt.lineno != node.test.end_lineno
            if one_line and not isinstance(stmt, ast.Pass):
                replace(stmt, "pass", "remove_early_return" if isinstance(stmt, _EXITS) else "remove_branch")

    out, seen = [], set()
    for line, c0, c1, text, kind in sorted(edits, key=lambda e: (e[0], e[1], e[2], e[4], e[3])):
        raw = lines[line - 1].encode()
        new_line = (raw[:c0] + text.encode() + raw[c1:]).decode()
        if new_line == lines[line - 1] or (line, new_line) in seen:
            continue
        new_source = "\n".join(lines[: line - 1] + [new_line] + lines[line:]) + "\n"
        try:
            if ast.dump(ast.parse(new_source)) == original:
                continue
        except SyntaxError:
            continue
        seen.add((line, new_line))
        out.append(Mutation(file, line, kind, _enclosing(spans, line), lines[line - 1], new_line))
    return out


def apply_mutation(source: str, m: Mutation) -> str:
    lines = source.splitlines(keepends=True)
    assert lines[m.line - 1].rstrip("\n") == m.old_line, f"{m.file}:{m.line} changed"
    lines[m.line - 1] = m.new_line + "\n"
    return "".join(lines)


def unified_diff(old: str, new: str, path: str) -> str:
    """A git-style unified diff of one file (a/ and b/ paths), as `git apply` reads it."""
    body = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                fromfile=f"a/{path}", tofile=f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


# ---------------------------------------------------------------------------------------------
# Running a repository's tests


def _copy_repo(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc"))


# pytest under an address-space limit: a mutated loop that grows a list forever dies at 2 GiB
# instead of taking the machine; the wall-clock limit is subprocess's timeout.
# The budget is CPU seconds (RLIMIT_CPU), not wall seconds: which bugs are kept must not depend on
# how busy the machine is. A wall-clock budget of 4 s dropped different mutants under load and gave
# a different suite for the same seed (results/LOG.md, 2026-11-30).
_PYTEST = ("import resource, sys; import pytest; "
           "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
           "cpu = int(sys.argv.pop(1)); resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu)); "
           "sys.exit(pytest.main(sys.argv[1:]))")


def run_tests(repo: Path, timeout_s: float = 4.0) -> tuple[dict[str, str], str] | None:
    """(test id -> status, pytest output) for the whole suite in `repo`; None when it ran out of time.

    `timeout_s` is CPU seconds (a clean suite takes about 0.3); the wall clock only guards against a
    process that sleeps forever (30x the budget). Plugin autoload is off (0.2 s per run instead of
    1 s here) and no bytecode is written: two mutants of equal size written within one second would
    otherwise share a stale .pyc.
    """
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
    cpu = max(1, math.ceil(timeout_s))
    cmd = [sys.executable, "-c", _PYTEST, str(cpu), "-rA", "-q", "-p", "no:cacheprovider", "--tb=short"]
    try:
        res = subprocess.run(cmd, check=False, cwd=repo, env=env, capture_output=True, text=True,
                             timeout=30 * timeout_s)
    except subprocess.TimeoutExpired:
        return None
    if res.returncode < 0:  # killed by a signal: SIGXCPU (the CPU budget) or the memory cap
        return None
    return parse_pytest_log(res.stdout), res.stdout


def repo_names(src_dir: Path = SRC_DIR) -> list[str]:
    return sorted(p.name for p in src_dir.iterdir() if (p / "tests").is_dir())


def source_files(repo: Path) -> list[str]:
    """Non-test Python files of a repository, relative, sorted."""
    rels = [p.relative_to(repo) for p in repo.rglob("*.py")]
    return sorted(r.as_posix() for r in rels if not {"tests", "__pycache__"} & set(r.parts) and r.name != "conftest.py")


# ---------------------------------------------------------------------------------------------
# Problem statements from the failing tests' output

_SECTION = re.compile(r"^_{3,} (\S+) _{3,}$")
_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")  # object addresses differ between runs: never in a record


def _failure_lines(output: str) -> dict[str, list[str]]:
    """test function name -> its `E   ` lines (pytest --tb=short)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        m = _SECTION.match(line)
        if m:
            current = m.group(1)
            out[current] = []
        elif current and line.startswith("E "):
            out[current].append(line[1:].strip())
    return out


def _headline(test: str, e_lines: list[str], module: str) -> str | None:
    if not e_lines:
        return None
    first = _ADDR.sub("", e_lines[0]).removeprefix("AssertionError: ")
    where = re.match(r"\+\s+where (.+?) = (.+)$", e_lines[1]) if len(e_lines) > 1 else None
    call = where.group(2) if where else None
    head = re.match(r"(\w+)\(", call) if call else None
    if head:  # a method call: pytest names the bound method on the next line ("where add = Money(150).add")
        bound = [m for m in (re.match(r"\+\s+where (\w+) = (.+)$", e) for e in e_lines[2:3]) if m]
        if bound and bound[0].group(1) == head.group(1):
            call = bound[0].group(2) + call[len(head.group(1)):]
        else:
            call = f"{module}.{call}"
    if call and ("object at" in call or "<" in call or len(call) > 100):
        call = None
    m = re.match(r"assert (.+?) (==|is) (.+)$", first)
    if m and call and where.group(1) == m.group(1) and m.group(1) != m.group(3):
        return f"`{call}` returns {m.group(1)}, expected {m.group(3)}."
    m = re.match(r"assert (not )?(.+)$", first)
    if m and call and where.group(1) == m.group(2) and " " not in m.group(2):
        return f"`{call}` returns {m.group(2)}, expected a {'false' if m.group(1) else 'true'} value."
    m = re.match(r"Failed: DID NOT RAISE (?:<class '([\w.]+)'>|([\w.]+))", first)  # pytest 8: the class name alone
    if m:
        return f"`{test}` expects {m.group(1) or m.group(2)} to be raised, but nothing is raised."
    if first.startswith("assert "):
        return f"`{test}` fails: `{first[:160]}`."
    return f"`{test}` fails with {first[:160]}"


def problem_statement(fail_to_pass: list[str], output: str, function: str, file: str) -> str:
    module = Path(file).stem
    failures = _failure_lines(output)
    headlines = [_headline(t.split("::")[-1], failures.get(t.split("::")[-1], []), module) for t in fail_to_pass]
    structured = [h for h in headlines if h and " returns " in h]
    headline = (structured or [h for h in headlines if h] or [None])[0]
    names = [t.split("::")[-1] for t in fail_to_pass]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    where = f"`{function}` in {file}" if function != "<module>" else f"module-level code of {file}"
    body = f"Failing tests: {shown}. They started failing after a recent change to {where}."
    return f"{headline}\n\n{body}" if headline else body


# ---------------------------------------------------------------------------------------------
# The suite


@dataclass
class _Result:
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    output: str


def _check(repo_dir: Path, m: Mutation, clean: set[str], timeout_s: float) -> _Result | None:
    """Run the suite with the bug in place; None unless some clean-passing test now fails."""
    with tempfile.TemporaryDirectory(prefix="tsrl-mut-") as tmp:
        work = Path(tmp) / "repo"
        _copy_repo(repo_dir, work)
        path = work / m.file
        path.write_text(apply_mutation(path.read_text(), m))
        ran = run_tests(work, timeout_s)
    if ran is None:
        return None
    status, output = ran
    f2p = [t for t in sorted(clean) if status.get(t) != "PASSED"]
    p2p = [t for t in sorted(clean) if status.get(t) == "PASSED"]
    return _Result(f2p, p2p, output) if f2p else None


def _interleave(groups: list[list]) -> list:
    """Round-robin over groups: the first of each, then the second of each, ..."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def _candidate_order(muts: list[Mutation], rng: random.Random) -> dict[str, list[Mutation]]:
    """Per function, candidates in a seeded order that alternates kinds (variety before volume)."""
    by_fn: dict[str, dict[str, list[Mutation]]] = {}
    for m in muts:
        by_fn.setdefault(m.function, {}).setdefault(m.kind, []).append(m)
    out = {}
    for fn in sorted(by_fn):
        kinds = sorted(by_fn[fn])
        rng.shuffle(kinds)
        groups = []
        for k in kinds:
            g = list(by_fn[fn][k])
            rng.shuffle(g)
            groups.append(g)
        out[fn] = _interleave(groups)
    return out


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _id_part(name: str) -> str:
    parts = [re.sub(r"[^A-Za-z0-9]+", "_", p).strip("_") or "x" for p in name.split(".")]
    return ".".join(parts)


def build_repair_suite(out_dir: Path, seed: int = 0, progress: Callable[[str], None] = lambda msg: None,
                       workers: int = 2, *, src_dir: Path = SRC_DIR, repos: list[str] | None = None,
                       heldout: tuple[str, ...] = HELDOUT_REPOS, max_per_repo: int = 40,
                       max_per_function: int = 4, tries_per_function: int | None = None,
                       timeout_s: float = 4.0) -> dict[str, list[RepairTask]]:
    """Build, validate and write the embedded repair suite; returns {"train": [...], "heldout": [...]}.

    Args:
        out_dir: dataset folder; start states go to out_dir/repair/<task_id>/ (that folder is replaced).
        seed: picks which candidate bugs are tried and kept; equal seeds give equal tasks.
        workers: test runs in parallel (each one pytest process).
        repos: repository names under src_dir (default: all); heldout: those that form the held-out split.
        max_per_repo, max_per_function: caps on kept tasks, so tasks spread over functions and kinds.
        tries_per_function: candidates tested per function (default 2 * max_per_function + 2).
        timeout_s: per test run; a bug that makes the suite hang or run this long is dropped.
    """
    t0 = time.monotonic()
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    names = sorted(repos) if repos is not None else repo_names(src_dir)
    tries = tries_per_function if tries_per_function is not None else 2 * max_per_function + 2

    clean: dict[str, set[str]] = {}
    order: dict[str, list[Mutation]] = {}
    for name in names:
        ran = run_tests(src_dir / name, timeout_s)
        if ran is None or not ran[0] or any(s != "PASSED" for s in ran[0].values()):
            raise RuntimeError(f"{name}: the clean repository's tests do not all pass")
        clean[name] = set(ran[0])
        muts = [m for f in source_files(src_dir / name)
                for m in list_mutations((src_dir / name / f).read_text(), f)]
        rng = random.Random(f"{seed}:{name}")
        per_fn = [ms[:tries] for ms in _candidate_order(muts, rng).values()]
        rng.shuffle(per_fn)
        order[name] = _interleave(per_fn)  # functions take turns, so a capped repo still spans them
        progress(f"{name}: {len(clean[name])} tests, {len(muts)} candidate bugs in {len(per_fn)} functions")

    # Test in waves, reading results in candidate order: which bugs are kept depends only on the seed
    # and on the test outcomes, never on which worker finished first. A repo stops at max_per_repo.
    kept: dict[str, list[tuple[Mutation, _Result]]] = {name: [] for name in names}
    pos = dict.fromkeys(names, 0)
    tested = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while True:
            wave = []
            for name in names:
                need = max_per_repo - len(kept[name])
                per_fn = _count(m.function for m, _ in kept[name])
                picked = 0
                while need > 0 and picked < min(8, 2 * need) and pos[name] < len(order[name]):
                    m = order[name][pos[name]]
                    pos[name] += 1
                    if per_fn.get(m.function, 0) < max_per_function:
                        wave.append((name, m))
                        picked += 1
            if not wave:
                break
            futures = [pool.submit(_check, src_dir / name, m, clean[name], timeout_s) for name, m in wave]
            for (name, m), fut in zip(wave, futures, strict=True):
                r = fut.result()
                per_fn = _count(k.function for k, _ in kept[name])
                if r is not None and len(kept[name]) < max_per_repo and per_fn.get(m.function, 0) < max_per_function:
                    kept[name].append((m, r))
            tested += len(wave)
            # "kept K/T": T is the most tasks the caps allow, so a TTY shows a bar
            progress(f"repair tasks kept {sum(map(len, kept.values()))}/{max_per_repo * len(names)} "
                     f"(tested {tested} candidate bugs, {time.monotonic() - t0:.0f} s)")

    repair_root = out_dir / "repair"
    if repair_root.exists():
        shutil.rmtree(repair_root)
    repair_root.mkdir(parents=True)
    suite: dict[str, list[RepairTask]] = {"train": [], "heldout": []}
    for name in names:
        split = "heldout" if name in heldout else "train"
        counters: dict[tuple[str, str], int] = {}
        for m, r in sorted(kept[name], key=lambda mr: (mr[0].file, mr[0].line, mr[0].kind, mr[0].new_line)):
            key = (_id_part(m.function), m.kind)
            counters[key] = counters.get(key, -1) + 1
            task_id = f"embedded__{name}__{key[0]}__{m.kind}__{counters[key]}"
            start = repair_root / task_id
            _copy_repo(src_dir / name, start)
            old = (src_dir / name / m.file).read_text()
            new = apply_mutation(old, m)
            (start / m.file).write_text(new)
            suite[split].append(RepairTask(
                task_id=task_id, source="embedded", split=split, repo=f"embedded/{name}",
                upstream_repo=f"embedded/{name}", base_ref="start_dir", ref_kind="local",
                bug_patch=unified_diff(old, new, m.file), gold_patch=unified_diff(new, old, m.file),
                test_patch=None, fail_to_pass=r.fail_to_pass, pass_to_pass=r.pass_to_pass, image="local",
                problem_statement=problem_statement(r.fail_to_pass, r.output, m.function, m.file),
                language="python", test_command=None, log_parser="pytest", start_dir=f"repair/{task_id}",
                meta={"mutation": m.kind, "file": m.file, "line": m.line, "function": m.function, "seed": seed},
            ))
        progress(f"{name}: kept {len(kept[name])} tasks ({split})")
    progress(f"repair suite: {len(suite['train'])} train, {len(suite['heldout'])} held-out tasks "
             f"in {time.monotonic() - t0:.0f} s")
    return suite
