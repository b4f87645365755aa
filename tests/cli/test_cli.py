"""`tsrl verify` end to end through the CLI: exit codes, --json, saved gradients, user model dirs."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tsrl_cli.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_help_lists_verify():
    res = run("--help")
    assert res.exit_code == 0 and "verify" in res.output
    assert run("verify", "--help").exit_code == 0


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_verify_json_is_one_document(objective):
    res = run("verify", "--objective", objective, "--groups", "2", "--group-size", "3", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["max_rel_diff"] <= 1e-10 and doc["objective"] == objective


def test_verify_human_output():
    res = run("verify", "--groups", "2", "--group-size", "2")
    assert res.exit_code == 0
    assert "EXACT" in res.stdout and "relative difference" in res.stdout


def test_exit_1_when_above_tolerance(monkeypatch):
    import tsrl_cli.verify as v

    monkeypatch.setitem(v.TOLERANCE, "float64", 0.0)  # any rounding difference now fails
    res = run("verify", "--groups", "2", "--group-size", "3", "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["ok"] is False


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--dtype", "float16"], "--dtype"),
        (["--order", "sideways"], "--order"),
        (["--loss-agg", "mean"], "loss aggregation"),
        (["--loss-agg", "seq-mean-token-sum-norm"], "--norm-constant"),
        (["--model", "/nonexistent/model"], "not a model directory"),
        (["--rollouts", "/nonexistent.jsonl"], "not found"),
    ],
)
def test_bad_input_exit_2_one_line(args, msg):
    res = run("verify", *args)
    assert res.exit_code == 2
    assert msg in res.stderr and len(res.stderr.strip().splitlines()) <= 2


def test_malformed_rollouts_exit_2_with_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"group_id": "a", "sample_index": 0, "input_ids": [1, 2], "loss_mask": [0, 1], "reward": 1, "turn_spans": [[1, 2]]}\n{"group_id": "a"}\n')
    res = run("verify", "--rollouts", str(p))
    assert res.exit_code == 2 and f"{p}:2: missing field" in res.stderr


def test_token_ids_beyond_vocab_exit_2(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"group_id": "a", "sample_index": 0, "input_ids": [1, 999], "loss_mask": [0, 1], "reward": 1, "turn_spans": [[1, 2]]}\n')
    res = run("verify", "--rollouts", str(p))
    assert res.exit_code == 2 and "vocabulary" in res.stderr


def test_user_model_dir_rollouts_file_and_saved_grads(tmp_path):
    """A model saved with save_pretrained by a user's script, a rollouts file with teacher scores."""
    from transformers import Qwen3ForCausalLM

    from tsrl_cli.policy import tiny_qwen3_config

    torch.manual_seed(7)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=96, hidden=32)).save_pretrained(tmp_path / "m")
    rows = []
    for g in range(2):
        for i in range(3):
            rows.append({"group_id": f"q{g}", "sample_index": i, "input_ids": [(7 * g + 3 * i + j) % 96 for j in range(12)],
                         "loss_mask": [0] * 4 + [1] * 4 + [0] * 2 + [1] * 2, "reward": float((g + i) % 2) + 0.1 * i,
                         "turn_spans": [[4, 8], [10, 12]], "teacher_logprobs": [-1.0 - 0.1 * j for j in range(12)]})
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for objective in ("grpo", "opd"):
        out = tmp_path / f"grads_{objective}"
        res = run("verify", "--model", str(tmp_path / "m"), "--rollouts", str(tmp_path / "r.jsonl"),
                  "--objective", objective, "--loss-agg", "seq-mean-token-mean", "--save-grads", str(out), "--json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["max_rel_diff"] <= 1e-10
        from safetensors.torch import load_file

        lazy, stream = load_file(out / "lazy.safetensors"), load_file(out / "stream.safetensors")
        assert "model.embed_tokens.weight" in lazy and set(lazy) == set(stream)
        assert lazy["lm_head.weight"].abs().max() > 0
