"""`tsrl eval embedded` end to end: a scripted policy whose answers we control -> the real agent loop,
local sandboxes and verifiers -> a known resolved count, patches that `git apply` reproduces, resume."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.embedded.policy.demos import repair_plan, say, sed_replace
from tsrl_cli.embedded.terminal_suite import solution_commands
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.evals.embedded import LABEL, evaluate_embedded, tree_diff
from tsrl_cli.evals.runner import RecordLog
from tsrl_cli.evals.stats import wilson_interval

SUBMIT = "```bash\nsubmit\n```"
SETS = ("embedded_repair_heldout", "embedded_terminal_heldout")


def fix_command(d: Path, task) -> str:
    if task.kind == "repair":
        p = repair_plan(task, d)
        return sed_replace(p["line"], p["a"], p["b"], p["file"])
    return " && ".join(solution_commands(d / task.task_dir))


class Policy:
    """Fixes the tasks in `solve` on turn 0, submits at once elsewhere; counts the turns it was asked."""

    def __init__(self, suite: Path, solve: set[str]):
        self.markers = []
        for name in SETS:
            ds = open_dataset(str(suite / name))
            d, tasks = ds.path, ds.tasks
            for t in tasks:
                text = t.problem_statement.strip() if t.kind == "repair" else t.instruction.strip()
                self.markers.append((text, t.task_id, fix_command(d, t)))
        self.solve, self.calls = solve, 0

    def __call__(self, context: str, turn: int) -> str:
        self.calls += 1
        _, task_id, cmd = next(m for m in self.markers if m[0] in context)
        return say("apply the fix", cmd) if turn == 0 and task_id in self.solve else SUBMIT


def all_ids(suite):
    return {name: [t.task_id for t in open_dataset(str(suite / name)).tasks] for name in SETS}


def run(suite, tok, policy, **kw):
    return evaluate_embedded(None, tok, [str(suite / n) for n in SETS], engine=ScriptedEngine(tok, policy), **kw)


@pytest.mark.sandboxed
def test_known_resolved_count_and_patches(suite, tok, tmp_path):
    ids = all_ids(suite)
    solve = {ids[SETS[0]][0], ids[SETS[0]][2], ids[SETS[1]][1]}  # 2 of 3 repair tasks, 1 of 3 terminal tasks
    s = run(suite, tok, Policy(suite, solve), out_dir=tmp_path / "out")
    rep, term = s["datasets"][SETS[0]], s["datasets"][SETS[1]]
    assert (rep["n"], rep["resolved"], term["n"], term["resolved"]) == (3, 2, 3, 1)
    assert (rep["ci95_low"], rep["ci95_high"]) == pytest.approx(wilson_interval(2, 3), abs=1e-6)
    assert s["label"] == LABEL == "embedded held-out (local sandbox, tiny model)"
    assert s["metrics"][f"eval/{SETS[0]}/success"] == pytest.approx(2 / 3, abs=1e-6)
    assert s["metrics"][f"eval/{SETS[1]}/n"] == 3 and s["all"]["resolved"] == 3

    recs = RecordLog(tmp_path / "out" / "records.jsonl").load()
    assert len(recs) == 6 and json.loads((tmp_path / "out" / "summary.json").read_text())["all"]["n"] == 6
    d = suite / SETS[0]
    tasks = {t.task_id: t for t in open_dataset(str(d)).tasks}
    for r in recs:
        assert r["resolved"] == (r["instance_id"] in solve) and r["exit_reason"] == "submitted"
        assert r["turns"] == (2 if r["instance_id"] in solve else 1) and r["tokens"] > 0 and r["duration_s"] > 0
        assert (r["failure"] is None) == r["resolved"]
        if r["kind"] == "terminal":
            assert r["patch"] is None
            continue
        t = tasks[r["instance_id"]]
        if r["instance_id"] not in solve:
            assert r["patch"] == "" and "FAIL_TO_PASS" in r["failure"]  # "0/k", or the validated start state
            continue
        # the recorded patch, applied by git to the start state, gives the fixed file (the gold one)
        work = tmp_path / "apply" / t.task_id
        shutil.copytree(d / t.start_dir, work)
        subprocess.run(["git", "apply", "-"], input=r["patch"], text=True, cwd=work, check=True)
        gold = tmp_path / "gold" / t.task_id
        shutil.copytree(d / t.start_dir, gold)
        subprocess.run(["git", "apply", "-"], input=t.gold_patch, text=True, cwd=gold, check=True)
        assert tree_diff(work, d / t.start_dir) != "" and tree_diff(work, gold) == ""


@pytest.mark.sandboxed
def test_resume_skips_finished_instances(suite, tok, tmp_path):
    out = tmp_path / "out"
    ids = all_ids(suite)
    first = Policy(suite, {ids[SETS[0]][0]})
    s1 = run(suite, tok, first, out_dir=out, limit=2)
    assert first.calls > 0 and s1["all"]["n"] == 4

    again = Policy(suite, set())  # would resolve nothing: proves nothing was rerun
    s2 = run(suite, tok, again, out_dir=out, limit=2)
    assert again.calls == 0 and s2["datasets"] == s1["datasets"]

    # a torn last line (crash mid-write) is dropped and only that job runs again; --limit 3 adds 2 more jobs
    log = out / "records.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    third = Policy(suite, set())
    s3 = run(suite, tok, third, out_dir=out, limit=3)
    assert s3["all"]["n"] == 6 and third.calls == 3
    assert len(log.read_text().splitlines()) == 6 and all(json.loads(x) for x in log.read_text().splitlines())

    # other settings in the same folder are refused, not mixed in
    from tsrl_cli.errors import UsageError

    with pytest.raises(UsageError, match="other settings"):
        run(suite, tok, Policy(suite, set()), out_dir=out, temperature=1.0)


@pytest.mark.sandboxed
def test_several_seeds_give_per_seed_rows(suite, tok):
    ids = all_ids(suite)
    s = run(suite, tok, Policy(suite, {ids[SETS[0]][0]}), seeds=(0, 1), limit=1)
    d = s["datasets"][SETS[0]]
    assert d["n"] == 2 and d["resolved"] == 2 and set(d["per_seed"]) == {"0", "1"}
    assert d["per_seed"]["1"] == {**d["per_seed"]["0"], "mean_turns": d["per_seed"]["1"]["mean_turns"]}
    assert s["datasets"][SETS[1]]["per_seed"]["0"]["resolved"] == 0


def test_tree_diff_round_trips_through_git_apply(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "pkg").mkdir(parents=True)
    (a / "pkg" / "m.py").write_text("x = 1\ny = 2\n")
    (b / "pkg" / "m.py").write_text("x = 1\ny = 3")  # no newline at the end
    (a / "old.txt").write_text("gone\n")
    (b / "new.txt").write_text("hello\n")
    (b / "pkg" / "__pycache__").mkdir()
    (b / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0\1")
    patch = tree_diff(a, b)
    assert "__pycache__" not in patch and "\\ No newline at end of file" in patch
    subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=a, check=True)
    assert tree_diff(a, b) == ""


def test_missing_model_or_data_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["eval", "embedded"])
    assert res.exit_code == 2 and "tsrl prepare-data embedded" in res.stderr
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    res = CliRunner().invoke(app, ["eval", "embedded", "--model", "m"])
    assert res.exit_code == 2 and "tsrl prepare-data embedded" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3  # one message (soft-wrapped at most)


@pytest.mark.sandboxed
def test_cli_with_a_real_checkpoint_dir(suite, ckpt, tmp_path):
    """A save_pretrained directory (what `tsrl train` writes) evaluates as it is: hf engine, real model."""
    args = ["eval", "embedded", "--model", str(ckpt), "--limit", "1", "--max-turns", "1",
            "--out", str(tmp_path / "out")]
    res = CliRunner().invoke(app, [*args, "--datasets", f"{suite / SETS[0]},{suite / SETS[1]}", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["label"] == LABEL and doc["all"]["n"] == 2 and doc["config"]["engine"] == "hf"
    assert doc["all"]["ci95_high"] > 0 and (tmp_path / "out" / "summary.json").is_file()
    res = CliRunner().invoke(app, [*args, "--datasets", str(suite / SETS[0])])  # resumed: nothing new to run
    assert res.exit_code == 0 and LABEL in res.stdout and "95 % CI" in res.stdout


@pytest.fixture
def opener_calls(monkeypatch):
    """The (device, dtype) each open of a policy folder asks for; the model itself is served from the CPU."""
    import tsrl_cli.engines.load as opener

    asked, real = [], opener.load_policy

    def on_cpu(model, *, dtype, device, **kw):
        asked.append((device, dtype))
        return real(model, dtype="float32", device="cpu", **kw)

    monkeypatch.setattr(opener, "load_policy", on_cpu)
    return asked


@pytest.mark.sandboxed
@pytest.mark.parametrize("gpus,flag,device,dtype", [
    (1, ["--device", "cuda:0"], "cuda:0", "bfloat16"),  # asked for
    (2, [], "cuda:0", "bfloat16"),  # the default with GPUs: the first one
    (0, [], "cpu", "float32"),  # the default without
])
def test_cli_device_reaches_the_opener(suite, ckpt, tmp_path, monkeypatch, opener_calls, gpus, flag, device, dtype):
    """`tsrl eval embedded --device` opens its engine there, printed first on stderr, never on stdout; the
    machine's GPUs are faked through torch.cuda.device_count (what devices.cuda_count asks)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    res = CliRunner().invoke(app, ["eval", "embedded", "--model", str(ckpt), "--datasets", str(suite / SETS[1]),
                                   "--limit", "1", "--max-turns", "1", "--out", str(tmp_path / "out"), "--json", *flag])
    assert res.exit_code == 0, res.output
    assert opener_calls == [(device, dtype)]
    assert res.stderr.splitlines()[0] == f"· engine device: {device}" and "engine device" not in res.stdout
    assert json.loads(res.stdout)["all"]["n"] == 1  # stdout: the one JSON document


def test_cli_bad_device_is_one_line_before_anything_loads(tmp_path, monkeypatch, opener_calls):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for spec, word in (("cuda:7", "cuda:7 is not available here (1 CUDA device(s))"), ("bogus", "not a device list")):
        res = CliRunner().invoke(app, ["eval", "embedded", "--device", spec, "--out", str(tmp_path / "out")])
        assert res.exit_code == 2 and res.stdout == "" and word in res.stderr, res.output
        assert len(res.stderr.strip().splitlines()) == 1
    assert opener_calls == [] and not (tmp_path / "out").exists()
