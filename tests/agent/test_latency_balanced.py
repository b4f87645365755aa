"""balanced_median_s: Monte Carlo E[max] against a quadrature reference; the family's YAMLs use it."""

import importlib.util
import math
from pathlib import Path

import pytest
import yaml

from tsrl_cli.agent.latency import ToolLatency, balanced_median_s, expected_max_total_s
from tsrl_cli.config import load_config

ROOT = Path(__file__).resolve().parents[2]
FAMILY = ROOT / "experiments" / "spread_balanced"


def _derive_script():
    spec = importlib.util.spec_from_file_location("derive_medians", FAMILY / "derive_medians.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _expected_max_lognormal(n: int, sigma: float) -> float:
    """E[max of n iid median-1 lognormals] = int (1 - Phi(z)^n) d(e^(sigma z)), by the trapezoid rule."""

    def phi(z: float) -> float:
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

    lo, hi, steps = -12.0, 12.0, 48_000
    h = (hi - lo) / steps
    f = [(1.0 - phi(lo + i * h) ** n) * sigma * math.exp(sigma * (lo + i * h)) for i in range(steps + 1)]
    return h * (sum(f) - 0.5 * (f[0] + f[-1]))


@pytest.mark.parametrize("sigma", [0.5, 1.0])
def test_monte_carlo_max_matches_quadrature(sigma):
    mc = expected_max_total_s(ToolLatency.lognormal(1.0, sigma), [1] * 8, samples=20_000, seed=1)
    assert mc == pytest.approx(_expected_max_lognormal(8, sigma), rel=0.02)


def test_sigma_zero_keeps_the_base_latency_and_spread_lowers_the_median():
    calls = [4] * 4 + [2] * 4
    assert balanced_median_s(0.5, 0.0, calls, samples=10) == pytest.approx(0.5)
    assert balanced_median_s(0.5, 0.0, calls, extra_s=0.4, samples=10) == pytest.approx(0.6)  # (4 * 0.5 + 0.4) / 4
    meds = [balanced_median_s(0.5, s, calls, samples=2_000) for s in (0.5, 1.0, 1.5)]
    assert meds == sorted(meds, reverse=True) and meds[0] < 0.5


@pytest.mark.parametrize("path", sorted(FAMILY.glob("*_sigma*.yaml")), ids=lambda p: p.name)
def test_family_medians_are_the_derived_ones(path):
    assert load_config(path).rollout.tool_latency_sigma >= 0  # strict keys and types: the file loads
    ro = yaml.safe_load(path.read_text())["rollout"]
    objective, script = path.name.split("_")[0], _derive_script()
    sigma = ro["tool_latency_sigma"]
    derived = balanced_median_s(script.BASE_S[objective], sigma, script.CALLS_N[objective],
                                script.EXTRA_S[objective].get(sigma, 0.0), samples=2_000, seed=0)
    assert ro["tool_latency_median_s"] == pytest.approx(derived, rel=0.03)  # 2,000 samples here, 20,000 there
