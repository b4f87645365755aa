"""The pandas tables against the hand-written aggregation they replaced, and the committed report
against a rebuild from its committed runs.

tests/report/golden/<set>/ holds what the earlier report code (statistics.fmean / stdev over Python
dicts, commit e4ebbcf) wrote for three inputs: the synthetic tree of conftest.results_tree
(`synthetic`), the sync/stream/async tree of conftest.built_async (`synthetic_async`) and the
committed runs of results/reports/spread_grpo_small/runs (`spread_grpo_small`). How they were made:
tests/report/golden/README.md.
"""

import contextlib
import json
import shutil

import pytest
from report_helpers import (
    COMMITTED,
    COMMITTED_BUDGET,
    REPO,
    build,
    claim_numbers,
    compare_csv,
    compare_folders,
    markdown_cells,
    read_csv,
)

GOLDEN = REPO / "tests" / "report" / "golden"
# what the device-hours change renamed: the earlier code's names -> today's (same numbers on these
# runs: each held 2 cpu devices for its wall time, and its core_s counted its 2 processes)
RENAMED = {"core_hours_to_target": "device_hours_to_target", "core_s_mean": "device_s_mean",
           "core_s_std": "device_s_std", "core_s_ci_low": "device_s_ci_low", "core_s_ci_high": "device_s_ci_high",
           "core_speedup_vs_sync": "device_speedup_vs_sync", "budget_core_s": "budget_device_s",
           "core-hours": "device-hours (cpu)", "core-hours saved vs sync (x)": "device-hours (cpu) saved vs sync (x)",
           "budget core-hours": "budget device-hours (cpu)"}
SUMMARY = ("runs", "predicted_rows", "predicted_mean_abs_error_pct", "paired_rows",
           "paired_mean_abs_error_pct", "paired_mean_abs_error_pct_sync_trace",
           "paired_mean_abs_error_pct_stream_trace")


@pytest.fixture(params=["synthetic", "synthetic_async", "spread_grpo_small"])
def case(request):
    fixture = {"synthetic": "built", "synthetic_async": "built_async", "spread_grpo_small": "built_committed"}
    out, doc = request.getfixturevalue(fixture[request.param])
    return GOLDEN / request.param, out, doc


def test_pandas_tables_equal_the_earlier_code(case):
    gold, out, doc = case
    bad, n = compare_folders(gold, out, RENAMED)
    assert bad == [] and n > 900, bad[:10]  # 998 to 3,163 cells per set
    ref = json.loads((gold / "result.json").read_text())
    assert {k: doc[k] for k in SUMMARY} == pytest.approx({k: ref[k] for k in SUMMARY}, rel=1e-9)
    assert (doc["experiments"], doc["notes"]) == (ref["experiments"], ref["notes"])
    # REPORT.md's claims: the same numbers in the "ours" column, claim by claim
    assert claim_numbers((out / "REPORT.md").read_text()) == claim_numbers((gold / "REPORT.md").read_text())


def test_the_comparison_sees_a_changed_number(built, tmp_path):
    """Positive control: one speedup moved in its 4th significant digit, one cell of a markdown table."""
    out, _ = built
    shutil.copytree(out, tmp_path / "r")
    p = tmp_path / "r" / "tables" / "step_time.csv"
    lines = p.read_text().splitlines()
    cells = lines[2].split(",")
    i = lines[0].split(",").index("speedup_mean")
    cells[i] = repr(float(cells[i]) * 1.0001)
    p.write_text("\n".join([*lines[:2], ",".join(cells), *lines[3:]]) + "\n")
    md = tmp_path / "r" / "tables" / "memory.md"
    md.write_text(md.read_text().replace("1.05", "1.06", 1))
    bad, _ = compare_folders(GOLDEN / "synthetic", tmp_path / "r", RENAMED)
    assert any("step_time.csv row 1 speedup_mean" in b for b in bad)
    assert "tables/memory.md: markdown cells differ" in bad


@pytest.mark.parametrize("committed, fixture, runs, paired", [(COMMITTED, "built_committed", 12, 24),
                                                               (COMMITTED_BUDGET, "built_budget", 9, 0)])
def test_committed_report_regenerates_from_committed_runs(request, committed, fixture, runs, paired):
    """`tsrl report <committed>/runs --out <committed>` gives the committed tables, figure data and
    REPORT.md (the PNGs are not compared: matplotlib's rendering differs between versions)."""
    out, doc = request.getfixturevalue(fixture)
    committed = REPO / committed
    names = {p.relative_to(committed) for p in committed.glob("*/*.csv")} | {p.relative_to(committed)
                                                                             for p in committed.glob("tables/*.md")}
    assert names == {p.relative_to(out) for p in out.glob("*/*.csv")} | {p.relative_to(out)
                                                                         for p in out.glob("tables/*.md")}
    bad, n = compare_folders(committed, out)
    assert bad == [] and n > 3000, bad[:10]
    assert (out / "REPORT.md").read_text() == (committed / "REPORT.md").read_text()
    assert doc["runs"] == runs and doc["paired_rows"] == paired


