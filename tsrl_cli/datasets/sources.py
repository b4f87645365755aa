"""The five sources and their loaders. Hub and local paths differ only here.

A loader returns the raw input (rows as dicts, or task directories) and a revision string;
everything after (normalize, filter, write) is the same code for both.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import pyarrow.parquet as pq

from tsrl_cli.datasets import harbor, swe_smith, swebench
from tsrl_cli.datasets.records import FieldError, RepairTask
from tsrl_cli.errors import UsageError
from tsrl_cli.files import file_sha256, tree_sha256


@dataclass(frozen=True)
class Source:
    name: str
    kind: str  # "repair" (rows) or "terminal" (task directories)
    role: str  # "train" or "eval": eval sets are kept out of training sets
    split: str  # split name written to the record and the parquet file name
    hub_id: str | None  # exact Hugging Face dataset id, or None when there is none
    normalize: Callable | None = None  # row -> RepairTask (rows sources only)


SOURCES = {
    "swe-smith": Source("swe-smith", "repair", "train", "train", swe_smith.HUB_ID, swe_smith.normalize),
    "swebench-verified": Source("swebench-verified", "repair", "eval", "test", swebench.HUB_ID, swebench.normalize),
    "seta-env": Source("seta-env", "terminal", "train", "train", harbor.SETA_HUB_ID),
    # Terminal-Bench 2.x is published through Harbor's registry (git), not as a HF dataset
    "terminal-bench": Source("terminal-bench", "terminal", "eval", "test", None),
}


def _embedded_row(row: dict, split: str, source: str):
    """A RepairTask written by tsrl_cli.embedded (already normalized; `start_dir` next to the rows)."""
    names = {f.name for f in fields(RepairTask)}
    for k in ("task_id", "fail_to_pass", "pass_to_pass", "start_dir"):
        if not row.get(k):
            raise FieldError(k, "missing")
    keep = {k: v for k, v in row.items() if k in names and k not in ("split", "source")}
    return RepairTask(**keep, split=split, source=source)


# The embedded suite (`tsrl prepare-data embedded` builds it and prepares these four from it)
EMBEDDED = {
    "embedded-repair-train": Source("embedded-repair-train", "repair", "train", "train", None,
                                    lambda row, split: _embedded_row(row, split, "embedded-repair-train")),
    "embedded-repair-heldout": Source("embedded-repair-heldout", "repair", "eval", "heldout", None,
                                      lambda row, split: _embedded_row(row, split, "embedded-repair-heldout")),
    "embedded-terminal-train": Source("embedded-terminal-train", "terminal", "train", "train", None),
    "embedded-terminal-heldout": Source("embedded-terminal-heldout", "terminal", "eval", "heldout", None),
}


def get_source(name: str) -> Source:
    if name in EMBEDDED:
        return EMBEDDED[name]
    if name not in SOURCES:
        raise UsageError(f"unknown source {name!r}; choose one of {', '.join([*SOURCES, 'embedded'])}")
    return SOURCES[name]


# ---- rows (repair sources) ------------------------------------------------------------------------

Row = tuple[str, dict | FieldError]  # (where: file:line or "id row N", the row or why it is unreadable)


def load_rows(src: Source, origin: str) -> tuple[Iterator[Row], str, str]:
    """(rows, dataset_id, revision) from the hub (`origin == "hub"`) or a local file or folder."""
    hub_split = {"train": "train", "test": "test"}.get(src.split, src.split)
    if origin == "hub":
        datasets = _import_hub("datasets")
        revision = _hub_revision(src.hub_id)
        try:
            ds = datasets.load_dataset(src.hub_id, split=hub_split, revision=revision)
        except Exception as e:  # noqa: BLE001 - network, auth, missing split: all end as one line
            raise _hub_error(src.hub_id, e) from None
        return ((f"{src.hub_id} row {i}", row) for i, row in enumerate(ds)), src.hub_id, revision
    path = _local_path(origin)
    files = _row_files(path, hub_split)
    revision = "sha256:" + _hash_files(files)
    return _iter_files(files), str(path.resolve()), revision


def _row_files(path: Path, split: str) -> list[Path]:
    if path.is_file():
        return [path]
    # one format per folder, parquet first: a hub snapshot may also hold metadata .json files
    for suffix in (".parquet", ".jsonl", ".json"):
        files = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file() and ".cache" not in p.parts)
        if files:
            # a hub snapshot holds data/<split>-00000-of-00001.parquet per split: take ours when names say
            mine = [p for p in files if p.stem == split or p.stem.startswith(f"{split}-")]
            return mine or files
    raise UsageError(f"{path}: no .parquet, .jsonl or .json files")


def _iter_files(files: list[Path]) -> Iterator[Row]:
    for f in files:
        if f.suffix == ".parquet":
            yield from _iter_parquet(f)
        elif f.suffix == ".jsonl":
            with open(f) as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        yield f"{f}:{n}", _decode(line)
        elif f.suffix == ".json":
            try:
                rows = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise UsageError(f"{f}: not valid JSON ({e})") from None
            if not isinstance(rows, list):
                raise UsageError(f"{f}: expected a JSON list of rows")
            for i, row in enumerate(rows):
                yield f"{f} row {i}", row if isinstance(row, dict) else FieldError("(row)", "not a JSON object")
        else:
            raise UsageError(f"{f}: expected .parquet, .jsonl or .json")


def _iter_parquet(f: Path) -> Iterator[Row]:
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a broken file
        raise UsageError(f"{f}: not a readable parquet file ({e})") from None
    i = 0
    for batch in pf.iter_batches(batch_size=1024):  # bounded memory: SWE-smith is ~60k rows of patches
        for row in batch.to_pylist():
            yield f"{f} row {i}", row
            i += 1


def _decode(line: str) -> dict | FieldError:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return FieldError("(line)", f"not valid JSON ({e.msg})")
    return row if isinstance(row, dict) else FieldError("(line)", "not a JSON object")


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name} {file_sha256(f)}\n".encode())
    return h.hexdigest()


# ---- task directories (terminal sources) ----------------------------------------------------------


def load_task_root(src: Source, origin: str) -> tuple[Path, str, str]:
    """(root folder holding task directories, dataset_id, revision)."""
    if origin == "hub":
        if src.hub_id is None:
            raise UsageError(f"{src.name} has no Hugging Face dataset; clone its task folder and pass --from PATH")
        hub = _import_hub("huggingface_hub")
        try:
            root = Path(hub.snapshot_download(repo_id=src.hub_id, repo_type="dataset"))
        except Exception as e:  # noqa: BLE001 - any hub failure becomes one line
            raise _hub_error(src.hub_id, e) from None
        return root, src.hub_id, root.name  # the snapshot folder is named after the commit
    path = _local_path(origin)
    if not path.is_dir():
        raise UsageError(f"{path}: {src.name} reads task directories; pass a folder")
    return path, str(path.resolve()), "sha256:" + tree_sha256(path)


# ---- shared ----------------------------------------------------------------------------------------


def _local_path(origin: str) -> Path:
    path = Path(origin).expanduser()
    if not path.exists():
        raise UsageError(f"--from {origin}: not found (pass `hub` or an existing file or folder)")
    return path


def _import_hub(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise UsageError(f"--from hub needs the `{module}` package: pip install 'tsrl[hub]'") from None


def _hub_revision(hub_id: str) -> str:
    hub = _import_hub("huggingface_hub")
    try:
        return hub.HfApi().dataset_info(hub_id).sha
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one line
        raise _hub_error(hub_id, e) from None


def _hub_error(hub_id: str, e: Exception) -> UsageError:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return UsageError(f"cannot load {hub_id} from the hub ({type(e).__name__}: {first}); "
                      "download it where the hub is reachable and pass --from PATH")
