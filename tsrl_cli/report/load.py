"""Find run directories under a results tree and read them (docs/run-directory.md).

A run is `<root>/<experiment>/<schedule>/seed<k>/` holding metrics.jsonl (+ events.jsonl,
config.yaml, DONE). The experiment may be a nested path (`spread/sigma1`). Runs without DONE are
partial: left out unless asked for, and listed either way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

_SEED_DIR = re.compile(r"seed(-?\d+)$")


@dataclass
class Run:
    experiment: str
    schedule: str
    seed: int
    path: Path
    done: bool
    rounds: dict[int, dict] = field(default_factory=dict)  # round -> merged metrics row
    config: dict = field(default_factory=dict)

    @property
    def objective(self) -> str | None:
        return next((r.get("objective") for r in self.rounds.values() if r.get("objective")), None)

    def series(self, key: str) -> dict[int, float | None]:
        """round -> value of one metric (None where not measured)."""
        return {k: _float(r.get(key)) for k, r in self.rounds.items()}

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"


def find_runs(root: str | Path, include_partial: bool = False) -> tuple[list[Run], list[str]]:
    """Every run under root, sorted by (experiment, schedule, seed), and notes on what was left out."""
    root = Path(root)
    runs, notes = [], []
    for metrics in sorted(root.rglob("metrics.jsonl")):
        d = metrics.parent
        m = _SEED_DIR.match(d.name)
        rel = d.relative_to(root).parts
        if m is None or len(rel) < 3:
            notes.append(f"{d}: not <experiment>/<schedule>/seed<k>/, skipped")
            continue
        done = (d / "DONE").is_file()
        if not done and not include_partial:
            notes.append(f"{d.relative_to(root)}: no DONE (unfinished run), skipped; --include-partial counts it")
            continue
        run = Run("/".join(rel[:-2]), rel[-2], int(m.group(1)), d, done)
        run.rounds, bad = _merged_rounds(metrics)
        if bad:
            notes.append(f"{metrics.relative_to(root)}: {bad} unreadable line(s) ignored")
        run.config = _read_config(d / "config.yaml", notes)
        if not done:
            notes.append(f"{d.relative_to(root)}: no DONE, counted as partial ({len(run.rounds)} rounds)")
        runs.append(run)
    runs.sort(key=lambda r: (r.experiment, r.schedule, r.seed))
    return runs, notes


def config_value(config: dict, dotted: str):
    """config['a']['b'] for 'a.b' (None when any part is missing)."""
    cur = config
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def flat_config(config: dict, prefix: str = "") -> dict[str, object]:
    """{'a.b': value} for every leaf."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        out.update(flat_config(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def read_jsonl(p: Path) -> tuple[list[dict], int]:
    """Rows that parse as JSON objects, and how many lines did not (a run may be mid-write)."""
    rows, bad = [], 0
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def _merged_rounds(p: Path) -> tuple[dict[int, dict], int]:
    """Rows of the same round (the round row, an eval row) merged; a later non-null value wins."""
    rows, bad = read_jsonl(p)
    out: dict[int, dict] = {}
    for row in rows:
        if row.get("round") is None:
            bad += 1
            continue
        merged = out.setdefault(int(row["round"]), {})
        merged.update({k: v for k, v in row.items() if v is not None})
    return out, bad


def _read_config(p: Path, notes: list[str]) -> dict:
    if not p.is_file():
        return {}

    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        notes.append(f"{p}: config.yaml unreadable ({type(e).__name__}), ignored")
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _float(v) -> float | None:
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None
