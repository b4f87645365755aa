"""The run directory (docs/run-directory.md): its file names, and the one reader of them.

    RunDir(path)                          one run: <results>/<experiment>/<schedule>/seed<k>/, or train's --out
      .file(name)                         a file's path; name.gz when only that exists (committed run inputs)
      .rows(name, torn=DROP_LAST)         the JSON rows of a .jsonl file, under one torn-line policy
      .read(name, torn=...)               the same with each row's line number and what was left out (Rows)
      .config()                           config.yaml through config.load_config: a TrainConfig
      .config_dict()                      config.yaml as written (keys by dotted path, for the report)
      .checkpoints(), .checkpoint_path(k) completed checkpoints {round: folder}; where round k's goes
      .journal_name(k), .journal_rounds() round k's trajectory journal (a name for rows/read); rounds that have one
      .started(), .done(), .summary()     config.yaml written; DONE written; DONE's JSON summary
    read_jsonl(path, torn)                any JSON-lines file (gunzipped when its name ends in .gz)
    runs_under(root)                      the run directories of a results tree (folders with metrics.jsonl)
    sweep_path(root), read_sweep(root)    a results tree's sweep.json (tsrl sweep's plan: the warm-up)

Torn-line policies. Rows are appended one whole line per write, so a process killed mid-append
leaves at most its last line without the newline; the caller says what a bad line means:

    DROP_LAST  that last line is left out; any other bad line is an error (resume, sweep, bench, predict on runs)
    STRICT     every non-blank line must be a JSON object (a trace file a person wrote: predict)
    SKIP       bad lines are left out and counted (the report, over runs that may still be written)

An error is a UsageError naming file:line and the fix. Writing (appends, config.yaml, DONE,
resume's rewrite) is rl/runlog.py's RunLog, a RunDir that writes (the rollout process appends
the trajectory journal through one); the learner writes checkpoints. The file names appear in
code only here (tests/test_layering.py).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from tsrl_cli.config import TrainConfig, load_config, read_yaml
from tsrl_cli.errors import UsageError

CONFIG = "config.yaml"  # the resolved config, written before round 1
METRICS = "metrics.jsonl"  # one row per round (and per eval)
EVENTS = "events.jsonl"  # item / batch_backward / step / ... rows
ROLLOUTS = "rollouts.jsonl"  # with run.save_rollouts
LOGS = (METRICS, EVENTS, ROLLOUTS)  # the appended JSON-lines files
CHECKPOINTS = "checkpoints"  # checkpoints/round-<k>/
CHECKPOINT_STATE = "state.json"  # the last file the learner writes into a checkpoint: it marks it complete
EVAL_ROUND0 = "eval_round0.json"  # the initial weights' held-out metrics (eval.every)
PIDS = "processes.json"  # {main, rollout, learner[, teacher]: pid} while the workers run
DONE = "DONE"  # the run's JSON summary, written last
JOURNAL = "journal"  # journal/round-<k>.jsonl: round k's trajectories, each fsynced as it ends (rl/journal.py)
SWEEP = "sweep.json"  # at the root of a results tree: what `tsrl sweep` planned with
GZ = ".gz"  # a compressed copy (committed run inputs); read as the plain file

DROP_LAST, STRICT, SKIP = "drop_last", "strict", "skip"
_ROUND = "round-"  # checkpoints/round-<k>


@dataclass(frozen=True)
class Rows:
    path: Path
    rows: list[dict] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # each row's 1-based line number in the file
    skipped: int = 0  # SKIP: lines left out (not JSON, or JSON but not an object)
    torn: bool = False  # the last line had no newline (left out under DROP_LAST)

    def numbered(self) -> list[tuple[int, dict]]:
        return list(zip(self.lines, self.rows, strict=False))


def _text(p: Path) -> str:
    try:
        data = p.read_bytes()
        if p.name.endswith(GZ):
            data = gzip.decompress(data)
        return data.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UsageError(f"{p}: unreadable ({e}); copy the file again from where it came from") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{p}: not UTF-8 text (byte {e.start}); a JSON-lines file is UTF-8") from None


def read_jsonl(path: str | Path, torn: str) -> Rows:
    """The JSON-object rows of a JSON-lines file under the torn-line policy `torn`; a missing file
    has no rows. Blank lines are not rows and are never counted."""
    if torn not in (DROP_LAST, STRICT, SKIP):
        raise ValueError(f"torn={torn!r}: one of {DROP_LAST}, {STRICT}, {SKIP}")
    p = Path(path)
    if not p.is_file():
        return Rows(p)
    text = _text(p)
    lines = text.splitlines()
    is_torn = bool(text) and not text.endswith("\n")
    if is_torn and torn == DROP_LAST:
        lines = lines[:-1]
    rows, numbers, skipped = [], [], 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            why = None if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
        except json.JSONDecodeError as e:
            why = f"not JSON ({e.msg})"
        if why is None:
            rows.append(row)
            numbers.append(n)
        elif torn == SKIP:
            skipped += 1
        else:
            fix = ("a run appends whole lines, so only its last can be torn: repair or delete that line, or move "
                   "the run directory away to start over") if torn == DROP_LAST else \
                "each line is one JSON object: repair or delete that line"
            raise UsageError(f"{p}:{n}: not a JSON row: {why}; {fix}")
    return Rows(p, rows, numbers, skipped, is_torn)


class RunDir:
    """One run directory, read. Nothing here writes (rl/runlog.py's RunLog does)."""

    def __init__(self, path: str | Path):
        self.root = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG

    @property
    def done_path(self) -> Path:
        return self.root / DONE

    def file(self, name: str) -> Path:
        """root/name, else root/name.gz when only that exists (the plain name when neither does)."""
        plain = self.root / name
        packed = plain.with_name(plain.name + GZ)
        return packed if not plain.is_file() and packed.is_file() else plain

    def read(self, name: str, torn: str = DROP_LAST) -> Rows:
        return read_jsonl(self.file(name), torn)

    def rows(self, name: str, torn: str = DROP_LAST) -> list[dict]:
        """The rows of METRICS, EVENTS or ROLLOUTS ([] when the file is absent). DROP_LAST, the
        default, is the contract's own reading; see the module docstring for the others."""
        return self.read(name, torn).rows

    def started(self) -> bool:
        return self.config_path.is_file()

    def config(self) -> TrainConfig:
        """config.yaml as a TrainConfig: every key checked (ConfigError names a bad one), and the
        defaults for keys the version that wrote the run did not have."""
        if not self.started():
            raise UsageError(f"{self.root}: no {CONFIG} (not a run directory, or its run never started)")
        return load_config(self.config_path)

    def config_dict(self) -> dict:
        """config.yaml as written ({} when absent): the report reads keys by dotted path, and says
        "not in config.yaml" where a run's version wrote no such key. ConfigError when not YAML."""
        return read_yaml(self.config_path) if self.started() else {}

    def checkpoint_path(self, round_: int) -> Path:
        return self.root / CHECKPOINTS / f"{_ROUND}{round_}"

    def checkpoints(self) -> dict[int, Path]:
        """{round: folder} of completed checkpoints, by round (a folder without state.json is unfinished)."""
        out = {}
        for d in (self.root / CHECKPOINTS).glob(f"{_ROUND}*"):
            k = d.name.removeprefix(_ROUND)
            if k.isdigit() and (d / CHECKPOINT_STATE).is_file():
                out[int(k)] = d
        return dict(sorted(out.items()))

    def journal_name(self, round_: int) -> str:
        """Round k's trajectory journal as a name for rows() and read(): journal/round-<k>.jsonl."""
        return f"{JOURNAL}/{_ROUND}{round_}.jsonl"

    def journal_rounds(self) -> list[int]:
        """The rounds that have a journal file, in order."""
        names = (p.name.removeprefix(_ROUND).removesuffix(".jsonl") for p in (self.root / JOURNAL).glob(f"{_ROUND}*"))
        return sorted(int(k) for k in names if k.isdigit())

    def done(self) -> bool:
        return self.done_path.is_file()

    def summary(self) -> dict | None:
        """DONE's JSON summary (what `tsrl train` returned); None while the run is not done."""
        if not self.done():
            return None
        text = _text(self.done_path)
        try:
            doc = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise UsageError(f"{self.done_path}: not JSON ({e.msg}); delete it and `tsrl train --resume` "
                             "writes it again") from None
        if not isinstance(doc, dict):
            raise UsageError(f"{self.done_path}: a JSON {type(doc).__name__}, not the run's summary object; delete it "
                             "and `tsrl train --resume` writes it again")
        return doc


def runs_under(root: str | Path) -> list[RunDir]:
    """Every folder under root holding a metrics.jsonl, sorted by path."""
    return [RunDir(p.parent) for p in sorted(Path(root).rglob(METRICS))]


def sweep_path(root: str | Path) -> Path:
    return Path(root) / SWEEP


def read_sweep(root: str | Path) -> dict:
    """root/sweep.json; {} when absent or not a JSON object (the report then uses its own warm-up)."""
    try:
        doc = json.loads(sweep_path(root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}

