"""Fixtures for the report tests: synthetic results trees made in the test (synthetic_runs.py), the
committed runs of results/reports/spread_grpo_small and results/reports/budget_tis, and a report built
from each, once per session."""

import pytest
from report_helpers import COMMITTED, COMMITTED_BUDGET, REPO, build
from synthetic_runs import make_run, make_tree


@pytest.fixture(scope="session")
def results_tree(tmp_path_factory):
    root = make_tree(tmp_path_factory.mktemp("results"))
    make_run(root / "spread_high" / "stream" / "seed45", "spread_high", "stream", 45, 1.0, done=False)
    return root


@pytest.fixture(scope="session")
def built(results_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return out, build(results_tree, out)


@pytest.fixture(scope="session")
def built_async(tmp_path_factory):
    """sync, stream and async runs of one experiment, seeds 1 and 2, 7 rounds."""
    root = make_tree(tmp_path_factory.mktemp("async") / "r", experiments=(("e", 0.5),), schedules=("sync", "stream"),
                     seeds=(1, 2), rounds=7)
    for seed in (1, 2):  # an "async" schedule row: the synthetic generator treats it like stream timing-wise
        make_run(root / "e" / "async" / f"seed{seed}", "e", "stream", seed, 0.5, rounds=7)
    out = root / "report"
    return out, build(root, out)


@pytest.fixture(scope="session")
def built_committed(tmp_path_factory):
    """The committed report rebuilt from its committed runs, as its REPORT.md says it was made (from the
    repository root, so that REPORT.md names the same results directory)."""
    out = tmp_path_factory.mktemp("committed")
    return out, build(f"{COMMITTED}/runs", out, cwd=REPO)


@pytest.fixture(scope="session")
def built_budget(tmp_path_factory):
    """The committed fixed-budget report (stream, async with and without TIS) rebuilt from its committed runs."""
    out = tmp_path_factory.mktemp("budget_tis")
    return out, build(f"{COMMITTED_BUDGET}/runs", out, cwd=REPO)
