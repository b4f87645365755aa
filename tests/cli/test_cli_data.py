"""`tsrl prepare-data` and `tsrl data show|check` through the CLI: all five sources, --json, exit codes."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default --out is data/<source>, relative to the working directory


@pytest.mark.parametrize("source,folder,written", [
    ("swebench-verified", "swebench_verified", 4),
    ("swe-smith", "swe_smith", 4),
    ("terminal-bench", "terminal_bench", 3),
    ("seta-env", "seta_env", 3),
])
def test_each_source_converts_and_checks(fixtures, source, folder, written):
    res = run("prepare-data", source, "--from", fixtures / folder)
    assert res.exit_code == 0, res.output
    assert "input" in res.stdout and f"wrote {written} task(s)" in res.stdout
    name = source.replace("-", "_")
    check = run("data", "check", name)
    assert check.exit_code == 0 and "OK" in check.stdout
    show = run("data", "show", name, "--json")
    assert show.exit_code == 0 and json.loads(show.stdout)["num_tasks"] == written


def test_json_is_one_document(fixtures):
    res = run("prepare-data", "swe-smith", "--from", fixtures / "swe_smith", "--json", "--language", "go")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["written"] == 1 and doc["counts"][-2] == ["language go", 1]
    again = json.loads(run("prepare-data", "swe-smith", "--from", fixtures / "swe_smith", "--json",
                           "--language", "go").stdout)
    assert again["unchanged"] and again["content_sha256"] == doc["content_sha256"]


def test_counts_printed_after_each_filter(fixtures):
    res = run("prepare-data", "swe-smith", "--from", fixtures / "swe_smith", "--exclude", "pandas-dev/*",
              "--no-dedupe", "--allow-empty-statement")
    assert res.exit_code == 0
    lines = [ln for ln in res.stdout.splitlines() if "│" in ln]
    assert [ln.split("│")[1].strip() for ln in lines] == ["input", "valid", "exclude pandas-dev/*"]
    assert lines[-1].split("│")[2].strip() == "4"


def test_malformed_row_exit_2_names_row_and_field(fixtures):
    res = run("prepare-data", "swebench-verified", "--from",
              fixtures / "malformed" / "swebench_missing_base_commit.jsonl")
    assert res.exit_code == 2
    assert "swebench_missing_base_commit.jsonl:2 (django__django-11099): field 'base_commit': missing" in res.stderr
    assert "--on-error skip" in res.stderr


def test_malformed_task_dir_skipped_with_count(fixtures, tmp_path):
    import shutil

    src = tmp_path / "in"
    shutil.copytree(fixtures / "seta_env", src)
    shutil.copytree(fixtures / "malformed" / "tasks" / "no_test_sh", src / "no_test_sh")
    res = run("prepare-data", "seta-env", "--from", src)
    assert res.exit_code == 0 and "skipped 1 malformed input(s)" in res.stdout
    assert "no_test_sh (no_test_sh): field 'tests/test.sh': missing" in res.stdout
    res = run("prepare-data", "seta-env", "--from", src, "--on-error", "fail", "--out", "data/strict")
    assert res.exit_code == 2 and "tests/test.sh" in res.stderr and not (tmp_path / "data" / "strict").exists()


def test_check_exit_1_on_problems_and_2_on_missing(fixtures, tmp_path):
    assert run("prepare-data", "terminal-bench", "--from", fixtures / "terminal_bench").exit_code == 0
    (tmp_path / "data" / "terminal_bench" / "test.parquet").write_bytes(b"not parquet")
    res = run("data", "check", "terminal_bench", "--json")
    assert res.exit_code == 1
    problems = json.loads(res.stdout)["problems"]
    assert problems[0] == "test.parquet: sha256 differs from the manifest" and "not a readable parquet" in problems[1]
    res = run("data", "check", "nothing_here")
    assert res.exit_code == 2 and "no such dataset" in res.stderr


def test_hub_error_is_one_line(monkeypatch):
    import types

    def offline(hub_id):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(HfApi=lambda: types.SimpleNamespace(dataset_info=offline)))
    res = run("prepare-data", "swebench-verified")
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) <= 2
    assert "cannot load princeton-nlp/SWE-bench_Verified from the hub" in res.stderr


def test_help_imports_no_heavy_modules():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from tsrl_cli.cli import app\n"
        "for args in (['--help'], ['prepare-data', '--help'], ['data', 'show', '--help'],\n"
        "             ['data', 'check', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'pyarrow', 'pandas', 'datasets', 'huggingface_hub') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
