"""Atomic writes: a reader (or a resumed run) sees the old file or the new one, never half of one.

Every whole file and whole folder tsrl writes goes through here: the data is written to a
temporary name in the same folder (same filesystem, so the rename is atomic), flushed to disk,
then renamed over the target. If anything fails on the way, the temporary is removed and the
target is left exactly as it was.

    write_atomic(path, text_or_bytes)      a file
    write_json_atomic(path, obj)           a JSON document
    write_jsonl_atomic(path, rows)         JSON lines
    atomic_path(path)                      a temp path to hand to a writer that wants a file name
    atomic_dir(path)                       a temp folder; renamed over `path` (a folder) at the end

    file_sha256(path), tree_sha256(root)  content hashes (dataset manifests, task folders, policy weights)

Appending to a JSON-lines log (one whole line per write) is not a whole-file write and lives with
its reader (evals.runner.RecordLog, rl.runlog.RunLog; a run directory's readers: rundir.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path beside `path`; on a clean exit it is fsynced and renamed to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def write_json_atomic(path: str | Path, obj, *, indent: int | None = 1, sort_keys: bool = False) -> None:
    """One JSON document (ending with a newline); values json cannot encode are written as str."""
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, default=str) + "\n")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict], *, sort_keys: bool = False) -> None:
    """JSON lines, one object per line, replacing the whole file."""
    write_atomic(path, "".join(json.dumps(r, sort_keys=sort_keys, default=str) + "\n" for r in rows))


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; on a clean exit it replaces the folder `path`.

    The old folder (if any) is moved aside first and deleted only after the new one is in place;
    if the swap fails the old one is put back.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes 0700
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        try:
            tmp.rename(path)
        except BaseException:
            if old.exists() and not path.exists():
                old.rename(path)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(root: Path) -> str:
    """Hash of a directory: every file's relative path and bytes (symlinks by their target), sorted."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            h.update(f"L {rel} -> {os.readlink(p)}\n".encode())
        elif p.is_file():
            h.update(f"F {rel} {file_sha256(p)}\n".encode())
    return h.hexdigest()
