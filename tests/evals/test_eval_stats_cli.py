"""Wilson interval against hand-computed values; the `tsrl eval` shell (help, kwargs, one JSON document)."""

import json
import math

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.evals.runner import summarize_eval
from tsrl_cli.evals.stats import wilson_interval

# Hand-computed with z = 1.96 (z^2 = 3.8416), centre = (p + z^2/2n)/(1 + z^2/n),
# half = z sqrt(p(1-p)/n + z^2/4n^2)/(1 + z^2/n):
#   0/10:  high = (z^2/n)/(1 + z^2/n) = 0.38416/1.38416 = 0.27754
#   5/10:  centre 0.5, half = 1.96 * sqrt(0.025 + 0.009604)/1.38416 = 0.26341 -> (0.23659, 0.76341)
#   10/10: low = 1/1.38416 = 0.72246 (by symmetry with 0/10)
#   81/263 (p = 0.307985): centre = (0.307985 + 0.0073034)/1.0146068 = 0.310750,
#          half = 1.96 * sqrt(0.00081038 + 0.000013885)/1.0146068 = 0.055462 -> (0.25529, 0.36621)
#   1/1:   centre = (1 + 1.9208)/4.8416 = 0.60327, half = 1.96*sqrt(0.9604)/4.8416 = 0.39673 -> (0.20654, 1.0)
CASES = [((0, 10), (0.0, 0.27754)), ((5, 10), (0.23659, 0.76341)), ((10, 10), (0.72246, 1.0)),
         ((81, 263), (0.25529, 0.36621)), ((1, 1), (0.20654, 1.0))]


@pytest.mark.parametrize("kn,want", CASES)
def test_wilson_hand_computed(kn, want):
    low, high = wilson_interval(*kn, z=1.96)
    assert low == pytest.approx(want[0], abs=2e-5) and high == pytest.approx(want[1], abs=2e-5)


def test_wilson_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(3, 7)
    assert 0 < low < 3 / 7 < high < 1 and math.isclose(wilson_interval(4, 7)[0], 1 - high)  # symmetry
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_summary_leaves_errors_and_ungraded_out_of_n():
    recs = [{"dataset": "d", "instance_id": str(i), "sample": 0, "seed": 0, "resolved": r, "reward": float(bool(r)),
             "error": e, "turns": 1, "tokens": 10, "exit_reason": "submitted"}
            for i, (r, e) in enumerate([(True, False), (False, False), (False, True), (None, False)])]
    s = summarize_eval(recs, label="x", datasets=["d"])
    d = s["datasets"]["d"]
    assert (d["n"], d["resolved"], d["errors"], d["ungraded"], d["success"]) == (2, 1, 1, 1, 0.5)
    assert s["metrics"] == {"eval/d/success": 0.5, "eval/d/n": 2, "eval/d/ci95_low": d["ci95_low"],
                            "eval/d/ci95_high": d["ci95_high"]}


@pytest.mark.parametrize("cmd", ["embedded", "swebench", "tbench"])
def test_help(cmd):
    res = CliRunner().invoke(app, ["eval", cmd, "--help"])
    assert res.exit_code == 0 and "Examples" in res.output


def test_embedded_cli_passes_options_and_prints_one_json(monkeypatch):
    import tsrl_cli.evals.embedded as emb

    seen = {}

    def fake(model, datasets, **kw):
        seen.update(model=model, datasets=list(datasets), **kw)
        return {"label": emb.LABEL, "datasets": {}, "all": {}, "metrics": {}}

    monkeypatch.setattr(emb, "run_embedded_eval", fake)
    res = CliRunner().invoke(app, ["eval", "embedded", "--model", "ckpt", "--datasets", "a,b", "--datasets", "c",
                                   "--seed", "1", "--seed", "2", "--samples", "3", "--temperature", "0.7",
                                   "--max-turns", "5", "--limit", "4", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["label"] == emb.LABEL
    assert seen["model"] == "ckpt" and seen["datasets"] == ["a", "b", "c"] and seen["seeds"] == (1, 2)
    assert (seen["samples"], seen["temperature"], seen["limit"], seen["limits"].max_turns) == (3, 0.7, 4, 5)


@pytest.mark.slow
def test_evals_import_neither_swebench_nor_docker():
    """The optional harness and SDK load only when grading or running a container; `tsrl eval --help` loads no torch."""
    import subprocess
    import sys

    code = ("import sys\nfrom typer.testing import CliRunner\nfrom tsrl_cli.cli import app\n"
            "assert CliRunner().invoke(app, ['eval', 'swebench', '--help']).exit_code == 0\n"
            "assert 'torch' not in sys.modules\n"
            "import tsrl_cli.evals.runner, tsrl_cli.evals.embedded, tsrl_cli.evals.swebench, tsrl_cli.evals.tbench\n"
            "print(sorted(m for m in ('swebench', 'docker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
