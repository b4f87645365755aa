"""results/REPORT.md: the paper's claims beside ours. Keeps the table honest against its sources.

Pure Python, no tsrl import: it reads REPORT.md, results/LOG.md and the committed reports' REPORT.md and
tables. Every check is a function returning a list of problems, so the positive controls at the end run the
same functions on mutated copies of real rows and must see them fail.

- every row fills all seven columns;
- every verdict is one of four labels followed by ": why"; nothing says PENDING, and the fixed-balance
  spread and held-out prediction rows are there, once each;
- every path under results/ that a source names exists; a results/LOG.md source names a real entry heading;
- numbers quoted in "ours" appear where the cited source puts them: each ';'-separated segment's numbers must
  appear, in order, on one line of the source, so a drifted number, or one taken from another line, fails.
  For a committed report the lines are those of its REPORT.md, tables/*.md and tables/*.csv (a table row, a
  CSV row); for a LOG entry they are the entry's paragraphs, list items and table rows.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "results" / "REPORT.md"
LOG = REPO / "results" / "LOG.md"

COLUMNS = (
    "claim",
    "paper's number",
    "paper's hardware and model",
    "ours",
    "our hardware, model and task set",
    "source of ours",
    "verdict",
)
VERDICTS = ("reproduced at this scale", "contradicted", "partly", "not measurable here")
PENDING = "PENDING"
# rows that must each appear once (the two measurements); no row may still say PENDING
PENDING_CLAIMS = (
    "Speedup vs spread at fixed balance, 40 rounds, seeds 42-44",
    "Prediction of stream's step time from the sync trace alone over held-out paired rounds",
)
REBUILDABLE = ("results/reports/spread_grpo_small", "results/reports/budget_tis")
# numbers of the paper that must each have a row (searched in claim, paper's number and paper's hardware)
REQUIRED_PAPER_NUMBERS = (
    "1313 s -> 687 s", "1.9x", "49.5 %", "1.58x -> 1.95x", "1.73x", "117.0 GB -> 122.8 GB", "588", "1.27 to 2.47",
    "1.64x", "1.63x and 1.67x", "45.9 %", "121.3", "233.5", "6.5", "GLM-4.7-Flash", "H200",
)

NUMBER = re.compile(r"\d+(?:\.\d+)?")
RESULTS_PATH = re.compile(r"results/[A-Za-z0-9_./-]*[A-Za-z0-9_/]")
LOG_SOURCE = re.compile(r"results/LOG\.md § (\d{4}-\d{2}-\d{2}): (.+)$")
REPORT_SOURCE = re.compile(r"(results/reports/[A-Za-z0-9_]+)/REPORT\.md")


# --- parsing ---------------------------------------------------------------------------------------------

def parse_table(text: str) -> list[dict]:
    """The rows of the first markdown table whose header is COLUMNS, as dicts; raises on a malformed row."""
    lines = text.splitlines()
    start = None
    for i, line in enumerate(lines):
        if line.startswith("|") and tuple(_cells(line)) == COLUMNS:
            start = i
            break
    if start is None:
        raise AssertionError(f"no table with header {COLUMNS}")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        if len(cells) != len(COLUMNS):
            raise AssertionError(f"{len(cells)} cells instead of {len(COLUMNS)}: {line[:120]}")
        rows.append(dict(zip(COLUMNS, cells, strict=True)))
    return rows


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text)


def report_lines(report_dir: Path) -> list[list[str]]:
    """The number tokens of each line of a committed report: REPORT.md, tables/*.md and tables/*.csv."""
    tables = report_dir / "tables"
    files = [report_dir / "REPORT.md", *sorted(tables.glob("*.md")), *sorted(tables.glob("*.csv"))]
    return [numbers(line) for f in files for line in f.read_text().splitlines()]


def log_sections(text: str) -> dict[str, str]:
    """results/LOG.md's entries by their heading line without '## ' ('DATE: heading')."""
    sections, heading, body = {}, None, []
    for line in text.splitlines():
        if line.startswith("## "):
            if heading is not None:
                sections[heading] = "\n".join(body)
            heading, body = line[3:].strip(), []
        elif heading is not None:
            body.append(line)
    if heading is not None:
        sections[heading] = "\n".join(body)
    return sections


# --- checks (each returns a list of problems) ---------------------------------------------------------------

def empty_cells(row: dict) -> list[str]:
    return [f"{row['claim'] or '?'}: empty {col!r}" for col in COLUMNS if not row[col].strip()]


def verdict_problems(row: dict) -> list[str]:
    v = row["verdict"]
    if v == PENDING:
        return []  # where PENDING may stand is pending_problems' business
    for label in VERDICTS:
        if v.startswith(label + ":") and v[len(label) + 1:].strip():
            return []
    return [f"{row['claim']}: verdict must be one of {VERDICTS} + ': why', got {v[:60]!r}"]


def pending_problems(rows: list[dict]) -> list[str]:
    problems = []
    claims = [r["claim"] for r in rows]
    for claim in PENDING_CLAIMS:
        if claims.count(claim) != 1:
            problems.append(f"row {claim!r} appears {claims.count(claim)} times, expected once")
    for r in rows:
        has = any(PENDING in r[c] for c in COLUMNS)
        if has:
            problems.append(f"{r['claim']}: still PENDING")
    return problems


def source_problems(row: dict, repo: Path = REPO, sections: dict | None = None) -> list[str]:
    src = row["source of ours"]
    problems = [f"{row['claim']}: {p} does not exist" for p in RESULTS_PATH.findall(src) if not (repo / p).exists()]
    m = LOG_SOURCE.search(src)
    if "results/LOG.md" in src:
        if m is None:
            problems.append(f"{row['claim']}: a LOG source must read 'results/LOG.md § DATE: heading'")
        elif f"{m[1]}: {m[2]}" not in (sections if sections is not None else log_sections(LOG.read_text())):
            problems.append(f"{row['claim']}: no LOG entry '## {m[1]}: {m[2]}'")
    return problems


def _in_order(needles: list[str], tokens: list[str]) -> bool:
    it = iter(tokens)
    return all(any(n == t for t in it) for n in needles)


def unmatched_in_report(ours: str, lines: list[list[str]]) -> list[str]:
    """The ';'-segments of `ours` whose numbers do not all appear, in order, on one line of the report."""
    return [seg.strip() for seg in ours.split(";")
            if numbers(seg) and not any(_in_order(numbers(seg), toks) for toks in lines)]


def unmatched_in_log(ours: str, section: str) -> list[str]:
    """The ';'-segments of `ours` whose numbers do not all appear, in order, on one line of the LOG entry (a
    paragraph's wrapped lines are one line here, a table row is one line), as for a committed report."""
    return unmatched_in_report(ours, [numbers(p) for p in log_lines(section)])


def log_lines(section: str) -> list[str]:
    """The entry's lines, with a wrapped paragraph or list item joined into one (a blank line, a new list
    item, a table row or a heading starts the next)."""
    out: list[str] = []
    for line in section.splitlines():
        s = line.strip()
        starts = not s or s.startswith(("|", "#", "- ", "* ", "```")) or s[:3].rstrip(".").isdigit() \
            or not out or not out[-1] or out[-1].lstrip().startswith(("|", "#", "```"))
        if starts or line.startswith("    ") and not line.startswith("      "):
            out.append(s)
        else:
            out[-1] += " " + s
    return [x for x in out if x]


def number_problems(row: dict, sections: dict) -> list[str]:
    if row["ours"] == PENDING:
        return []
    src = row["source of ours"]
    m = REPORT_SOURCE.search(src)
    if m:
        bad = unmatched_in_report(row["ours"], report_lines(REPO / m[1]))
        return [f"{row['claim']}: not in {m[1]} on one line, in order: {seg!r}" for seg in bad]
    m = LOG_SOURCE.search(src)
    if m and f"{m[1]}: {m[2]}" in sections:
        bad = unmatched_in_log(row["ours"], sections[f"{m[1]}: {m[2]}"])
        return [f"{row['claim']}: not on one line of the LOG entry {m[1]}, in order: {seg!r}" for seg in bad]
    return []


def benchmark_label_problems(row: dict) -> list[str]:
    """A toy or local number is never a SWE-bench or Terminal-Bench score: 'ours' names them only to say not."""
    ours = row["ours"]
    if re.search(r"SWE-bench|Terminal[ -]Bench", ours, re.IGNORECASE) and not re.search(r"\bnot\b", ours):
        return [f"{row['claim']}: 'ours' names a benchmark without saying it was not measured"]
    return []


# --- the table as committed --------------------------------------------------------------------------------

ROWS = parse_table(REPORT.read_text())
SECTIONS = log_sections(LOG.read_text())


def test_every_row_fills_every_column():
    assert len(ROWS) >= 20
    assert [p for r in ROWS for p in empty_cells(r)] == []


def test_every_paper_number_has_a_row():
    paper_side = "\n".join(f"{r['claim']} {r[COLUMNS[1]]} {r[COLUMNS[2]]}" for r in ROWS)
    assert [n for n in REQUIRED_PAPER_NUMBERS if n not in paper_side] == []


def test_verdicts_are_labelled_with_a_reason():
    assert [p for r in ROWS for p in verdict_problems(r)] == []


def test_nothing_pending_and_the_measured_rows_present():
    assert pending_problems(ROWS) == []


def test_sources_exist():
    assert [p for r in ROWS for p in source_problems(r, sections=SECTIONS)] == []


def test_numbers_appear_in_their_sources():
    assert [p for r in ROWS for p in number_problems(r, SECTIONS)] == []


def test_each_rebuildable_report_backs_a_row_with_numbers():
    for folder in REBUILDABLE:
        cited = [r for r in ROWS if f"{folder}/REPORT.md" in r["source of ours"] and numbers(r["ours"])]
        assert cited, f"no row quotes a number from {folder}"


def test_no_toy_number_is_called_a_benchmark_score():
    assert [p for r in ROWS for p in benchmark_label_problems(r)] == []


# --- positive controls: the same checks on mutated copies of real rows -----------------------------------------

def _row(claim_start: str, folder: str) -> dict:
    return next(r for r in ROWS if r["claim"].startswith(claim_start) and folder in r["source of ours"])


def _absent(lines: list[list[str]]) -> str:
    have = {t for toks in lines for t in toks}
    return next(c for c in ("97.31", "0.7771", "13.13", "4.4444") if c not in have)


def test_control_a_drifted_number_is_caught():
    for folder in REBUILDABLE:
        row = next(r for r in ROWS if f"{folder}/REPORT.md" in r["source of ours"] and numbers(r["ours"]))
        assert number_problems(row, SECTIONS) == []
        wrong = _absent(report_lines(REPO / folder))
        last = numbers(row["ours"])[-1]
        i = row["ours"].rindex(last)
        mutated = dict(row, ours=row["ours"][:i] + wrong + row["ours"][i + len(last):])
        assert number_problems(mutated, SECTIONS), f"a drifted number in a {folder} row went unnoticed"


def test_control_a_number_from_another_line_is_caught():
    lines = report_lines(REPO / "results/reports/spread_grpo_small")
    assert unmatched_in_report("spread_grpo_sigma0.0: 2.59 s -> 1.81 s", lines) == []
    # 0.00987 is in that report (device-hours), but not on the step-time line
    assert unmatched_in_report("spread_grpo_sigma0.0: 2.59 s -> 0.00987 s", lines) != []


def test_control_a_drifted_log_number_is_caught():
    row = next(r for r in ROWS if LOG_SOURCE.search(r["source of ours"]) and numbers(r["ours"]))
    assert number_problems(row, SECTIONS) == []
    m = LOG_SOURCE.search(row["source of ours"])
    have = set(numbers(SECTIONS[f"{m[1]}: {m[2]}"]))
    wrong = next(c for c in ("97.31", "0.7771", "13.13", "4.4444") if c not in have)
    mutated = dict(row, ours=row["ours"] + f"; {wrong}x")
    assert number_problems(mutated, SECTIONS)


def test_control_bad_sources_verdicts_and_pending_are_caught():
    row = _row("Step time, sync -> stream", "spread_grpo_small")
    for bad in ("results/reports/spread_grpo_smal/REPORT.md", "results/LOG.md § 2026-11-30: no such entry"):
        assert source_problems(dict(row, **{"source of ours": bad}), sections=SECTIONS), bad
    assert verdict_problems(dict(row, verdict="reproduced"))
    assert verdict_problems(dict(row, verdict="partly:"))
    assert empty_cells(dict(row, ours=" "))
    assert pending_problems([dict(r, ours=PENDING) if r is row else r for r in ROWS])
    named = next(r for r in ROWS if r["claim"] == PENDING_CLAIMS[0])
    assert pending_problems([r for r in ROWS if r is not named])
    assert benchmark_label_problems(dict(row, ours="SWE-bench Verified 41 %"))
    try:
        parse_table("no table here")
    except AssertionError:
        pass
    else:
        raise AssertionError("parse_table accepted a file without the table")


def test_control_a_log_number_from_another_line_is_caught():
    """Both numbers are in the LOG entry, on two rows of one table: quoted as one part, the check refuses them."""
    section = SECTIONS[
        "2026-12-02: the learner side of an 8-GPU node: a sharded learner group, micro-batched streaming"]
    assert unmatched_in_log("seed 0: 1.785x, learner compute stream/sync 0.998", section) == []
    assert unmatched_in_log("seed 0: 1.785x, learner compute stream/sync 1.001", section) != []
    assert log_lines("a wrapped\nparagraph 1.5\n\n- item 2\n  goes on 3\n| 4 | 5 |\n") == \
        ["a wrapped paragraph 1.5", "- item 2 goes on 3", "| 4 | 5 |"]
