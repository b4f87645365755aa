"""`tsrl eval swebench` up to where Docker is needed: the no-Docker exit, the predictions format (checked
by swebench's own loaders), grading saved test logs with swebench's parser and report, the harness's
command line, and the commands the agent's container would run.

Tests marked with `swebench` need `pip install -e '.[swebench]'` (swebench 5.x) and are skipped without it.
"""

import asyncio
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.errors import UsageError
from tsrl_cli.evals import swebench as sb
from tsrl_cli.evals.runner import docker_unavailable_reason
from tsrl_cli.files import write_jsonl_atomic
from tsrl_cli.sandbox import ExecResult

BOGUS_DOCKER = "unix:///nonexistent/tsrl-test-docker.sock"
IID = "psf__requests-2317"
EVAL_SCRIPT = """#!/bin/bash
set -uxo pipefail
cd /testbed
git checkout abc tests/test_x.py
: '>>>>> Start Test Output'
pytest -rA tests/test_x.py
: '>>>>> End Test Output'
git checkout abc tests/test_x.py
"""


def swebench_or_skip():
    return pytest.importorskip("swebench", reason="swebench is not installed (pip install -e '.[swebench]')")


@pytest.fixture(scope="module")
def ds(tmp_path_factory, prepare_fixture):
    out = tmp_path_factory.mktemp("ds") / "swebench_verified"
    return prepare_fixture("swebench-verified", "tests/fixtures/swebench_verified/test.jsonl", out)


@pytest.fixture
def no_docker(monkeypatch):
    """A Docker host that does not exist, and a model loader that must never be reached."""
    monkeypatch.setenv("DOCKER_HOST", BOGUS_DOCKER)

    def never(*a, **k):
        raise AssertionError("a model was loaded although Docker is missing")

    monkeypatch.setattr(sb, "open_engine", never)
    monkeypatch.setattr(sb, "agent_tokenizer", never)


def row(ds, iid=IID):
    from tsrl_cli.datasets.store import open_dataset

    t = {t.task_id: t for t in open_dataset(str(ds)).tasks}[iid]
    r = sb.harness_row(t)
    # the fixture's names are not 5.x names
    r.update(eval_script=EVAL_SCRIPT, log_parser="parse_log_pytest", eval_type="pass_and_fail")
    return r


# -- no Docker ---------------------------------------------------------------------------------------------

