"""tsrl plan's shared-prompt cut (rl/prefix.py): each kept prompt part costs learner.prompt_tokens positions of the
traced pass's activations plus its keys and values and their adjoint sets; counted by hand on a tiny model (float32:
2 x layers x KV heads x head_dim x 4 bytes per token), and nothing where the cut does not run."""

from __future__ import annotations

import pytest
import yaml

from tsrl_cli.config import load_config
from tsrl_cli.plan import plan_experiment
from tsrl_cli.policy import tiny_qwen3_config


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    (root / "model").mkdir()
    config = tiny_qwen3_config(vocab_size=512, hidden=64, layers=2, max_positions=512)
    config.to_json_file(str(root / "model" / "config.json"))
    doc = {"model": {"policy": "builtin:toy", "policy_config": str(root / "model")},
           "rollout": {"max_trajectory_tokens": 256, "prompts_per_round": 3, "group_size": 4},
           "devices": {"learner": "cpu"}}
    (root / "exp.yaml").write_text(yaml.safe_dump(doc))
    return root / "exp.yaml", config


def learner(exp, *sets):
    doc = plan_experiment(load_config(exp, ["schedule=stream", *sets]), capacity_gib=8.0, host_gib=8.0)
    return next(p for p in doc["processes"] if p["name"] == "learner")


def test_each_kept_prompt_part_is_priced(experiment):
    exp, config = experiment
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # bytes per token
    a = learner(exp, "learner.prompt_tokens=100")
    b = learner(exp, "learner.prompt_tokens=200")
    assert a["counts"]["prefix_cut_parts"] == 3  # every group of the round, at most
    # 3 parts x (activations + the keys and values + R's adjoint + the two sums), linear in the prompt's tokens
    per_100 = b["parts"]["prefix_cut"] - a["parts"]["prefix_cut"]
    assert per_100 > 3 * 4 * kv * 100 and abs(per_100 - a["parts"]["prefix_cut"]) <= 3
    assert b["parts"]["pass"] - a["parts"]["pass"] == per_100  # inside the pass's figure
    buckets = learner(exp, "learner.prompt_tokens=100", "loss.group_buffers=buckets")["parts"]["prefix_cut"]
    assert buckets - a["parts"]["prefix_cut"] == 3 * (4 - 2) * kv * 100  # one set per reward value: 4, not 2


def test_opd_parts_hold_r_and_the_running_trajectories(experiment):
    exp, config = experiment
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    a = learner(exp, "objective=opd", "learner.prompt_tokens=100")
    b = learner(exp, "objective=opd", "learner.prompt_tokens=100", "loss.loss_agg=seq-mean-token-mean",
                "learner.opd_unit=turn")
    assert a["counts"]["prefix_cut_parts"] == 3
    assert b["parts"]["prefix_cut"] - a["parts"]["prefix_cut"] == 3 * 4 * kv * 100  # a unit sum per trajectory


@pytest.mark.parametrize("sets", [["learner.prefix_cut=false"], ["loss.kl_coef=0.1"], ["offpolicy.tis_cap=2.0"]])
def test_nothing_where_the_cut_does_not_run(experiment, sets):
    p = learner(experiment[0], *sets)
    assert p["parts"]["prefix_cut"] == 0 and p["counts"]["prefix_cut_parts"] == 0
