"""Build a report (`build`) and compare two report folders (tables/*.csv, tables/*.md, figures/*.csv)
number by number. (A module of its own: a bare `import conftest` can find another folder's conftest.)

CSV cells that parse as floats must agree to 1e-9 relative (the pandas reductions and the Python
`statistics` ones differ in the last bits); every other cell must be equal as text. Markdown tables are
compared cell by cell as text (numbers there are already rounded to 3 significant digits).
`renamed` maps a reference's table, column and markdown header names to the checked folder's.
"""

import contextlib
import csv
import io
import json
import math
import os
import re
from pathlib import Path

from typer.testing import CliRunner

from tsrl_cli.cli import app

REPO = Path(__file__).resolve().parents[2]
COMMITTED = "results/reports/spread_grpo_small"  # a committed report and, under runs/, the runs it was built from
COMMITTED_BUDGET = "results/reports/budget_tis"  # the same for the fixed-budget comparison
REL, ABS = 1e-9, 1e-12


def build(results_dir, out, *args, cwd=None) -> dict:
    """`tsrl report RESULTS_DIR --out OUT --json` (run from `cwd`), its JSON document."""
    with contextlib.chdir(cwd or os.getcwd()):
        res = CliRunner().invoke(app, ["report", str(results_dir), "--out", str(out), "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def read_csv(p: Path) -> list[dict]:
    text = p.read_text()
    return list(csv.DictReader(io.StringIO(text))) if text.strip() else []


def _num(x: str) -> float | None:
    try:
        return float(x)
    except ValueError:
        return None


def compare_csv(ref: Path, got: Path, columns: dict[str, str] | None = None) -> tuple[list[str], int]:
    """Differences (one line each) and how many cells were compared."""
    columns = columns or {}
    a, b = read_csv(ref), read_csv(got)
    if len(a) != len(b):
        return [f"{got.name}: {len(b)} rows, the reference has {len(a)}"], 0
    bad, n = [], 0
    for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
        for k, va in ra.items():
            kb = columns.get(k, k)
            if kb not in rb:
                bad.append(f"{got.name}: no column {kb}")
                continue
            vb, fa, fb = rb[kb], _num(va), _num(rb[kb])
            n += 1
            same = math.isclose(fa, fb, rel_tol=REL, abs_tol=ABS) if fa is not None and fb is not None else va == vb
            if not same:
                bad.append(f"{got.name} row {i} {k}: {va!r} (reference) vs {vb!r}")
    return bad, n


def markdown_cells(text: str) -> list[list[str]]:
    """The cells of every markdown table row in a file (alignment rows left out)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not set(line) <= set("|-: ")]


def compare_folders(ref: Path, got: Path, renamed: dict[str, str] | None = None) -> tuple[list[str], int]:
    renamed = renamed or {}
    bad, n = [], 0
    for sub in ("tables", "figures"):
        for p in sorted((ref / sub).glob("*.csv")):
            other = got / sub / f"{renamed.get(p.stem, p.stem)}.csv"
            if not other.is_file():
                bad.append(f"{sub}/{other.name}: missing")
                continue
            b, k = compare_csv(p, other, renamed)
            bad += [f"{sub}/{x}" for x in b]
            n += k
    for p in sorted((ref / "tables").glob("*.md")):
        other = got / "tables" / f"{renamed.get(p.stem, p.stem)}.md"
        a, b = markdown_cells(p.read_text()), markdown_cells(other.read_text())
        if a:
            a[0] = [renamed.get(h, h) for h in a[0]]
        if a != b:
            bad.append(f"tables/{other.name}: markdown cells differ")
        n += sum(map(len, a))
    return bad, n


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def claim_numbers(report_md: str) -> dict[str, list[str]]:
    """REPORT.md's claims table: claim -> the numbers in the 'ours' column, in order."""
    rows = markdown_cells(report_md.split("## Claims beside the paper")[1].split("## Tables")[0])
    return {r[0]: NUMBER.findall(r[2]) for r in rows[1:]}
