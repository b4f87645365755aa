"""Fixture paths: small inputs in each source's real format (tests/fixtures), no hub access."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
