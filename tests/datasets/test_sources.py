"""Each source's rows or task directories -> one record, and every malformed field named."""

import json
import shutil

import pytest

from tsrl_cli.datasets import harbor, swe_smith, swebench
from tsrl_cli.datasets.patches import reverse_patch
from tsrl_cli.datasets.records import FieldError


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_swe_smith_row(fixtures):
    row = _rows(fixtures / "swe_smith" / "train.jsonl")[0]
    t = swe_smith.normalize(row)
    assert (t.task_id, t.source, t.split) == ("pandas-dev__pandas.95280573.pr_53652", "swe-smith", "train")
    assert t.repo == "swesmith/pandas-dev__pandas.95280573" and t.upstream_repo == "pandas-dev/pandas"
    assert (t.base_ref, t.ref_kind) == (t.task_id, "branch")  # start state: the branch named instance_id
    assert t.bug_patch == row["patch"] and t.gold_patch == reverse_patch(row["patch"])
    assert t.image == row["image_name"] and t.language == "python"
    assert t.fail_to_pass == row["FAIL_TO_PASS"] and t.test_patch is None
    assert t.meta == {"created_at": "2025-04-01T00:00:00"}


def test_swe_smith_image_derived_when_missing(fixtures):
    row = _rows(fixtures / "swe_smith" / "train.jsonl")[-1]
    assert "image_name" not in row
    t = swe_smith.normalize(row)
    assert t.image == "swebench/swesmith.x86_64.psf_1776_requests.0e322af8" and t.meta["image_derived"]


def test_swebench_classic_and_v5_rows(fixtures):
    rows = _rows(fixtures / "swebench_verified" / "test.jsonl")
    classic, v5 = swebench.normalize(rows[0]), swebench.normalize(rows[-1])
    assert classic.fail_to_pass == ["tests/test_x.py::test_f"]  # decoded from the JSON string
    assert len(classic.pass_to_pass) == 2
    assert (classic.base_ref, classic.ref_kind) == (rows[0]["base_commit"], "commit")
    assert classic.bug_patch is None and classic.gold_patch == rows[0]["patch"] and classic.test_patch
    assert classic.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert classic.eval_script is None and classic.meta["difficulty"] == "15 min - 1 hour"
    assert v5.image == rows[-1]["image"] and "image_derived" not in v5.meta
    assert (v5.log_parser, v5.eval_type) == ("pytest", "pytest") and v5.eval_script.startswith("#!/bin/bash")


@pytest.mark.parametrize("line,field", [
    (2, "patch"), (3, "patch"), (4, "FAIL_TO_PASS"), (5, "FAIL_TO_PASS"), (6, "PASS_TO_PASS"), (7, "instance_id"),
])
def test_swe_smith_malformed_field(fixtures, line, field):
    row = json.loads((fixtures / "malformed" / "swe_smith.jsonl").read_text().splitlines()[line - 1])
    with pytest.raises(FieldError) as e:
        swe_smith.normalize(row)
    assert e.value.field == field


@pytest.mark.parametrize("name,field", [
    ("f2p_bad_json", "FAIL_TO_PASS"), ("partial_v5", "eval_type"), ("missing_base_commit", "base_commit"),
    ("repo_not_owner_name", "repo"),
])
def test_swebench_malformed_field(fixtures, name, field):
    good, bad = _rows(fixtures / "malformed" / f"swebench_{name}.jsonl")
    swebench.normalize(good)
    with pytest.raises(FieldError) as e:
        swebench.normalize(bad)
    assert e.value.field == field


def test_harbor_task(fixtures):
    d = fixtures / "seta_env" / "SETA_Synth" / "ask_ubuntu" / "ask_ubuntu_1042"
    t = harbor.read_task_dir(d, source="seta-env", split="train", rel="SETA_Synth/ask_ubuntu/ask_ubuntu_1042")
    assert (t.task_id, t.format, t.reward_mode) == ("ask_ubuntu_1042", "harbor", "reward_file")
    assert t.instruction.startswith("Create /app/out.txt")
    assert (t.environment_dir, t.test_script, t.solution_script) == ("environment", "tests/test.sh",
                                                                     "solution/solve.sh")
    assert (t.agent_timeout_s, t.verifier_timeout_s, t.build_timeout_s) == (900.0, 120.0, 600.0)
    assert t.meta["difficulty"] == "easy" and t.meta["allow_internet"] is False
    assert t.meta["path"].startswith("SETA_Synth")
    assert t.docker_image is None and len(t.dir_sha256) == 64


def test_harbor_prebuilt_image_and_tb1(fixtures):
    hello = harbor.read_task_dir(fixtures / "terminal_bench" / "hello-world", source="terminal-bench", split="test",
                                 rel="x")
    assert hello.docker_image == "ghcr.io/laude-institute/t-bench/hello-world:2.0"
    tb1 = harbor.read_task_dir(fixtures / "terminal_bench" / "csv-to-parquet", source="terminal-bench", split="test",
                               rel="x")
    assert (tb1.format, tb1.environment_dir, tb1.test_script, tb1.reward_mode) == ("tb1", ".", "run-tests.sh",
                                                                                   "all_tests_pass")
    assert (tb1.agent_timeout_s, tb1.verifier_timeout_s) == (360.0, 60.0)
    assert tb1.instruction == "Convert /app/data.csv to /app/data.parquet." and tb1.meta["parser_name"] == "pytest"


def test_find_task_dirs(fixtures):
    names = [d.name for d in harbor.find_task_dirs(fixtures / "seta_env")]
    assert names == ["ask_ubuntu_1042__b1", "ask_ubuntu_1042__d1", "ask_ubuntu_1042", "nl2bash_0007"]


@pytest.mark.parametrize("name,field", [
    ("no_test_sh", "tests/test.sh"), ("bad_toml", "task.toml"), ("empty_instruction", "instruction.md"),
    ("negative_timeout", "task.toml [verifier] timeout_sec"), ("no_environment", "environment/"),
    ("no_task_toml", "task.toml"), ("tb1_no_difficulty", "task.yaml difficulty"), ("tb1_bad_yaml", "task.yaml"),
])
def test_malformed_task_dir_field(fixtures, name, field):
    with pytest.raises(FieldError) as e:
        harbor.read_task_dir(fixtures / "malformed" / "tasks" / name, source="seta-env", split="train", rel=name)
    assert e.value.field == field


def test_tb1_without_run_tests_uses_test_outputs(fixtures, tmp_path):
    d = shutil.copytree(fixtures / "terminal_bench" / "csv-to-parquet", tmp_path / "t")
    (d / "run-tests.sh").unlink()
    task = harbor.read_task_dir(d, source="terminal-bench", split="test", rel="t")
    assert task.test_script == "tests/test_outputs.py"
