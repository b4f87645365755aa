"""`tsrl verify --set learner.*`: the streamed side runs as training's learner does (activation checkpointing, the
chunked head, the micro-batch caps) against the plain lazy gradient, and stays at float64 rounding.

Positive controls: a perturbed checkpointed layer and a perturbed chunked head each make verify fail, so the
settings reach the streamed side (and only that side: the lazy reference would move with them otherwise).
"""

import json

import pytest
from typer.testing import CliRunner

import tsrl_cli.core.losses as losses
import tsrl_cli.policy as policy
from tsrl_cli.cli import app
from tsrl_cli.config import LearnerConfig, LossConfig
from tsrl_cli.errors import UsageError
from tsrl_cli.verify import VerifyOptions, learner_settings, run_verify

runner = CliRunner()
BOTH = LearnerConfig(activation_checkpointing=True, logits_chunk_tokens=7)


@pytest.mark.parametrize("objective,agg,queued", [("grpo", "token-mean", 1), ("grpo", "seq-mean-token-mean", 4),
                                                  ("opd", "seq-mean-token-mean", 3)])
def test_checkpointing_and_chunks_stay_at_float64_rounding(objective, agg, queued):
    res = run_verify(VerifyOptions(objective=objective, loss=LossConfig(loss_agg=agg, entropy_coef=0.01),
                                   groups=3, group_size=4, queued=queued, learner=BOTH))
    assert res["ok"] and res["max_rel_diff"] <= 1e-12, res["max_rel_diff"]
    assert res["activation_checkpointing"] is True and res["logits_chunk_tokens"] == 7


@pytest.mark.slow
def test_on_a_group_of_two_cpu_ranks():
    res = run_verify(VerifyOptions(groups=2, group_size=4, queued=4, learners="cpu:2", learner=BOTH))
    assert res["ok"] and res["max_rel_diff"] <= 1e-12 and res["learner_ranks"] == 2


def test_control_a_perturbed_checkpointed_layer_is_caught(monkeypatch):
    real = policy._checkpointed_forward

    def off(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return (out[0] * (1 + 1e-6), *out[1:]) if isinstance(out, tuple) else out * (1 + 1e-6)

    monkeypatch.setattr(policy, "_checkpointed_forward", off)
    res = run_verify(VerifyOptions(groups=2, group_size=3, learner=LearnerConfig(activation_checkpointing=True)))
    assert not res["ok"] and res["max_rel_diff"] > 1e-9


def test_control_a_perturbed_chunked_head_is_caught(monkeypatch):
    real = losses.logit_grad
    monkeypatch.setattr(losses, "logit_grad", lambda *a: real(*a) * (1 + 1e-6))
    res = run_verify(VerifyOptions(groups=2, group_size=3, learner=LearnerConfig(logits_chunk_tokens=5)))
    assert not res["ok"] and res["max_rel_diff"] > 1e-9


def test_the_micro_batch_flag_wins_over_the_learner_key():
    res = run_verify(VerifyOptions(groups=2, group_size=4, queued=8, max_microbatch_tokens=40,
                                   learner=LearnerConfig(max_microbatch_tokens=10_000, max_microbatch_items=2)))
    assert res["ok"] and res["max_microbatch_tokens"] == 40 and res["max_microbatch_items"] == 2


def test_learner_settings_take_learner_keys_only():
    assert learner_settings(["learner.activation_checkpointing=true", "learner.logits_chunk_tokens=64"]) == \
        LearnerConfig(activation_checkpointing=True, logits_chunk_tokens=64)
    for bad, msg in (("loss.kl_coef=0.1", "learner.* keys only"), ("optim.master_dtype=float32", "learner.* keys only"),
                     ("learner.microbatch='on'", "--queued"), ("learner.chunks=3", "unknown config key"),
                     ("learner.logits_chunk_tokens=0", "must be >= 1")):
        with pytest.raises(UsageError, match=msg.replace("*", r"\*")):
            learner_settings([bad])


def test_cli_set_learner_keys():
    res = runner.invoke(app, ["verify", "--groups", "2", "--group-size", "3",
                              "--set", "learner.activation_checkpointing=true",
                              "--set", "learner.logits_chunk_tokens=5", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["activation_checkpointing"] and doc["logits_chunk_tokens"] == 5
    human = runner.invoke(app, ["verify", "--groups", "2", "--group-size", "2",
                                "--set", "learner.logits_chunk_tokens=5"])
    assert human.exit_code == 0 and "logits in chunks of 5" in human.stdout
    bad = runner.invoke(app, ["verify", "--set", "rollout.max_turns=3"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1, bad.output
