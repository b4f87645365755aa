"""The task record every environment, trainer and evaluator reads, and its on-disk form.

A prepared dataset is one directory:

    data/NAME/
      <split>.parquet    one row per task (RepairTask or TerminalTask columns; `meta` is a JSON string)
      tasks/<task_id>/   terminal tasks only: a copy of the task directory (environment, tests, solution)
      manifest.json      written LAST: source, revision, counts, filters, overlaps, sha256 of every file

A directory without manifest.json is incomplete and is never read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tsrl_cli.errors import UsageError

FORMAT = "tsrl-tasks/1"  # bump when a column changes meaning
MANIFEST = "manifest.json"


@dataclass
class RepairTask:
    """Fix a bug in a repository; the reward is whether FAIL_TO_PASS and PASS_TO_PASS pass."""

    task_id: str
    source: str
    split: str
    repo: str  # as the source names it (SWE-smith: mirror `swesmith/<owner>__<repo>.<commit8>`)
    upstream_repo: str  # `<owner>/<repo>` on GitHub: what train/eval separation compares
    base_ref: str  # start state inside the image
    ref_kind: str  # "branch" (SWE-smith: branch named instance_id) or "commit" (SWE-bench base_commit)
    bug_patch: str | None  # diff that introduces the bug (SWE-smith); None when the start state has it
    gold_patch: str | None  # diff that fixes it (SWE-smith: bug_patch reversed)
    test_patch: str | None  # tests the evaluator adds (SWE-bench); None when the image has them
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    image: str  # container image holding the repository at its start state
    problem_statement: str
    language: str | None = None  # from the row, else from the patch's file extensions
    test_command: str | None = None
    log_parser: str | None = None  # swebench 5.x parser name, e.g. "pytest"
    eval_script: str | None = None  # swebench 5.x: the row carries its own evaluation script
    eval_type: str | None = None
    # A folder holding the repository at its start state, relative to the dataset folder: what the
    # local executor copies (embedded tasks). None: the start state lives only in `image`.
    start_dir: str | None = None
    meta: dict = field(default_factory=dict)

    kind = "repair"


@dataclass
class TerminalTask:
    """Reach a state in a container; a test script scores it. Paths are relative to the dataset dir."""

    task_id: str
    source: str
    split: str
    format: str  # "harbor" (task.toml, TB 2.x, SETA-Env) or "tb1" (terminal-bench 1.x task.yaml)
    instruction: str
    task_dir: str  # tasks/<task_id>
    environment_dir: str  # relative to task_dir: "environment" (harbor) or "." (tb1: Dockerfile at the root)
    test_script: str  # relative to task_dir: tests/test.sh (harbor) or run-tests.sh (tb1)
    solution_script: str | None
    docker_image: str | None  # prebuilt image when task.toml names one, else build environment_dir
    agent_timeout_s: float | None
    verifier_timeout_s: float | None
    build_timeout_s: float | None
    reward_mode: str  # "reward_file": test script writes /logs/verifier/reward.{txt,json}; "all_tests_pass": tb1
    dir_sha256: str  # tree hash of the task directory, checked by `tsrl data check`
    meta: dict = field(default_factory=dict)

    kind = "terminal"


RECORD_TYPES = {"repair": RepairTask, "terminal": TerminalTask}


def _schema(kind: str):
    types = {"str": pa.string(), "str | None": pa.string(), "list[str]": pa.list_(pa.string()),
             "float | None": pa.float64(), "dict": pa.string()}
    return pa.schema([pa.field(f.name, types[f.type], nullable=f.type != "str") for f in fields(RECORD_TYPES[kind])])


def to_row(task: RepairTask | TerminalTask) -> dict:
    row = asdict(task)
    row["meta"] = json.dumps(row["meta"], sort_keys=True)
    return row


def records_sha256(tasks: list) -> str:
    """Hash of the records' content, in order; equal inputs and options give an equal hash."""
    h = hashlib.sha256()
    for t in tasks:
        h.update(json.dumps(to_row(t), sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def write_tasks(path: Path, tasks: list, kind: str) -> None:
    table = pa.Table.from_pylist([to_row(t) for t in tasks], schema=_schema(kind))
    pq.write_table(table, path)


def read_tasks(path: Path, kind: str) -> list:
    """Read a parquet file written by write_tasks; a column mismatch is an error naming the column."""
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid/OSError for a missing or broken file
        raise UsageError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    want = _schema(kind)
    if table.schema.names != want.names:
        missing = sorted(set(want.names) - set(table.schema.names))
        extra = sorted(set(table.schema.names) - set(want.names))
        raise UsageError(f"{path}: columns differ from {kind} records (missing {missing}, unexpected {extra})")
    cls = RECORD_TYPES[kind]
    out = []
    for row in table.to_pylist():
        row["meta"] = json.loads(row["meta"]) if row["meta"] else {}
        out.append(cls(**row))
    return out


def write_manifest(dirpath: Path, manifest: dict) -> None:
    (dirpath / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(dirpath: Path) -> dict:
    p = dirpath / MANIFEST
    if not p.is_file():
        raise UsageError(f"{dirpath}: no {MANIFEST} (not a prepared dataset, or an interrupted write)")
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}: not valid JSON ({e})") from None
    if m.get("format") != FORMAT:
        raise UsageError(f"{p}: format {m.get('format')!r}, this tsrl reads {FORMAT!r}")
    return m


def load_dataset_dir(dirpath: Path) -> tuple[dict, list]:
    """(manifest, tasks) of a prepared dataset."""
    m = read_manifest(dirpath)
    return m, read_tasks(dirpath / m["file"], m["kind"])


class FieldError(ValueError):
    """One field of one input row or task directory is missing or has the wrong type."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"field {field_name!r}: {problem}")
        self.field = field_name


def req_str(row: dict, name: str, *, empty_ok: bool = False) -> str:
    v = row.get(name)
    if v is None:
        raise FieldError(name, "missing")
    if not isinstance(v, str):
        raise FieldError(name, f"expected a string, got {type(v).__name__}")
    if not empty_ok and not v.strip():
        raise FieldError(name, "empty")
    return v


def opt_str(row: dict, name: str) -> str | None:
    v = row.get(name)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise FieldError(name, f"expected a string, got {type(v).__name__}")
    return v


def name_list(row: dict, name: str) -> list[str]:
    """A list of test names; SWE-bench stores it JSON-encoded in a string, SWE-smith as a real list."""
    v = row.get(name)
    if v is None:
        raise FieldError(name, "missing")
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise FieldError(name, "a string that is not a JSON list") from None
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
        raise FieldError(name, "expected a list of test names (strings)")
    return list(v)
