"""Shared fixtures: tiny models built locally from a config (no hub), one torch thread."""

import pytest
import torch

torch.set_num_threads(1)  # measured here: extra OpenMP threads beside a busy process run far slower


@pytest.fixture(scope="session")
def tiny64():
    from tsrl_cli.models import build_tiny_model

    return build_tiny_model(seed=0, dtype=torch.float64)


@pytest.fixture(scope="session")
def teacher64():
    from tsrl_cli.models import build_tiny_model

    return build_tiny_model(seed=1000, dtype=torch.float64)


@pytest.fixture(scope="session")
def prepare_fixture():
    """prepare_fixture(SOURCE, ORIGIN, OUT): `tsrl prepare-data SOURCE --from ORIGIN --out OUT` through the
    CLI, as a user would run it; returns OUT."""
    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    def run(source: str, origin, out):
        res = CliRunner().invoke(app, ["prepare-data", source, "--from", str(origin), "--out", str(out), "--json"])
        assert res.exit_code == 0, res.output
        return out

    return run
