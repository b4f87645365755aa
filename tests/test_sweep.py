"""`tsrl sweep`: the plan (experiments x seeds x schedules, run dirs, status on disk), --dry-run, bad
input (exit 2), and a tiny real sweep on the toy workload that a second invocation skips and that
`tsrl report` reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tsrl_cli.config import dump_config
from tsrl_cli.errors import UsageError
from tsrl_cli.sweep import parse_schedules, parse_seeds, plan_sweep

SMOKE = "experiments/smoke/tiny_cpu.yaml"  # builtin:echo tasks, builtin:toy policy


def app():
    from tsrl_cli.cli import app

    return app


def invoke(*args):
    return CliRunner().invoke(app(), ["sweep", *map(str, args)])


@pytest.fixture
def second_experiment(tmp_path):
    p = tmp_path / "other.yaml"
    p.write_text(Path(SMOKE).read_text().replace("name: tiny_cpu", "name: other_cpu"))
    return p


# ---------------------------------------------------------------------------- the plan


def test_plan_order_and_run_dirs(tmp_path, second_experiment):
    plan = plan_sweep([SMOKE, second_experiment], schedules=("sync", "stream"), seeds=(42, 43), rounds=5,
                      warmup=2, out=tmp_path / "res")
    # experiment, then seed, then schedule: the schedules of one seed run back to back
    assert [(r.experiment, r.seed, r.schedule) for r in plan.runs] == [
        ("tiny_cpu", 42, "sync"), ("tiny_cpu", 42, "stream"), ("tiny_cpu", 43, "sync"), ("tiny_cpu", 43, "stream"),
        ("other_cpu", 42, "sync"), ("other_cpu", 42, "stream"), ("other_cpu", 43, "sync"), ("other_cpu", 43, "stream")]
    for r in plan.runs:
        assert r.run_dir == tmp_path / "res" / r.experiment / r.schedule / f"seed{r.seed}"
        assert r.cfg.run_dir() == r.run_dir and (r.cfg.schedule, r.cfg.seed) == (r.schedule, r.seed)
        assert r.cfg.rounds == 5 and (r.status, r.action) == ("todo", "run")
    # only schedule, seed and run.out differ between the rows of one experiment
    a, b = plan.runs[0].cfg, plan.runs[3].cfg
    assert a.rollout == b.rollout and a.model == b.model and a.optim == b.optim and a.data == b.data
    assert plan.experiments["tiny_cpu"] == {"file": SMOKE, "rounds": 5, "objective": "grpo"}
    assert not (tmp_path / "res").exists()  # planning reads only


def test_plan_precedence_yaml_set_rounds(tmp_path):
    plan = plan_sweep([SMOKE], schedules=("stream",), seeds=(1,), sets=["rollout.group_size=2", "rounds=7"],
                      warmup=1, out=tmp_path)
    assert plan.runs[0].cfg.rollout.group_size == 2 and plan.runs[0].cfg.rounds == 7  # YAML says 4 and 3
    plan = plan_sweep([SMOKE], schedules=("stream",), seeds=(1,), sets=["rounds=7"], rounds=9, warmup=1, out=tmp_path)
    assert plan.runs[0].cfg.rounds == 9  # --rounds beats --set


def test_parse_lists():
    assert parse_schedules("sync, stream") == ("sync", "stream") and parse_seeds("42,43,44") == (42, 43, 44)
    for bad in ("sync,lazy", "", "sync,sync"):
        with pytest.raises(UsageError, match="--schedules"):
            parse_schedules(bad)
    for bad in ("42,x", "", "1,1"):
        with pytest.raises(UsageError, match="--seeds"):
            parse_seeds(bad)


@pytest.mark.parametrize("kwargs,msg", [
    ({"experiments": ["/nonexistent/exp.yaml"]}, "not found"),
    ({"experiments": [SMOKE], "warmup": 3}, "--warmup 3 leaves no measured round"),  # tiny_cpu has 3 rounds
    ({"experiments": [SMOKE], "sets": ["rollout.group_sise=2"]}, "did you mean group_size"),
    ({"experiments": [SMOKE, SMOKE]}, "share the experiment name"),
    ({"experiments": []}, "at least one experiment"),
])
def test_plan_errors(tmp_path, kwargs, msg):
    with pytest.raises(UsageError, match=msg):
        plan_sweep(**{"warmup": 1, "out": tmp_path, **kwargs})


def _fake_run(cfg, rounds_done: int, done: bool, checkpoint: int | None):
    d = cfg.run_dir()
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(dump_config(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"round": k, "step_time_s": 1.0}) + "\n"
                                             for k in range(1, rounds_done + 1)))
    if checkpoint is not None:
        (d / "checkpoints" / f"round-{checkpoint}").mkdir(parents=True)
        (d / "checkpoints" / f"round-{checkpoint}" / "state.json").write_text("{}")
    if done:
        (d / "DONE").write_text("{}")


def test_status_from_disk(tmp_path):
    """done -> skip; no DONE with a checkpoint -> resume; without -> restart; DONE short of rounds -> resume."""
    kw = {"schedules": ("sync", "stream", "async"), "seeds": (1, 2), "rounds": 3, "warmup": 1, "out": tmp_path}
    runs = plan_sweep([SMOKE], **kw).runs
    _fake_run(runs[0].cfg, 3, done=True, checkpoint=3)
    _fake_run(runs[1].cfg, 2, done=False, checkpoint=1)
    _fake_run(runs[2].cfg, 2, done=False, checkpoint=None)
    _fake_run(runs[3].cfg, 2, done=True, checkpoint=2)  # finished with 2 rounds; 3 are planned now
    runs[4].cfg.run_dir().mkdir(parents=True)
    (runs[4].cfg.run_dir() / "config.yaml").write_text(dump_config(runs[4].cfg))  # crashed before round 1
    got = [(r.status, r.action, r.rounds_done, r.checkpoint) for r in plan_sweep([SMOKE], **kw).runs]
    assert got == [("done", "skip", 3, 3), ("partial", "resume", 2, 1), ("partial", "restart", 2, None),
                   ("partial", "resume", 2, 2), ("todo", "run", 0, None), ("todo", "run", 0, None)]


def test_other_config_in_run_dir_is_refused(tmp_path):
    kw = {"schedules": ("sync",), "seeds": (1,), "rounds": 3, "warmup": 1, "out": tmp_path}
    cfg = plan_sweep([SMOKE], **kw).runs[0].cfg
    _fake_run(cfg, 3, done=True, checkpoint=3)
    assert plan_sweep([SMOKE], **{**kw, "rounds": 5}).runs[0].action == "resume"  # rounds may change
    with pytest.raises(UsageError, match="optim.lr"):
        plan_sweep([SMOKE], **kw, sets=["optim.lr=0.5"])


# ---------------------------------------------------------------------------- the command


def test_dry_run_prints_plan_and_runs_nothing(tmp_path):
    out = tmp_path / "res"
    res = invoke(SMOKE, "--schedules", "sync,stream", "--seeds", "42,43", "--rounds", "4", "--warmup", "1",
                 "--out", out, "--dry-run")
    assert res.exit_code == 0, res.output
    assert "tiny_cpu" in res.stdout and "todo" in res.stdout and "4 of 4" in res.stdout
    assert not out.exists()
    res = invoke(SMOKE, "--rounds", "4", "--warmup", "1", "--out", out, "--dry-run", "--json")
    doc = json.loads(res.stdout)
    assert doc["dry_run"] and doc["outcomes"] is None and doc["sweep_file"] is None
    assert [(r["schedule"], r["seed"]) for r in doc["runs"]][:3] == [("sync", 42), ("stream", 42), ("async", 42)]
    assert len(doc["runs"]) == 9 and not out.exists()


@pytest.mark.parametrize("args,msg", [
    (["/nonexistent/exp.yaml"], "not found"),
    ([SMOKE, "--schedules", "sync,lazy"], "lazy"),
    ([SMOKE, "--seeds", "4x"], "--seeds"),
    ([SMOKE, "--warmup", "5"], "--warmup"),
])
def test_bad_input_exit_2_one_line(tmp_path, args, msg):
    res = invoke(*args, "--out", tmp_path, "--dry-run")
    assert res.exit_code == 2, res.output
    assert msg in res.stderr and len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""


def test_sweep_help_does_not_import_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom tsrl_cli.cli import app\n"
            "assert CliRunner().invoke(app, ['sweep', '--help']).exit_code == 0\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_tiny_sweep_resumes_and_report_reads_it(tmp_path):
    """2 schedules x 2 seeds x 2 rounds for real; a second sweep skips all; tsrl report reads the tree."""
    from tsrl_cli.rl.toy import ensure_toy_policy
    from tsrl_cli.sweep import run_sweep

    ensure_toy_policy("builtin:toy")  # cached under data/cache/toy after the first build
    out = tmp_path / "res"
    plan = plan_sweep([SMOKE], schedules=("sync", "stream"), seeds=(42, 43), rounds=2, warmup=1, out=out)
    events = []
    outcomes = run_sweep(plan, progress=events.append)
    assert [o["outcome"] for o in outcomes] == ["done"] * 4
    starts = [e for e in events if e["event"] == "sweep_run"]
    assert [(e["index"], e["total"], e["schedule"], e["seed"]) for e in starts] == [
        (1, 4, "sync", 42), (2, 4, "stream", 42), (3, 4, "sync", 43), (4, 4, "stream", 43)]
    assert sum(e["event"] == "round" for e in events) == 8  # train's own progress flows through
    for r in plan.runs:
        assert json.loads((r.run_dir / "DONE").read_text())["rounds"] == 2
        assert len((r.run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert all(o["rounds_measured"] == 1 and o["step_time_mean_s"] > 0 for o in outcomes)
    assert json.loads((out / "sweep.json").read_text())["warmup"] == 1
    mtimes = {r.run_dir: os.stat(r.run_dir / "DONE").st_mtime_ns for r in plan.runs}

    # again, through the CLI (human output): every run is done, so nothing runs and nothing is rewritten
    args = [SMOKE, "--schedules", "sync,stream", "--seeds", "42,43", "--rounds", "2", "--warmup", "1", "--out", out]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert "0 of 4 runs to do" in res.stdout and res.stdout.count("skipped") == 4
    assert "run 1/" not in res.stderr
    assert all(os.stat(d / "DONE").st_mtime_ns == t for d, t in mtimes.items())

    # a run that lost its DONE (but has its final checkpoint) resumes, and only that one
    (plan.runs[1].run_dir / "DONE").unlink()
    res = invoke(*args, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(r["status"], r["action"], r["checkpoint"]) for r in doc["runs"]] == [
        ("done", "skip", 2), ("partial", "resume", 2), ("done", "skip", 2), ("done", "skip", 2)]
    assert [o["outcome"] for o in doc["outcomes"]] == ["skipped", "done", "skipped", "skipped"]
    assert (plan.runs[1].run_dir / "DONE").is_file()

    # tsrl report reads what the sweep wrote
    res = CliRunner().invoke(app(), ["report", str(out), "--warmup", "1", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["runs"] == 4 and rep["experiments"] == ["tiny_cpu"]
    step = (out / "report" / "tables" / "step_time.csv").read_text()
    assert "tiny_cpu,stream" in step and "tiny_cpu,sync" in step
    assert (out / "report" / "REPORT.md").is_file()
