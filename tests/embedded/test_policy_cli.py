"""`tsrl policy probe` through the CLI: a tiny random ChatML policy on a small embedded slice."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.embedded.prepare import prepare_embedded
from tsrl_cli.models import build_tiny_model
from tsrl_cli.tokenizer import train_chatml_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("p")
    prepare_embedded(root / "data", seed=0, repos=["roman", "money"], max_per_repo=2, n_terminal_train=3,
                     n_terminal_heldout=3)
    tok = train_chatml_tokenizer(["```bash\nls -la\n```", "Make the script executable."] * 20, vocab_size=300)
    build_tiny_model(0, torch.float32, vocab_size=len(tok)).save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    return root


def test_probe_json(setup):
    res = runner.invoke(app, ["policy", "probe", "--model", str(setup / "policy"), "--tasks",
                              str(setup / "data" / "embedded_terminal_train"), "--limit", "1", "--samples", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["all"]["trajectories"] == 2 and len(doc["results"]) == 2
    assert 0.0 <= doc["all"]["success_rate"] <= 1.0 and "p50" in doc["duration_s"]


def test_probe_bad_model_exit_2(setup, tmp_path):
    res = runner.invoke(app, ["policy", "probe", "--model", str(tmp_path), "--tasks", "x"])
    assert res.exit_code == 2 and "not a policy directory" in res.stderr


def _probe(setup, *extra):
    return runner.invoke(app, ["policy", "probe", "--model", str(setup / "policy"), "--tasks",
                               str(setup / "data" / "embedded_terminal_train"), "--limit", "2", "--samples", "2",
                               "--json", *extra])


def _key(r):
    # what a trajectory sampled: everything but its timing
    return {k: v for k, v in r.items() if k not in ("seconds", "tool_s")}


def test_probe_records_resume_equals_an_uninterrupted_probe(setup, tmp_path, monkeypatch):
    """An interrupted probe (records file cut after 1 of 4 trajectories, the last line torn) resumes: it samples
    only the 3 missing trajectories, and its records and summary equal those of one uninterrupted probe."""
    import tsrl_cli.envs.tasks as tasks_mod

    full = tmp_path / "full.jsonl"
    res = _probe(setup, "--records", str(full))
    assert res.exit_code == 0, res.output
    whole = json.loads(res.stdout)
    lines = full.read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0])["samples"] == 2 and whole["resumed_trajectories"] == 0

    cut = tmp_path / "cut.jsonl"
    cut.write_text(lines[0] + "\n" + lines[2] + "\n" + lines[3][: len(lines[3]) // 2])  # killed mid-write
    started, real = [], tasks_mod.make_env
    monkeypatch.setattr(tasks_mod, "make_env", lambda *a, **kw: started.append(a[0].task_id) or real(*a, **kw))
    res = _probe(setup, "--records", str(cut))
    assert res.exit_code == 0, res.output
    resumed = json.loads(res.stdout)
    assert len(started) == 3 and resumed["resumed_trajectories"] == 1
    by = lambda rs: sorted((_key(r) for r in rs), key=lambda r: (r["task_id"], r["sample"]))
    assert by(resumed["results"]) == by(whole["results"])
    assert {k: resumed["all"][k] for k in ("success_rate", "groups_nonzero_var", "mean_tokens", "mean_turns")} == \
        {k: whole["all"][k] for k in ("success_rate", "groups_nonzero_var", "mean_tokens", "mean_turns")}
    assert by(json.loads(x) for x in cut.read_text().splitlines()[1:]) == by(json.loads(x) for x in lines[1:])

    res = _probe(setup, "--records", str(cut))  # everything is there: nothing is sampled again
    assert res.exit_code == 0 and len(started) == 3 and json.loads(res.stdout)["resumed_trajectories"] == 4


def test_probe_records_of_another_probe_exit_2(setup, tmp_path):
    f = tmp_path / "r.jsonl"
    assert _probe(setup, "--records", str(f), "--seed", "1").exit_code == 0
    before = f.read_text()
    res = _probe(setup, "--records", str(f), "--seed", "2")
    assert res.exit_code == 2 and "different probe" in res.stderr and "seed" in res.stderr
    assert f.read_text() == before  # nothing written over
