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
