"""`tsrl policy probe` through the CLI: a tiny random ChatML policy on a small embedded slice; its summary
checked against the records by hand; an interrupted probe resumes to what an uninterrupted one gives."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.embedded.prepare import prepare_embedded
from tsrl_cli.evals.probe import summarize_probe
from tsrl_cli.policy import build_tiny_model
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


def _probe(setup, out, *extra, model=None):
    return runner.invoke(app, ["policy", "probe", "--model", str(model or setup / "policy"), "--tasks",
                               str(setup / "data" / "embedded_terminal_train"), "--limit", "2", "--samples", "2",
                               "--out", str(out), "--json", *extra])


@pytest.fixture(scope="module")
def whole(setup, tmp_path_factory):
    """One uninterrupted probe: (its folder, its --json document), read by the tests that need one."""
    out = tmp_path_factory.mktemp("probe") / "full"
    res = _probe(setup, out)
    assert res.exit_code == 0, res.output
    return out, json.loads(res.stdout)


def _key(r):
    # what a trajectory sampled: everything but its timing
    return {k: v for k, v in r.items() if k not in ("duration_s", "tool_s")}


@pytest.mark.slow
def test_probe_json(whole):
    out, doc = whole
    assert doc["all"]["trajectories"] == 4 and len(doc["results"]) == 4 and doc["all"]["groups"] == 2
    assert 0.0 <= doc["all"]["success_rate"] <= 1.0 and "p50" in doc["duration_s"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["all"] == doc["all"] and "results" not in on_disk


def test_probe_bad_model_exit_2(setup, tmp_path):
    res = runner.invoke(app, ["policy", "probe", "--model", str(tmp_path), "--tasks", "x"])
    assert res.exit_code == 2 and "not a policy directory" in res.stderr


def test_summary_by_hand():
    """Two tasks x 2 samples (one group varies, one does not) and an environment error left out of every rate."""
    def rec(task, sample, reward, kind="terminal", error=False):
        return {"dataset": "d", "instance_id": task, "sample": sample, "seed": 0, "kind": kind, "error": error,
                "reward": None if error else reward, "turns": 2, "tokens": 10, "tool_s": 0.5,
                "duration_s": 1.0 + sample,
                "exit_reason": "env_error" if error else "submitted"}

    s = summarize_probe([rec("a", 0, 1.0), rec("a", 1, 0.0), rec("b", 0, 0.0, "repair"), rec("b", 1, 0.0, "repair"),
                         rec("c", 0, None, error=True)], 3.0)
    assert s["all"]["trajectories"] == 4 and s["all"]["success_rate"] == 0.25 and s["errors"] == 1
    assert s["all"]["groups"] == 2 and s["all"]["groups_nonzero_var"] == 1 and s["all"]["groups_any_success"] == 1
    assert s["terminal"]["success_rate"] == 0.5 and s["repair"]["success_rate"] == 0.0
    assert s["mean_group_variance"] == 0.125  # (0.25 + 0) / 2


@pytest.mark.slow
def test_probe_resume_equals_an_uninterrupted_probe(setup, whole, tmp_path, monkeypatch):
    """An interrupted probe (records cut after 1 of 4 trajectories, the last line torn) resumes: it samples only
    the 3 missing trajectories, and its records and summary equal those of one uninterrupted probe."""
    import tsrl_cli.evals.probe as probe_mod

    full, whole = whole
    lines = (full / "records.jsonl").read_text().splitlines()
    assert len(lines) == 4 and whole["resumed_trajectories"] == 0

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text((full / "config.json").read_text())
    (cut / "records.jsonl").write_text(lines[1] + "\n" + lines[2][: len(lines[2]) // 2])  # killed mid-write
    started, real = [], probe_mod.make_env
    monkeypatch.setattr(probe_mod, "make_env", lambda *a, **kw: started.append(a[0].task_id) or real(*a, **kw))
    res = _probe(setup, cut)
    assert res.exit_code == 0, res.output
    resumed = json.loads(res.stdout)
    assert len(started) == 3 and resumed["resumed_trajectories"] == 1
    by = lambda rs: sorted((_key(r) for r in rs), key=lambda r: (r["instance_id"], r["sample"]))  # noqa: E731
    assert by(resumed["results"]) == by(whole["results"])
    keys = ("success_rate", "groups_nonzero_var", "mean_tokens", "mean_turns")
    assert {k: resumed["all"][k] for k in keys} == {k: whole["all"][k] for k in keys}

    res = _probe(setup, cut)  # everything is there: nothing is sampled again
    assert res.exit_code == 0 and len(started) == 3 and json.loads(res.stdout)["resumed_trajectories"] == 4


@pytest.mark.slow
def test_probe_of_other_weights_into_the_same_folder_exit_2(setup, tmp_path):
    """The output folder is tied to the weights (their sha256), not to the model folder's name."""
    import shutil

    pol = tmp_path / "pol"
    shutil.copytree(setup / "policy", pol)
    out = tmp_path / "o"
    assert _probe(setup, out, model=pol).exit_code == 0
    vocab = json.loads((pol / "config.json").read_text())["vocab_size"]
    build_tiny_model(1, torch.float32, vocab_size=vocab).save_pretrained(pol)  # the same folder, other weights
    before = (out / "records.jsonl").read_text()
    res = _probe(setup, out, model=pol)
    assert res.exit_code == 2 and "other settings" in res.stderr and "model_sha256" in res.stderr
    assert (out / "records.jsonl").read_text() == before  # nothing written over


@pytest.mark.slow
def test_chat_template_and_thinking_flags_choose_the_format(setup, tmp_path):
    """--chat-template and --thinking reach the agent: a Qwen3-template policy speaks its template by
    default, ChatML under --chat-template chatml, with the thinking switch under --thinking; a thinking
    switch the tokenizer lacks is exit 2 naming the flags, before anything is written."""
    from pathlib import Path

    from tsrl_cli.tokenizer import with_chat_template

    fixtures = Path(__file__).parents[1] / "fixtures" / "chat_templates"
    qtok = with_chat_template(train_chatml_tokenizer(["```bash\nls -la\n```", "Make the script executable."] * 20,
                                                     vocab_size=300), (fixtures / "qwen3.jinja").read_text(),
                              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                               "</tool_response>"])
    build_tiny_model(0, torch.float32, vocab_size=len(qtok)).save_pretrained(tmp_path / "qwen3_policy")
    qtok.save_pretrained(tmp_path / "qwen3_policy")

    def formats(out, *flags):
        res = _probe(setup, tmp_path / out, *flags, model=tmp_path / "qwen3_policy")
        assert res.exit_code == 0, res.output
        return {json.loads(x)["chat_format"] for x in (tmp_path / out / "records.jsonl").read_text().splitlines()}

    auto, chatml = formats("auto"), formats("chatml", "--chat-template", "chatml")
    thinking = formats("think", "--thinking")
    assert chatml == {"chatml"} and len(auto) == len(thinking) == 1
    a, t = auto.pop(), thinking.pop()
    assert a.startswith("template sha256:") and a.endswith("thinking=off") and t == a.replace("=off", "=on")

    res = _probe(setup, tmp_path / "refused", "--thinking")  # the ChatML policy has no thinking switch
    assert res.exit_code == 2 and not (tmp_path / "refused").exists(), res.output
    assert "--thinking: this tokenizer's chat template declares no tools" in res.stderr
    assert "use --no-thinking" in res.stderr and "rollout." not in res.stderr