def test_committed_budget_report_has_three_arms_from_their_configs(built_budget):
    """stream, async with TIS and async without, one budget for the three (one workload), labelled from
    each run's config.yaml, with the gap to stream for both async arms."""
    out, _ = built_budget
    rows = read_csv(out / "tables" / "reward_at_budget.csv")
    assert [(r["experiment"], r["schedule"], r["arm"]) for r in rows] == [
        ("budget_stream_vs_async", "stream", "stream"), ("budget_async_tis", "async", "async, TIS cap 2.0"),
        ("budget_stream_vs_async", "async", "async, no TIS")]
    assert len({r["budget_group"] for r in rows}) == 1 and len({r["budget_device_s"] for r in rows}) == 1
    assert all(r["seeds"] == "42 43 44" and r["reward_mean"] for r in rows)
    assert [bool(r["gap_points_mean"]) for r in rows] == [False, True, True]
    assert (out / "figures" / "reward_vs_device_s.png").is_file()


def test_committed_report_names_its_setup_from_the_runs(built_committed):
    out, _ = built_committed
    md = (out / "REPORT.md").read_text()
    label = "2 cpu devices (rollout cpu, learner cpu); model builtin:toy:h64:l2; tasks builtin:echo"
    paper = "paper (one node of 8 B200 GPUs, Qwen-3.8-27B, SWE-smith / SETA-Env tasks)"
    assert f"| claim | {paper} | ours ({label}) |" in md
    (header, *_) = markdown_cells((out / "tables" / "device_hours_to_target.md").read_text())
    assert "device-hours (cpu)" in header and "GPU" not in md.split("## Tables")[1]


# Every committed report folder is rebuilt from its committed inputs by one of the tests here: `tsrl report`
# outputs (a runs/ folder beside REPORT.md) and the `tsrl calibrate` output, by how each was made
# (results/reports/README.md).
COVERED_ABOVE = {COMMITTED, COMMITTED_BUDGET}
CALIBRATED = {"results/reports/prediction_from_sync_trace": ("results/reports/spread_balanced_grpo/runs",
                                                             "results/reports/spread_balanced_opd/runs")}
NOT_REPORT_OUTPUTS = {  # data summaries: results/reports/README.md says what made them and that they do not rebuild
    "results/reports/heldout", "results/reports/heldout_v2", "results/reports/heldout_v3", "results/reports/heldout_v4",
    "results/reports/probe_v4"}
REPORT_FOLDERS = sorted(str(p.parent.relative_to(REPO)) for p in (REPO / "results" / "reports").glob("*/runs"))


def test_every_committed_report_folder_is_rebuilt_by_a_test():
    folders = {str(p.relative_to(REPO)) for p in (REPO / "results" / "reports").iterdir() if p.is_dir()}
    rebuilt = set(REPORT_FOLDERS) | set(CALIBRATED)
    assert folders - rebuilt - NOT_REPORT_OUTPUTS == set()
    assert COVERED_ABOVE <= rebuilt and not (rebuilt & NOT_REPORT_OUTPUTS)


@pytest.mark.parametrize("folder", [f for f in REPORT_FOLDERS if f not in COVERED_ABOVE])
@pytest.mark.slow
def test_each_committed_report_rebuilds(folder, tmp_path):
    """`tsrl report <folder>/runs --out <folder>`, run from the repository root as the folder's REPORT.md says,
    gives its tables, figure data and REPORT.md (PNGs aside)."""
    committed = REPO / folder
    out = tmp_path / "r"
    build(f"{folder}/runs", out, cwd=REPO)
    names = {p.relative_to(committed) for p in [*committed.glob("*/*.csv"), *committed.glob("tables/*.md")]}
    assert names == {p.relative_to(out) for p in [*out.glob("*/*.csv"), *out.glob("tables/*.md")]}
    bad, n = compare_folders(committed, out)
    assert bad == [] and n > 1000, bad[:10]
    assert (out / "REPORT.md").read_text() == (committed / "REPORT.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("folder", sorted(CALIBRATED))
def test_each_committed_calibration_rebuilds(folder, tmp_path):
    """`tsrl calibrate` on the committed runs gives the committed held-out table and rows and the fitted
    terms (the residual figure's PNG aside). About 3 minutes: every held-out fold is a Nelder-Mead fit."""
    from tsrl_cli.report.calibrate import calibrate

    committed = REPO / folder
    with contextlib.chdir(REPO):
        calibrate(list(CALIBRATED[folder]), tmp_path / "c")
    assert (tmp_path / "c" / "heldout.md").read_text() == (committed / "heldout.md").read_text()
    b, n = compare_csv(committed / "heldout_rows.csv", tmp_path / "c" / "heldout_rows.csv")
    assert b == [] and n > 1000, b[:10]
    assert _rounded(json.loads((tmp_path / "c" / "calibration.json").read_text())) == \
        _rounded(json.loads((committed / "calibration.json").read_text()))


def _rounded(doc):
    """A JSON document with every float at 9 significant digits (the fit's sums differ in the last bits)."""
    if isinstance(doc, dict):
        return {k: _rounded(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_rounded(v) for v in doc]
    return float(f"{doc:.9g}") if isinstance(doc, float) else doc
