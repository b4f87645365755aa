"""experiments/gpu_checks.sh: its plan checked without running anything (--dry-run: the steps' caps add up to at most
the budget, at most 8 files come back from a lent GPU), and the script run on the CPU (--cpu: every step at tiny
shapes, the same table), so that a broken script is caught here rather than on the first GPU lent. Its verdicts
come from each step's own JSON: the controls below show a budget the caps overrun, a step that does not run, and a
stream that is not exact, turn the dry run, the table and the exit code to failure."""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["exact_one_device", "plan_vs_measured", "fsdp_rank_8b", "compute_full_device", "compute_full_host",
         "compute_lora", "engine_rounds_hf", "host_fold"]
MAX_FILES_BACK = 8  # what a lent GPU's $OUT brings back (the device tool's limit)


def script(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "experiments/gpu_checks.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, check=False,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env})


def dry_run_plan(res: subprocess.CompletedProcess) -> tuple[dict[str, int], int, list[str]]:
    """({step: cap seconds}, budget seconds, output files) from --dry-run's lines."""
    lines = res.stdout.splitlines()
    budget = int(lines[0].rsplit("budget ", 1)[1].split()[0])
    caps = {}
    for line in lines[2:]:
        if line.startswith("outputs: "):
            outputs = line.removeprefix("outputs: ").split(" (")[0].split()
            break
        name, cap, _ = line.split(maxsplit=2)
        caps[name] = int(cap)
    return caps, budget, outputs


@pytest.mark.parametrize("mode", [[], ["--cpu"]], ids=["gpu", "cpu"])
def test_the_dry_run_fits_the_caps_in_the_budget_and_runs_nothing(tmp_path, mode):
    """One lent GPU: at most 8 minutes of steps, each capped, the caps within the budget; 3 files written, of the 8
    that come back. The interpreter is /bin/false, and OUT an empty folder: a dry run that ran anything would fail
    or leave a file there."""
    res = script("--dry-run", *mode, PYTHON="/bin/false", OUT=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    caps, budget, outputs = dry_run_plan(res)
    assert list(caps) == STEPS
    assert sum(caps.values()) <= budget
    assert res.stdout.splitlines()[-1] == f"caps {sum(caps.values())} s <= budget {budget} s"
    if not mode:
        assert budget <= 8 * 60
    assert outputs == ["table.md", "env.txt", "steps.tar.gz"] and len(outputs) <= MAX_FILES_BACK
    assert list(tmp_path.iterdir()) == []


def test_control_caps_past_the_budget_fail_the_dry_run():
    res = script("--dry-run", TSRL_GPU_CHECKS_BUDGET_S="100")
    caps, budget, _ = dry_run_plan(res)
    assert budget == 100 and sum(caps.values()) > budget
    assert res.returncode == 1 and "> budget 100 s" in res.stdout


def cpu_run(out: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    res = script("--cpu", str(out), **env)
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
def test_the_cpu_run_passes_every_step_and_ends_in_one_table(tmp_path):
    res, table = cpu_run(tmp_path / "cpu")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    v = verdicts(table)
    assert table[0] == "gpu_checks on cpu (the CPU run: tiny shapes, GPU targets not judged)"
    assert list(v) == STEPS  # every step has rows, in the script's order
    for step in ("exact_one_device", "plan_vs_measured", "engine_rounds_hf"):
        assert v[step] == {"PASS", "-"}, (step, v[step])
    assert v["fsdp_rank_8b"] == {"CPU run", "PASS", "-"}  # the pinned sets asked are the plan's; no device counter
    for step in ("compute_full_device", "compute_full_host", "compute_lora"):  # float64: stream's gradient is sync's
        assert v[step] == {"CPU run", "PASS", "-"}, (step, v[step])
    assert table[-1] == "gpu_checks: every check passed"
    files = sorted(p.name for p in (tmp_path / "cpu").iterdir())
    assert files == ["env.txt", "steps.tar.gz", "table.md"]
    with tarfile.open(tmp_path / "cpu" / "steps.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"steps.tsv", *(f"{s}.log" for s in STEPS), *(f"{s}.out" for s in STEPS)} <= names


@pytest.mark.slow
def test_control_a_step_out_of_the_time_budget_fails_the_table(tmp_path):
    res, table = cpu_run(tmp_path / "budget", TSRL_GPU_CHECKS_BUDGET_S="5")
    assert res.returncode == 1
    v = verdicts(table)
    assert v["exact_one_device"] == {"ERROR"} and v["host_fold"] == {"ERROR"}
    assert "not run: out of the time budget" in "\n".join(table) and table[-1].startswith("gpu_checks: FAILED")


@pytest.mark.slow
def test_control_a_stream_that_is_not_exact_fails_the_table(tmp_path):
    """The first fold of round 1 dropped (the certificate's fault injection): stream's weights leave sync's."""
    res, table = cpu_run(tmp_path / "broken", TSRL_GPU_CHECKS_STEPS="exact_one_device",
                         TSRL_BREAK_FOLD_AT_ROUND="1:drop")
    assert res.returncode == 1, res.stdout[-3000:]
    v = verdicts(table)
    assert v["exact_one_device"] == {"FAIL", "-"} and v["host_fold"] == {"skipped"}
    assert table[-1] == "gpu_checks: FAILED: exact_one_device"
