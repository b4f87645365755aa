"""`tsrl prepare-data` as a library function: load -> normalize -> filter -> separate -> write.

Every step appends (step, count) to the result, so a user sees where rows go. The output
directory is written under a temporary name and renamed into place with manifest.json last;
when the content hash equals the one in an existing manifest, nothing is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from fnmatch import fnmatch
from pathlib import Path

from tsrl_cli import __version__
from tsrl_cli.datasets import harbor
from tsrl_cli.datasets.records import (
    FORMAT,
    MANIFEST,
    FieldError,
    read_manifest,
    read_tasks,
    records_sha256,
    write_manifest,
    write_tasks,
)
from tsrl_cli.datasets.sources import Source, get_source, load_rows, load_task_root
from tsrl_cli.errors import UsageError
from tsrl_cli.files import atomic_dir, file_sha256

MAX_REPORTED = 20  # malformed inputs listed by name in the result and manifest; the rest are counted


@dataclass
class PrepareOptions:
    source: str
    origin: str = "hub"  # "hub" or a local path (--from)
    out: str | None = None  # default data/<source with - as _>
    nonempty_statement: bool = True
    languages: tuple[str, ...] = ()
    include: tuple[str, ...] = ()  # fnmatch patterns on upstream repo (repair) or task id (terminal)
    exclude: tuple[str, ...] = ()
    dedupe: bool | None = None  # None: on for training sets, off for evaluation sets
    limit: int | None = None
    eval_sets: tuple[str, ...] | None = None  # None: every prepared eval set next to --out
    keep_eval_repos: bool = False
    on_error: str | None = None  # "skip" | "fail"; None: fail for evaluation sets, skip for training sets


def default_out(source: str) -> Path:
    return Path("data") / source.replace("-", "_")


def prepare(opts: PrepareOptions, progress: Callable[[str], None] = lambda msg: None) -> dict:
    src = get_source(opts.source)
    on_error = opts.on_error or ("fail" if src.role == "eval" else "skip")
    dedupe = opts.dedupe if opts.dedupe is not None else src.role == "train"
    _check_options(opts, src, on_error)
    out = Path(opts.out) if opts.out else default_out(src.name)
    if out.exists() and not (out / MANIFEST).is_file() and (not out.is_dir() or any(out.iterdir())):
        # the old output is replaced wholesale: never do that to a folder tsrl did not write
        raise UsageError(f"--out {out}: exists and is not a prepared dataset; choose another folder")

    counts: list[list] = []

    def count(step: str, n: int) -> None:
        counts.append([step, n])
        progress(f"{step}: {n}")

    tasks, dirs, malformed, n_input, dataset_id, revision = _load_and_normalize(src, opts.origin, on_error, progress)
    count("input", n_input)
    count("valid", len(tasks))

    if src.kind == "repair" and opts.nonempty_statement:
        tasks = [t for t in tasks if t.problem_statement.strip()]
        count("non-empty problem statement", len(tasks))
    if opts.languages:
        langs = {lang.lower() for lang in opts.languages}
        tasks = [t for t in tasks if (t.language or "").lower() in langs]
        count(f"language {'|'.join(sorted(langs))}", len(tasks))
    if opts.include:
        tasks = [t for t in tasks if any(_matches(t, p) for p in opts.include)]
        count(f"include {' '.join(opts.include)}", len(tasks))
    if opts.exclude:
        tasks = [t for t in tasks if not any(_matches(t, p) for p in opts.exclude)]
        count(f"exclude {' '.join(opts.exclude)}", len(tasks))
    tasks, dup_ids = _unique_ids(tasks)
    if dup_ids:
        count("unique task ids", len(tasks))
    if dedupe:
        tasks = _dedupe_content(tasks)
        count("dedupe (same patch or instruction)", len(tasks))

    tasks, overlaps = _separate(tasks, src, out, opts)
    if src.role == "train" and overlaps["eval_sets"]:
        count("not in evaluation sets", len(tasks))
    elif src.role == "train":
        progress(f"warning: no prepared evaluation set next to {out} to keep out; prepare "
                 f"{'swebench-verified' if src.kind == 'repair' else 'terminal-bench'} first or pass --eval-set")
    if opts.limit is not None:
        tasks = tasks[: opts.limit]
        count(f"limit {opts.limit}", len(tasks))
    if not tasks:
        first = f"; first malformed: {malformed[0]['message']}" if malformed else ""
        raise UsageError(f"{src.name}: no tasks left after the filters ({_fmt_counts(counts)}){first}")

    filters = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts).items()
               if k not in ("source", "origin", "out")}
    filters.update(on_error=on_error, dedupe=dedupe)
    # the content hash covers the records (task dirs through dir_sha256), every option and, for a
    # training set, the evaluation sets it was separated from (a re-prepared evaluation set makes it
    # stale). An evaluation set's report on training sets is informational and stays out of its
    # hash: the two would otherwise depend on each other and never settle.
    against = overlaps["set_sha256"] if src.role == "train" else []
    content = hashlib.sha256((records_sha256(tasks) + json.dumps(filters, sort_keys=True)
                              + json.dumps(against)).encode()).hexdigest()
    result = {
        "out": str(out), "source": src.name, "kind": src.kind, "role": src.role, "split": src.split,
        "dataset_id": dataset_id, "source_revision": revision, "counts": counts, "written": len(tasks),
        "malformed": {"count": len(malformed), "first": malformed[:MAX_REPORTED]},
        "duplicate_ids": dup_ids[:MAX_REPORTED],
        "overlaps": overlaps, "filters": filters, "content_sha256": content,
    }
    if _up_to_date(out, content):
        progress(f"{out}: unchanged (content sha256 {content[:12]}), nothing written")
        return {**result, "unchanged": True}
    _write(out, src, tasks, dirs, result, progress)
    return {**result, "unchanged": False}


def _check_options(opts: PrepareOptions, src: Source, on_error: str) -> None:
    if on_error not in ("skip", "fail"):
        raise UsageError(f"--on-error {on_error!r}: choose skip or fail")
    if opts.languages and src.kind != "repair":
        raise UsageError(f"--language applies to repair tasks (swe-smith, swebench-verified), not {src.name}")
    if opts.limit is not None and opts.limit < 1:
        raise UsageError(f"--limit {opts.limit}: must be at least 1")


def _load_and_normalize(src: Source, origin: str, on_error: str, progress):
    """(tasks, {task_id: source dir}, malformed, number of inputs, dataset id, revision)."""
    tasks, dirs, malformed, n = [], {}, [], 0

    def bad(where: str, ident: str | None, e: FieldError) -> None:
        msg = f"{where}{f' ({ident})' if ident else ''}: {e}"
        if on_error == "fail":
            raise UsageError(f"{msg} (pass --on-error skip to drop malformed inputs)")
        malformed.append({"where": where, "id": ident, "field": e.field, "message": msg})

    if src.kind == "repair":
        rows, dataset_id, revision = load_rows(src, origin)
        progress(f"reading {dataset_id} (revision {revision[:19]})")
        for where, row in rows:
            n += 1
            if n % 10_000 == 0:
                progress(f"normalized {n} rows")
            if isinstance(row, FieldError):
                bad(where, None, row)
                continue
            try:
                task = src.normalize(row, src.split)
                tasks.append(task)
                if task.start_dir and origin != "hub":  # a local start state, relative to the rows
                    base = Path(origin) if Path(origin).is_dir() else Path(origin).parent
                    dirs.setdefault(task.task_id, base / task.start_dir)
            except FieldError as e:
                ident = row.get("instance_id")
                bad(where, ident if isinstance(ident, str) else None, e)
        return tasks, dirs, malformed, n, dataset_id, revision

    root, dataset_id, revision = load_task_root(src, origin)
    progress(f"reading task directories under {root}")
    for d in harbor.find_task_dirs(root):
        n += 1
        rel = d.relative_to(root).as_posix() if d != root else d.name
        try:
            task = harbor.read_task_dir(d, source=src.name, split=src.split, rel=rel)
        except FieldError as e:
            bad(str(d), d.name, e)
            continue
        tasks.append(task)
        dirs.setdefault(task.task_id, d)
    return tasks, dirs, malformed, n, dataset_id, revision


def _matches(task, pattern: str) -> bool:
    keys = (task.upstream_repo, task.repo) if task.kind == "repair" else (task.task_id,)
    return any(fnmatch(k, pattern) for k in keys)


def _unique_ids(tasks: list) -> tuple[list, list[str]]:
    seen, out, dups = set(), [], []
    for t in tasks:
        if t.task_id in seen:
            dups.append(t.task_id)
        else:
            seen.add(t.task_id)
            out.append(t)
    return out, dups


def _content_key(task) -> str:
    if task.kind == "repair":
        text = f"{task.upstream_repo}\n{task.bug_patch or task.gold_patch}"
    else:
        text = " ".join(task.instruction.split())
    return hashlib.sha256(text.encode()).hexdigest()


def _dedupe_content(tasks: list) -> list:
    seen, out = set(), []
    for t in tasks:
        k = _content_key(t)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def _find_sets(out: Path, kind: str, role: str, given: tuple[str, ...] | None) -> list[tuple[Path, dict]]:
    """Prepared datasets of `kind` and `role`: the given ones, else every sibling of out."""
    if given is not None:
        found = []
        for g in given:
            m = read_manifest(Path(g))
            if m["kind"] != kind:
                raise UsageError(f"--eval-set {g}: holds {m['kind']} tasks, this source has {kind} tasks")
            found.append((Path(g), m))
        return found
    if not out.parent.is_dir():
        return []
    found = []
    for d in sorted(out.parent.iterdir()):
        if d.resolve() != out.resolve() and (d / MANIFEST).is_file():
            try:
                m = read_manifest(d)
            except UsageError:
                continue
            if m.get("kind") == kind and m.get("role") == role:
                found.append((d, m))
    return found


def _separate(tasks: list, src: Source, out: Path, opts: PrepareOptions) -> tuple[list, dict]:
    """(kept tasks, overlap report). Training sets: drop eval instances, and eval repos unless
    keep_eval_repos. Evaluation sets: report the overlap with training sets, drop nothing."""
    other_role = "eval" if src.role == "train" else "train"
    sets = _find_sets(out, src.kind, other_role, opts.eval_sets if src.role == "train" else None)
    ids, repos, keys = set(), set(), set()
    for d, m in sets:
        for t in read_tasks(d / m["file"], m["kind"]):
            ids.add(t.task_id)
            keys.add(_content_key(t))
            if t.kind == "repair":
                repos.add(t.upstream_repo.lower())
    same_instance = [t for t in tasks if t.task_id in ids or _content_key(t) in keys]
    same_repo = [t for t in tasks if t.kind == "repair" and t.upstream_repo.lower() in repos]
    drop_repos = src.role == "train" and not opts.keep_eval_repos
    drop = {id(t) for t in same_instance} | ({id(t) for t in same_repo} if drop_repos else set())
    kept = [t for t in tasks if id(t) not in drop] if src.role == "train" else tasks
    return kept, {
        "eval_sets" if src.role == "train" else "train_sets": [str(d) for d, _ in sets],
        "set_sha256": [m.get("content_sha256") for _, m in sets],
        "same_instance": len(same_instance),
        "same_repo": len(same_repo),
        "repos": sorted({t.upstream_repo for t in same_repo}),
        "removed": len(tasks) - len(kept),
    }


def _up_to_date(out: Path, content: str) -> bool:
    try:
        m = read_manifest(out)
    except UsageError:
        return False
    if m.get("content_sha256") != content:
        return False
    if m["kind"] == "terminal" and len(list((out / "tasks").glob("*"))) != m["written"]:
        return False  # task directories removed by hand: write again
    return all((out / name).is_file() and file_sha256(out / name) == sha for name, sha in m["files"].items())


def _write(out: Path, src: Source, tasks: list, dirs: dict, result: dict, progress) -> None:
    with atomic_dir(out) as tmp:
        fname = f"{src.split}.parquet"
        write_tasks(tmp / fname, tasks, src.kind)
        files = {fname: file_sha256(tmp / fname)}
        copied = 0
        for t in tasks:  # terminal task folders; repair start states that live on disk
            rel = t.task_dir if src.kind == "terminal" else t.start_dir
            if rel and t.task_id in dirs:
                if not Path(dirs[t.task_id]).is_dir():
                    raise UsageError(f"task {t.task_id}: start folder {dirs[t.task_id]} does not exist")
                shutil.copytree(dirs[t.task_id], tmp / rel, symlinks=True)
                copied += 1
        if copied:
            progress(f"copied {copied} task directories")
        manifest = {
            "format": FORMAT, "file": fname, "files": files, "tsrl_version": __version__,
            "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            **{k: v for k, v in result.items() if k != "out"},
        }
        write_manifest(tmp, manifest)  # last: a directory without it is incomplete
    progress(f"wrote {len(tasks)} task(s) to {out}")


def _fmt_counts(counts: list) -> str:
    return ", ".join(f"{s}: {n}" for s, n in counts)
