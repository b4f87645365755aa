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


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_verify_checks_the_shared_prompt_cut(objective):
    """Random groups share a prompt, so verify's streamed side runs the cut (learner.prefix_cut) against the lazy
    batch's whole rows; with the cut off the same check runs on whole rows (the control: no prompt part)."""
    on = json.loads(run("verify", "--objective", objective, "--groups", "3", "--group-size", "4", "--json").stdout)
    off = json.loads(run("verify", "--objective", objective, "--groups", "3", "--group-size", "4", "--json",
                         "--set", "learner.prefix_cut=false").stdout)
    assert on["ok"] and off["ok"] and on["prefix_cut_positions"] > 0 and off["prefix_cut_positions"] == 0


def test_verify_human_output():
    res = run("verify", "--groups", "2", "--group-size", "2")
    assert res.exit_code == 0
    assert "EXACT" in res.stdout and "relative difference" in res.stdout


def test_exit_1_when_above_tolerance(monkeypatch):
    import tsrl_cli.verify as v

    monkeypatch.setitem(v.TOLERANCE, torch.float64, 0.0)  # any rounding difference now fails
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
    p.write_text('{"group_id": "a", "sample_index": 0, "input_ids": [1, 2], "loss_mask": [0, 1], "reward": 1, '
                 '"turn_spans": [[1, 2]]}\n{"group_id": "a"}\n')
    res = run("verify", "--rollouts", str(p))
    assert res.exit_code == 2 and f"{p}:2: missing field" in res.stderr


def test_token_ids_beyond_vocab_exit_2(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"group_id": "a", "sample_index": 0, "input_ids": [1, 999], "loss_mask": [0, 1], "reward": 1, '
                 '"turn_spans": [[1, 2]]}\n')
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
            rows.append({"group_id": f"q{g}", "sample_index": i,
                         "input_ids": [(7 * g + 3 * i + j) % 96 for j in range(12)],
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


# ---- the loss options are LossConfig's fields ---------------------------------------------------------------

def _nondefault(f):
    """A value of field f's type other than its default, and the command-line words that give it."""
    import typing

    from tsrl_cli.config import LossConfig

    tp = typing.get_type_hints(LossConfig)[f.name]
    flag = "--" + f.name.replace("_", "-")
    if tp is bool:
        return (not f.default), [flag if not f.default else "--no-" + flag[2:]]
    base = next(a for a in typing.get_args(tp) if a is not type(None)) if typing.get_args(tp) else tp
    value = f"not-{f.default}" if base is str else base((f.default or 0) + (3 if base is int else 0.25))
    return value, [flag, str(value)]


def test_every_loss_field_is_a_verify_option_with_its_default():
    import inspect
    from dataclasses import fields

    from tsrl_cli.cli.verify import verify
    from tsrl_cli.config import LossConfig, field_help

    params = inspect.signature(verify).parameters
    helps = field_help(LossConfig)
    text = runner.invoke(app, ["verify", "--help"], env={"COLUMNS": "250"}).stdout
    for f in fields(LossConfig):
        assert params[f.name].default == f.default, f.name
        assert helps[f.name], f"LossConfig.{f.name} has no comment: it is its option's help"
        assert "--" + f.name.replace("_", "-") in text and helps[f.name][:30] in text, f.name


def test_every_loss_option_reaches_the_loss_config(monkeypatch):
    """Each option given a value other than its default: run_verify receives exactly those values."""
    from dataclasses import fields

    import tsrl_cli.verify as v
    from tsrl_cli.config import LossConfig

    got = []
    monkeypatch.setattr(v, "run_verify", lambda opts, progress: got.append(opts) or {"ok": True})
    values, words = {}, []
    for f in fields(LossConfig):
        values[f.name], w = _nondefault(f)
        words += w
    res = run("verify", "--json", *words)
    assert res.exit_code == 0, res.output
    assert got[0].loss == LossConfig(**values) != LossConfig()


def test_a_loss_option_reaches_the_objective():
    """End to end: the loss options are what the objective ran with, and a scope field is refused there."""
    res = run("verify", "--groups", "2", "--group-size", "3", "--kl-coef", "0.2", "--kl-type", "k2",
              "--entropy-coef", "0.01", "--loss-agg", "seq-mean-token-mean", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["kl_coef"], doc["kl_type"], doc["entropy_coef"], doc["loss_agg"]) == (0.2, "k2", 0.01,
                                                                                     "seq-mean-token-mean")
    assert doc["ok"]
    res = run("verify", "--old-logprobs", "behavior")
    assert res.exit_code == 2 and "not exact under gradient streaming" in res.stderr


def test_a_new_loss_field_becomes_a_verify_option_with_no_other_edit(monkeypatch):
    """A LossConfig with one more field (and its comment): verify's generated options hold it, with its
    default and comment, and its value reaches the LossConfig that run_verify gets."""
    import importlib
    from dataclasses import dataclass

    import typer

    import tsrl_cli.verify as v

    cv = importlib.import_module("tsrl_cli.cli.verify")  # the module (the package's `verify` is the command)
    from tsrl_cli.config import LossConfig

    @dataclass(frozen=True)
    class LossPlus(LossConfig):
        clip_ratio: float = 0.2  # PPO clip ratio, a field added to the loss

    monkeypatch.setattr(cv, "LossConfig", LossPlus)
    got = []
    monkeypatch.setattr(v, "run_verify", lambda opts, progress: got.append(opts) or {"ok": True})
    one = typer.Typer()
    one.command()(cv.loss_options(cv.verify.__wrapped__))
    text = CliRunner().invoke(one, ["--help"], env={"COLUMNS": "250"}).stdout
    assert "--clip-ratio" in text and "PPO clip ratio, a field added to the loss" in text and "0.2" in text
    res = CliRunner().invoke(one, ["--clip-ratio", "0.3", "--kl-coef", "0.5", "--json"])
    assert res.exit_code == 0, res.output
    assert got[0].loss == LossPlus(clip_ratio=0.3, kl_coef=0.5)
    assert "--clip-ratio" not in run("verify", "--help").stdout  # the real command is untouched


def test_every_model_dtype_has_a_tolerance_and_a_torch_dtype():
    """The dtype names live in config.py; policy.TORCH_DTYPES and verify.TOLERANCE cover each of them."""
    from tsrl_cli.config import DTYPES
    from tsrl_cli.policy import TORCH_DTYPES
    from tsrl_cli.verify import TOLERANCE

    assert list(TORCH_DTYPES) == list(DTYPES) and all(str(TORCH_DTYPES[d]) == f"torch.{d}" for d in DTYPES)
    assert set(TOLERANCE) == set(TORCH_DTYPES.values())
    assert run("verify", "--dtype", "float16").exit_code == 2  # a name outside config.DTYPES is refused
