"""What the repair verifier guards in a working copy, and how it puts those paths back.

Guarded: the test files (those of the FAIL_TO_PASS / PASS_TO_PASS ids) and everything under their
directories, every file that configures pytest or Python from inside the tree (GUARDED_NAMES, *.pth),
and bytecode caches. The local executor restores them in place (`secure_tree`); the docker executor
leaves them out of the agent's diff (`unguarded_diff`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

# files that configure pytest or Python from inside the tree: only the start state's count
GUARDED_NAMES = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
                 "usercustomize.py")


def test_files(test_ids: list[str]) -> list[str]:
    """Files named by pytest ids ("tests/test_x.py::test_y" -> "tests/test_x.py"), in order, unique."""
    seen: dict[str, None] = {}
    for t in test_ids:
        seen.setdefault(t.split("::", 1)[0], None)
    return list(seen)


SKIP_DIRS = {"__pycache__", ".pytest_cache"}


def test_dirs(files: list[str]) -> list[str]:
    """The directories holding the test files ("" for a test file at the root: only the file is guarded)."""
    return sorted({os.path.dirname(f) for f in files} - {""})


def _guarded(rel: str, dirs: list[str], files: list[str]) -> bool:
    name = os.path.basename(rel)
    return (name in GUARDED_NAMES or name.endswith(".pth") or rel in files
            or any(rel.startswith(d + "/") for d in dirs))


def _remove(p: Path) -> None:
    """Remove p whatever it is, without following a symlink."""
    if p.is_symlink() or not p.is_dir():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p)


def _place(root: Path, rel: str, src: Path) -> None:
    """Copy src to root/rel through real directories only: a symlink or file in the way is removed first."""
    cur = root
    for part in Path(rel).parts[:-1]:
        cur = cur / part
        if cur.is_symlink() or (cur.exists() and not cur.is_dir()):
            _remove(cur)
        if not cur.exists():
            cur.mkdir()
    dst = root / rel
    if os.path.lexists(dst):
        _remove(dst)
    shutil.copyfile(src, dst, follow_symlinks=False)


def secure_tree(workdir: Path, start: Path, files: list[str]) -> None:
    """Make the working copy's test files, pytest configuration and interpreter hooks the start state's.

    files: the test files (relative paths). Guarded: those files, everything under their directories,
    and every GUARDED_NAMES / *.pth file anywhere. A guarded path the start state lacks is removed; one
    it has is copied back. Bytecode caches go (a forged .pyc of an unchanged test would run instead of
    it). No symlink is followed: this runs on the host, on a tree the agent wrote.
    """
    dirs = test_dirs(files)
    keep = set()
    for dirpath, dirnames, filenames in os.walk(start):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), start)
            if _guarded(rel, dirs, files) and not os.path.islink(os.path.join(dirpath, name)):
                keep.add(rel)
    for dirpath, dirnames, filenames in os.walk(workdir):  # does not descend into symlinked directories
        here = Path(dirpath)
        for d in list(dirnames):
            p, rel = here / d, os.path.relpath(here / d, workdir)
            if d in SKIP_DIRS or (p.is_symlink() and (_guarded(rel, dirs, files) or rel in dirs)):
                _remove(p)
                dirnames.remove(d)
        for name in filenames:
            p, rel = here / name, os.path.relpath(here / name, workdir)
            if name.endswith(".pyc") or (_guarded(rel, dirs, files) and rel not in keep):
                _remove(p)
    for rel in sorted(keep):
        _place(workdir, rel, start / rel)


def tree_digest(root: Path) -> str:
    """sha256 over (relative path, content) of every file under root, caches skipped; links by target."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            p = Path(dirpath) / name
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def split_diff(names: list[str], diff: str) -> dict[str, str]:
    """{path: its part of the diff} for a `git diff --no-renames` and its `--name-only` list, in order.

    Each file's part starts with a "diff --git " line (no hunk, context or base85 line can start so).
    ValueError when the parts and the names do not pair up.
    """
    parts, cur = [], []
    for line in diff.splitlines(keepends=True):
        if line.startswith("diff --git ") and cur:
            parts.append("".join(cur))
            cur = []
        cur.append(line)
    if cur:
        parts.append("".join(cur))
    if len(parts) != len(names):
        raise ValueError(f"{len(names)} changed paths but {len(parts)} file diffs")
    return dict(zip(names, parts, strict=True))


def unguarded_diff(names: list[str], diff: str, test_file_list: list[str]) -> tuple[str, list[str]]:
    """(the diff without the files the verifier guards, the guarded paths left out).

    Guarded as `secure_tree` guards them: the test files and their directories, GUARDED_NAMES and
    *.pth anywhere, bytecode and caches.
    """
    dirs = test_dirs(test_file_list)
    kept, dropped = [], []
    for path, part in split_diff(names, diff).items():
        cache = path.endswith(".pyc") or any(p in SKIP_DIRS for p in path.split("/"))
        if cache or _guarded(path, dirs, test_file_list):
            dropped.append(path)
        else:
            kept.append(part)
    return "".join(kept), dropped
