"""`tsrl data show` and `tsrl data check`: read a prepared dataset back and validate it."""

from __future__ import annotations

from pathlib import Path

from tsrl_cli.datasets.records import load_dataset_dir, read_manifest
from tsrl_cli.datasets.store import resolve
from tsrl_cli.errors import UsageError
from tsrl_cli.files import file_sha256, tree_sha256


def show(name: str, rows: int = 3) -> dict:
    d = resolve(name)
    m, tasks = load_dataset_dir(d)
    return {"path": str(d), "manifest": m, "num_tasks": len(tasks), "rows": [_summary(t) for t in tasks[:rows]]}


def check(name: str) -> dict:
    """Problems found (file hashes, schema, required fields, unique ids, terminal task dirs); ok when none."""
    d = resolve(name)
    m = read_manifest(d)
    problems = [f"{f}: sha256 differs from the manifest" for f, sha in m["files"].items()
                if not (d / f).is_file() or file_sha256(d / f) != sha]
    try:
        _, tasks = load_dataset_dir(d)
    except UsageError as e:
        return {"path": str(d), "ok": False, "num_tasks": 0, "problems": [*problems, str(e)]}
    if len(tasks) != m["written"]:
        problems.append(f"{m['file']}: {len(tasks)} rows, the manifest says {m['written']}")
    seen = set()
    for t in tasks:
        if t.task_id in seen:
            problems.append(f"{t.task_id}: duplicate task_id")
        seen.add(t.task_id)
        problems += [f"{t.task_id}: {p}" for p in _record_problems(t, m, d)]
    return {"path": str(d), "ok": not problems, "num_tasks": len(tasks), "problems": problems}


def _record_problems(t, m: dict, d: Path) -> list[str]:
    out = []
    if t.source != m["source"] or t.split != m["split"]:
        out.append(f"source/split {t.source}/{t.split}, the manifest says {m['source']}/{m['split']}")
    if t.kind == "repair":
        for f in ("repo", "upstream_repo", "base_ref", "image"):
            if not getattr(t, f):
                out.append(f"{f}: empty")
        if not t.fail_to_pass:
            out.append("fail_to_pass: empty")
        if not (t.gold_patch or t.bug_patch):
            out.append("no gold_patch and no bug_patch")
        if t.start_dir and not (d / t.start_dir).is_dir():
            out.append(f"{t.start_dir}: missing")
        return out
    if not t.instruction.strip():
        out.append("instruction: empty")
    if (p := _task_dir_problem(d / t.task_dir, t)) is not None:
        out.append(p)
    return out


def _task_dir_problem(d: Path, t) -> str | None:
    if not d.is_dir():
        return f"{t.task_dir}: missing"
    for rel in (t.environment_dir, t.test_script):
        if not (d / rel).exists():
            return f"{t.task_dir}/{rel}: missing"
    if tree_sha256(d) != t.dir_sha256:
        return f"{t.task_dir}: content differs from dir_sha256"
    return None


def _summary(t) -> dict:
    if t.kind == "repair":
        return {"task_id": t.task_id, "repo": t.upstream_repo, "language": t.language, "image": t.image,
                "fail_to_pass": len(t.fail_to_pass), "pass_to_pass": len(t.pass_to_pass),
                "problem_statement": _clip(t.problem_statement)}
    return {"task_id": t.task_id, "format": t.format, "docker_image": t.docker_image,
            "agent_timeout_s": t.agent_timeout_s, "instruction": _clip(t.instruction)}


def _clip(text: str, n: int = 100) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"
