"""tsrl plan's fold backlog: with the streaming buffers in host memory on GPUs, each learner rank holds on its device
the gradients of up to loss.host_fold_pending passes queued for the fold thread (rl/hostfold.py), one pass being N x
its shard (every unit's all-to-all output on a group of N). Counted by hand on a tiny group of 2 ranks, float32:
K x 2 x the rank's buffer-set elements x 4 bytes, inside the pass's figure; nothing with the buffers on the device.
"""

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
           "rollout": {"max_trajectory_tokens": 256, "prompts_per_round": 2, "group_size": 2},
           "devices": {"learner": "4-5", "rollout": "0-1"}}
    (root / "exp.yaml").write_text(yaml.safe_dump(doc))
    return root / "exp.yaml"


def rank0(exp, *sets):
    doc = plan_experiment(load_config(exp, list(sets)), capacity_gib=3.0, host_gib=4.0)
    return next(p for p in doc["processes"] if p["name"] == "learner-0")


def test_the_learner_rank_holds_k_passes_of_gradients(experiment):
    one, three = (rank0(experiment, "loss.buffer_device=cpu", f"loss.host_fold_pending={k}")["parts"] for k in (1, 3))
    per_pass = 2 * one["buffer_set"]  # 2 ranks x this rank's buffer elements x 4 bytes (float32 model and buffers)
    assert (one["fold_backlog"], three["fold_backlog"]) == (per_pass, 3 * per_pass) and per_pass > 0
    assert three["pass"] - one["pass"] == 2 * per_pass  # inside the pass's figure
    on_device = rank0(experiment)["parts"]  # the control: buffers beside the parameters, folded inline
    assert on_device["fold_backlog"] == 0 and on_device["streaming_buffers"] > 0