def test_docker_reason_names_the_bogus_host(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", BOGUS_DOCKER)
    reason = docker_unavailable_reason()
    assert reason is not None and ("nonexistent" in reason or "not on PATH" in reason or "not installed" in reason)


@pytest.mark.parametrize("extra", [["--no-grade"], ["--harness-dataset", "SWE-bench/SWE-bench_Verified"]])
def test_no_docker_exit_2_before_any_model(ds, no_docker, extra):
    res = CliRunner().invoke(app, ["eval", "swebench", "--model", "some/model", "--dataset", str(ds),
                                   "--instances", IID, *extra])
    assert res.exit_code == 2, res.output
    assert "needs Docker" in res.stderr and "Nothing was run or graded" in res.stderr
    assert "resolved" not in res.stdout and res.stdout == ""  # no score, nothing on stdout


def test_grade_only_without_docker_exit_2(ds, tmp_path, no_docker):
    preds = tmp_path / "preds.jsonl"
    pred = {"instance_id": IID, "model_name_or_path": "m", "model_patch": "diff --git a/x b/x\n"}
    preds.write_text(json.dumps(pred) + "\n")
    write_jsonl_atomic(tmp_path / "rows.jsonl", [row(ds)])
    res = CliRunner().invoke(app, ["eval", "swebench", "--grade-only", str(preds), "--harness-dataset",
                                   str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 2 and "needs Docker" in res.stderr and res.stdout == ""


@pytest.mark.parametrize(("args", "message"), [
    (["--agent", "oracle", "--dataset", "/nonexistent/swebench_local"],
     "/nonexistent/swebench_local: no such dataset"),
    (["--agent", "oracle", "--instances", "nope__nope-1"], "--instances: nope__nope-1 not in"),
    (["--agent", "oracle", "--model", "some/model"], "--agent oracle needs no model: drop --model some/model"),
    (["--agent", "bogus"], "--agent 'bogus': use one of policy, oracle, nop"),
    ([], "--model DIR_OR_ID is required"),
    (["--grade-only", "PREDS", "--harness-dataset", "/nonexistent/rows.jsonl"],
     "/nonexistent/rows.jsonl: no such file"),
    (["--grade-only", "PREDS", "--dataset", "/nonexistent/swebench_local"],
     "/nonexistent/swebench_local: no such dataset"),
    (["--grade-only", "PREDS_UNKNOWN"], "instance nope__nope-1 is not in"),
])
def test_bad_input_is_one_line_exit_2_before_docker(ds, tmp_path, no_docker, args, message):
    """Each refusal names the place and the fix, in one line, before Docker or a model is needed."""
    for name, iid in (("PREDS", IID), ("PREDS_UNKNOWN", "nope__nope-1")):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"instance_id": iid, "model_name_or_path": "m",
                                                            "model_patch": ""}) + "\n")
    args = [str(tmp_path / f"{a}.jsonl") if a.startswith("PREDS") else a for a in args]
    if "--dataset" not in args:
        args += ["--dataset", str(ds)]
    res = CliRunner().invoke(app, ["eval", "swebench", *args, "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and "needs Docker" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()  # one error line, after at most the engine device line
    assert lines[-1].startswith("error:") and len(lines) <= 2 and res.stdout == ""
    assert all(ln.startswith("· engine device: ") for ln in lines[:-1])
    if "no such dataset" in message:
        assert "tsrl prepare-data swebench-local" in res.stderr  # the fix


def test_rows_without_5x_columns_refused_before_docker(ds, no_docker):
    res = CliRunner().invoke(app, ["eval", "swebench", "--model", "m", "--dataset", str(ds)])
    assert res.exit_code == 2 and "django__django-11099 has no eval_script" in res.stderr


# -- predictions ---------------------------------------------------------------------------------------------

def test_predictions_schema(tmp_path):
    recs = [{"instance_id": "a__b-1", "patch": "diff --git a/f b/f\n"}, {"instance_id": "a__b-2", "patch": None}]
    preds = sb.predictions_from_records(recs, "results/ckpt")
    assert preds == [{"instance_id": "a__b-1", "model_name_or_path": "results/ckpt",
                      "model_patch": "diff --git a/f b/f\n"},
                     {"instance_id": "a__b-2", "model_name_or_path": "results/ckpt", "model_patch": ""}]
    write_jsonl_atomic(tmp_path / "p.jsonl", preds)
    assert sb.read_predictions(tmp_path / "p.jsonl") == preds
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instance_id": "x", "model_patch": ""}\n')
    with pytest.raises(UsageError, match="bad.jsonl:1: field 'model_name_or_path'"):
        sb.read_predictions(bad)


def test_predictions_accepted_by_swebench(ds, tmp_path, monkeypatch):
    swebench_or_skip()
    from swebench.harness.run_evaluation import get_dataset_from_preds
    from swebench.harness.utils import get_predictions_from_file, make_test_spec

    monkeypatch.chdir(tmp_path)  # the harness looks for earlier reports under ./logs
    rows = [row(ds)]
    write_jsonl_atomic(tmp_path / "rows.jsonl", rows)
    preds = sb.predictions_from_records([{"instance_id": IID, "patch": "diff --git a/f b/f\n"}], "tsrl/ckpt")
    write_jsonl_atomic(tmp_path / "predictions.jsonl", preds)
    got = get_predictions_from_file(str(tmp_path / "predictions.jsonl"), str(tmp_path / "rows.jsonl"), "test")
    assert got == preds
    todo = get_dataset_from_preds(str(tmp_path / "rows.jsonl"), "test", [IID], {p["instance_id"]: p for p in got},
                                  "run1", rewrite_reports=False)
    assert [r["instance_id"] for r in todo] == [IID]
    spec = make_test_spec(rows[0])
    assert spec.image == "swebench/sweb.eval.x86_64.psf_1776_requests-2317:latest"
    assert spec.FAIL_TO_PASS == ["tests/test_x.py::test_f"]
    sb.check_row_columns(rows, "rows")
    sb.check_row_parsers(rows, "rows")
    with pytest.raises(UsageError, match="not a swebench parser"):
        sb.check_row_parsers([{**rows[0], "log_parser": "pytest"}], "rows")


# -- grading saved logs --------------------------------------------------------------------------------------

def make_log(statuses: dict[str, str], exit_code: int) -> str:
    lines = [f"{s} {t}" + (" - assert 1 == 2" if s == "FAILED" else "") for t, s in statuses.items()]
    return ("+ cd /testbed\n>>>>> Start Test Output\n" + "\n".join(lines) + "\n>>>>> End Test Output\n"
            f">>>>> Test Exit Code: {exit_code}\n")


TESTS = ("tests/test_x.py::test_f", "tests/test_x.py::test_g", "tests/test_x.py::test_h")


def test_grade_saved_test_logs(ds, tmp_path):
    swebench_or_skip()
    r = row(ds)
    pred = {"instance_id": IID, "model_name_or_path": "m", "model_patch": "diff --git a/f b/f\n"}
    ok = tmp_path / "ok.txt"
    ok.write_text(make_log(dict.fromkeys(TESTS, "PASSED"), 0))
    rep = sb.grade_test_log(r, pred, ok)
    assert rep["resolved"] and rep["patch_successfully_applied"]
    assert rep["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_x.py::test_f"]
    bad = tmp_path / "bad.txt"
    bad.write_text(make_log({TESTS[0]: "FAILED", TESTS[1]: "PASSED", TESTS[2]: "PASSED"}, 1))
    rep = sb.grade_test_log(r, pred, bad)
    assert not rep["resolved"] and rep["tests_status"]["FAIL_TO_PASS"]["failure"] == [TESTS[0]]
    assert len(rep["tests_status"]["PASS_TO_PASS"]["success"]) == 2


def test_harness_report_read_back(ds, tmp_path, monkeypatch):
    """The harness's own re-grading path (rewrite_reports, no container) and run report, read by tsrl."""
    swebench_or_skip()
    from swebench.harness.reporting import make_run_report
    from swebench.harness.run_evaluation import run_instance
    from swebench.harness.utils import make_test_spec

    monkeypatch.chdir(tmp_path)
    r = row(ds)
    preds = {IID: {"instance_id": IID, "model_name_or_path": "tsrl/ckpt", "model_patch": "diff --git a/f b/f\n"}}
    logs = tmp_path / "logs" / "run_evaluation" / "run1" / "tsrl__ckpt" / IID
    logs.mkdir(parents=True)
    (logs / "test_output.txt").write_text(make_log(dict.fromkeys(TESTS, "PASSED"), 0))
    run_instance(make_test_spec(r), preds[IID], None, "run1", rewrite_reports=True)
    path = make_run_report(preds, [r], "run1", client=None, report_dir=str(tmp_path))
    assert path == sb.report_path(tmp_path, "tsrl/ckpt", "run1")
    s = sb.summary_from_report(json.loads(path.read_text()), [IID], "swebench_verified",
                               sb.label("5.0.2", "swebench_verified"))
    d = s["datasets"]["swebench_verified"]
    assert (d["n"], d["resolved"], s["harness"]["resolved_instances"]) == (1, 1, 1)
    assert s["label"].startswith("swebench_verified: SWE-bench-format")
    assert "official swebench 5.0.2 harness" in s["label"]


def test_harness_command_matches_the_harness(tmp_path):
    swebench_or_skip()
    cmd = sb.harness_command("rows.jsonl", tmp_path / "p.jsonl", "run1", tmp_path, workers=2, instance_ids=["a", "b"])
    assert cmd[:3] == [sys.executable, "-m", "swebench.harness.run_evaluation"]
    assert cmd[-3:] == ["--instance_ids", "a", "b"]
    help_text = subprocess.run(cmd[:3] + ["--help"], check=False, capture_output=True, text=True, timeout=120).stdout
    for flag in (x for x in cmd if x.startswith("--")):
        assert flag in help_text, flag


def test_harness_failure_is_not_a_score(ds, tmp_path, monkeypatch):
    """The real harness, run without a daemon, fails at Docker; tsrl reports nothing graded."""
    swebench_or_skip()
    monkeypatch.setenv("DOCKER_HOST", BOGUS_DOCKER)
    write_jsonl_atomic(tmp_path / "rows.jsonl", [row(ds)])
    write_jsonl_atomic(tmp_path / "p.jsonl",
                       [{"instance_id": IID, "model_name_or_path": "m", "model_patch": "diff --git a/f b/f\n"}])
    with pytest.raises(sb.HarnessError, match="Nothing was graded"):
        sb.grade(tmp_path / "p.jsonl", str(tmp_path / "rows.jsonl"), tmp_path, run_id="r1", workers=1)
    log = (tmp_path / "harness.log").read_text()
    assert "swebench.harness.run_evaluation" in log and "DockerException" in log  # past its argument parsing


# -- the agent's container -----------------------------------------------------------------------------------

class FakeSandbox:
    executor = "docker"

    def __init__(self):
        self.commands = []

    def run(self, command, timeout_s, mounts=None):
        self.commands.append(command)
        out = "f\0\0TSRL-DIFF\0diff --git a/f b/f\n" if "git diff --cached" in command else "ok\n"
        return ExecResult(out, "", 0, 0.1)

    def close(self):
        pass


def test_env_runs_in_testbed_and_collects_the_diff(ds):
    from tsrl_cli.datasets.store import open_dataset

    task = {t.task_id: t for t in open_dataset(str(ds)).tasks}[IID]
    env = sb.SWEbenchEnv(task)
    env.sandbox = FakeSandbox()
    out = asyncio.run(env.run("ls", 5))
    assert out.exit_code == 0 and env.sandbox.commands[0].startswith("cd /testbed && ")
    assert env.sandbox.commands[0].endswith("\nls") and "activate testbed" in env.sandbox.commands[0]
    assert asyncio.run(env.patch()) == "diff --git a/f b/f\n"
    assert env.sandbox.commands[1].startswith("cd /testbed && ") and "git add -A && " in env.sandbox.commands[1]
    assert env.sandbox.commands[1].endswith(f"git diff --cached --no-renames --binary --no-color {task.base_ref}")
    rew = asyncio.run(env.reward())
    assert rew.details == {"graded": False}
    assert "The repository is in the current directory" in env.instruction and env.image == task.image
