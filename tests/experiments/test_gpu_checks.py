"""experiments/gpu_checks.sh as a dry run on the CPU (--cpu: every step at tiny shapes, the same table), so that a
broken script is caught here rather than on the first GPU lent. Its verdicts come from each step's own JSON: the
controls below show a step that does not run, and a stream that is not exact, turn the table and the exit code to
failure."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["exact_one_device", "plan_vs_measured", "compute_full_device", "compute_full_host", "compute_lora",
         "exact_group_grpo", "exact_group_opd_lora", "engine_rounds_hf", "engine_rounds_vllm", "host_fold"]


def dry_run(out: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    res = subprocess.run(["bash", "experiments/gpu_checks.sh", "--cpu", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, check=False,
                         env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env})
    table = (out / "table.md").read_text().splitlines() if (out / "table.md").is_file() else []
    return res, table


def verdicts(table: list[str]) -> dict[str, set[str]]:
    """step -> the verdicts of its rows."""
    out: dict[str, set[str]] = {}
    for line in table:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "step":
            out.setdefault(cells[0], set()).add(cells[4])
    return out


@pytest.mark.slow
def test_the_dry_run_passes_every_step_and_ends_in_one_table(tmp_path):
    res, table = dry_run(tmp_path / "dry")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    v = verdicts(table)
    assert table[0] == "gpu_checks on cpu (the dry run: tiny shapes, GPU targets not judged)"
    assert list(v) == STEPS  # every step has rows, in the script's order
    assert v["engine_rounds_vllm"] == {"skipped"}  # vLLM on CPU is the vllm-marked tests' business
    for step in ("exact_one_device", "exact_group_grpo", "exact_group_opd_lora", "plan_vs_measured",
                 "engine_rounds_hf"):
        assert v[step] == {"PASS"}, (step, v[step])
    for step in ("compute_full_device", "compute_full_host", "compute_lora"):  # float64: stream's gradient is sync's
        assert v[step] == {"dry run", "PASS"}, (step, v[step])
    assert table[-1] == "gpu_checks: every check passed"
    for step in STEPS[:-2]:
        assert (tmp_path / "dry" / f"{step}.log").is_file()


def test_control_a_step_out_of_the_time_budget_fails_the_table(tmp_path):
    res, table = dry_run(tmp_path / "budget", TSRL_GPU_CHECKS_BUDGET_S="5")
    assert res.returncode == 1
    v = verdicts(table)
    assert v["exact_one_device"] == {"ERROR"} and v["host_fold"] == {"ERROR"}
    assert "not run: out of the time budget" in "\n".join(table) and table[-1].startswith("gpu_checks: FAILED")


@pytest.mark.slow
def test_control_a_stream_that_is_not_exact_fails_the_table(tmp_path):
    """The first fold of round 1 dropped (the certificate's fault injection): stream's weights leave sync's."""
    res, table = dry_run(tmp_path / "broken", TSRL_GPU_CHECKS_STEPS="exact_one_device",
                         TSRL_BREAK_FOLD_AT_ROUND="1:drop")
    assert res.returncode == 1, res.stdout[-3000:]
    v = verdicts(table)
    assert v["exact_one_device"] == {"FAIL"} and v["host_fold"] == {"skipped"}
    assert table[-1] == "gpu_checks: FAILED: exact_one_device"
