"""docs/reliability.md states figures of the test suite: its counts equal the lists in the tests, every
hack of the battery has its row, and every test it names exists (a renamed or deleted test fails here)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "reliability.md").read_text()


def _module(rel: str):
    spec = importlib.util.spec_from_file_location(f"_doc_{Path(rel).stem}", ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _section(title: str) -> str:
    return DOC.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_every_named_test_exists():
    named = set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", DOC))
    assert len(named) >= 25
    missing = [f"{f}::{t}" for f, t in sorted(named)
               if not re.search(rf"^(async )?def {t}\(", (ROOT / f).read_text(), re.M)]
    assert missing == []


def test_reward_hack_figures_match_the_battery():
    hacks = _module("tests/envs/test_reward_hacks.py")
    section = _section("Reward hacks tried and scored 0")
    assert f"**{len(hacks.REPAIR_HACKS)}** repair hacks" in section
    assert f"**{len(hacks.TERMINAL_HACKS)}** terminal hacks" in section
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in section.splitlines() if line.startswith("| ")}
    assert set(hacks.REPAIR_HACKS) | set(hacks.TERMINAL_HACKS) <= set(rows)
    naive = {h for h in hacks.REPAIR_HACKS if rows[h][0].strip() == "1"}
    assert naive == hacks.WORK_NAIVELY and f"{len(naive)} of the {len(hacks.REPAIR_HACKS)}" in section
    assert f"the {len(hacks.FAMILIES)} embedded terminal families" in section
    assert len(hacks.REPAIR_HACKS) >= 12


def test_escape_and_fault_counts_match_their_tables():
    for title, word in (("Escapes tried and contained", "attempts"), ("Faults survived", "faults")):
        section = _section(title)
        rows = [x for x in section.splitlines() if x.startswith("| ") and not x.startswith(("| attempt", "| fault"))]
        assert f"**{len(rows)}** {word}" in section, (title, len(rows))


def test_bad_input_figures_match_the_table():
    bad = _module("tests/cli/test_bad_inputs.py")
    section = _section("Bad inputs answered")
    assert f"**{len(bad.CASES)}** bad command lines over all **{len(bad.COMMANDS)}** commands" in section
    assert all(f"`{c}`" in section for c in bad.COMMANDS)
