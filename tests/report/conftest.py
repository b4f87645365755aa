"""Fixtures for the report tests: a synthetic results tree made in the test (synthetic_runs.py)."""

import pytest
from synthetic_runs import make_run, make_tree


@pytest.fixture(scope="module")
def results_tree(tmp_path_factory):
    root = make_tree(tmp_path_factory.mktemp("results"))
    make_run(root / "spread_high" / "stream" / "seed45", "spread_high", "stream", 45, 1.0, done=False)
    return root
