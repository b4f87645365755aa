"""`tsrl eval tbench`: Harbor-format tasks end to end in the local sandbox (the embedded terminal tasks),
the docker executor's refusals without a daemon, and --via-harbor's command and prerequisites."""

import json

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.embedded.policy.demos import say
from tsrl_cli.embedded.terminal_suite import solution_commands
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.envs.images import image_workdir
from tsrl_cli.envs.terminal import TerminalEnv
from tsrl_cli.errors import UsageError
from tsrl_cli.evals import tbench as tb

BOGUS_DOCKER = "unix:///nonexistent/tsrl-test-docker.sock"


@pytest.fixture(scope="module")
def tbds(tmp_path_factory, prepare_fixture):
    out = tmp_path_factory.mktemp("ds") / "terminal_bench"
    return prepare_fixture("terminal-bench", "tests/fixtures/terminal_bench", out)


@pytest.mark.sandboxed
def test_local_end_to_end_known_count(suite, tok, tmp_path):
    ds = open_dataset(str(suite / "embedded_terminal_heldout"))
    d, tasks = ds.path, ds.tasks
    solve = {tasks[0].task_id, tasks[2].task_id}
    fixes = [(t.instruction.strip(), t.task_id, " && ".join(solution_commands(d / t.task_dir))) for t in tasks]

    def script(context, turn):
        _, task_id, cmd = next(f for f in fixes if f[0] in context)
        return say("do it", cmd) if turn == 0 and task_id in solve else "```bash\nsubmit\n```"

    s = tb.run_tbench(None, dataset=str(d), executor="local", policy=(ScriptedEngine(tok, script), tok),
                      out_dir=tmp_path / "out")
    part = s["datasets"]["embedded_terminal_heldout"]
    assert (part["n"], part["resolved"]) == (3, 2)
    assert s["label"] == "embedded_terminal_heldout: Harbor-format tasks in the local sandbox (not Terminal-Bench)"
    recs = [json.loads(x) for x in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert sorted(r["instance_id"] for r in recs if r["resolved"]) == sorted(solve)
    assert all(r["patch"] is None and r["reward"] in (0.0, 1.0) for r in recs)


@pytest.mark.sandboxed
def test_cli_local_with_a_checkpoint(suite, ckpt, tmp_path):
    res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(suite / "embedded_terminal_heldout"),
                                   "--executor", "local", "--model", str(ckpt), "--limit", "1", "--max-turns", "1",
                                   "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["all"]["n"] == 1 and "not Terminal-Bench" in doc["label"] and doc["config"]["executor"] == "local"


def test_docker_executor_without_daemon_exit_2(tbds, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", BOGUS_DOCKER)
    for loader in ("open_engine", "agent_tokenizer"):
        monkeypatch.setattr(tb, loader, lambda *a, **k: pytest.fail("model loaded without Docker"))
    res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(tbds), "--model", "m",
                                   "--instances", "hello-world"])
    assert res.exit_code == 2 and "needs Docker" in res.stderr and res.stdout == ""
    # tasks that ship only a Dockerfile are built, which needs the daemon too: refused before any build
    res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(tbds), "--agent", "oracle"])
    assert res.exit_code == 2 and "needs Docker" in res.stderr and res.stdout == ""


def test_via_harbor_needs_harbor_on_path(tbds, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no harbor here
    res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(tbds), "--via-harbor",
                                   "--instances", "hello-world"])
    assert res.exit_code == 2 and "harbor" in res.stderr and "Python >= 3.12" in res.stderr
    assert "--harbor-in-docker" in res.stderr  # the way out on a machine without Python 3.12
    res = CliRunner().invoke(app, ["eval", "tbench", "--dataset", str(tbds), "--via-harbor"])
    assert res.exit_code == 2 and "Terminal-Bench 1.x" in res.stderr  # csv-to-parquet is a 1.x task


def test_via_harbor_checks_the_endpoint(tbds, monkeypatch, tmp_path):
    fake = tmp_path / "harbor"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(UsageError, match="no OpenAI-compatible server"):
        tb.run_via_harbor(dataset=str(tbds), served_model="tsrl-policy", endpoint="http://127.0.0.1:9/v1",
                          env="daytona", instances=["hello-world"], out_dir=tmp_path / "out")


def test_harbor_command():
    cmd = tb.harbor_command("data/tb/tasks", served_model="tsrl-policy", endpoint="http://127.0.0.1:8000/v1",
                            jobs_dir="out/harbor", job_name="j1", workers=2, include=["hello-world"])
    assert cmd == ["harbor", "run", "--path", "data/tb/tasks", "--agent", "terminus-2", "--model", "openai/tsrl-policy",
                   "--agent-kwarg", "api_base=http://127.0.0.1:8000/v1", "--n-concurrent", "2", "--env", "docker",
                   "--jobs-dir", "out/harbor", "--job-name", "j1", "--include-task-name", "hello-world"]


def test_harbor_control_agents_get_no_model_and_in_docker_mounts(tmp_path, monkeypatch):
    cmd = tb.harbor_command("/d/tasks", served_model="m", endpoint="http://x/v1", jobs_dir="/o/harbor", job_name="j",
                            agent="oracle", harbor=["docker", "run", "img", "harbor"])
    assert cmd[:6] == ["docker", "run", "img", "harbor", "run", "--path"] and "--model" not in cmd
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/other.sock")
    pre = tb.harbor_in_docker("img:1", tmp_path / "tasks", tmp_path / "jobs")
    assert "/run/other.sock:/var/run/docker.sock" in pre and f"{tmp_path}/tasks:{tmp_path}/tasks:ro" in pre
    assert f"{tmp_path}/jobs:{tmp_path}/jobs" in pre and pre[-2:] == ["img:1", "harbor"]
    job = tmp_path / "job"
    job.mkdir()
    assert tb.harbor_scores(job) is None
    (job / "result.json").write_text(json.dumps({"stats": {"evals": {"oracle__tasks": {
        "n_trials": 2, "n_errors": 0, "metrics": [{"mean": 0.5}]}}}}))
    assert tb.harbor_scores(job) == {"oracle__tasks": {"trials": 2, "errors": 0, "mean": 0.5}}


def test_image_workdir_and_docker_env_prefix(tbds, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM ubuntu\nWORKDIR /srv\nRUN true\nworkdir /work/app\n")
    assert image_workdir(tmp_path) == "/work/app"
    assert image_workdir(tmp_path / "none") == "/app"
    ds = open_dataset(str(tbds))
    d, tasks = ds.path, ds.tasks
    env = TerminalEnv({t.task_id: t for t in tasks}["hello-world"], d, executor="docker")
    seen = []
    env.sandbox = type("S", (), {"run": lambda self, c, t, mounts=None: seen.append(c)})()
    env.exec("ls", 5)
    assert seen == [f"cd {env.workdir} && ls"] and env.image == "ghcr.io/laude-institute/t-bench/hello-world:2.0"
