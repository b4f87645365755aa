"""The batching figures reach metrics.jsonl: per round, one entry per engine replica (docs/run-directory.md).

Recounted from the round itself: every generated token is one the agent kept as a loss token, so the
replicas' generated tokens sum to the round's `loss_tokens`; a continuous step advances each running
turn by exactly one token, so running_mean x steps is the generated tokens, while a static engine
call serves each of its turns once, so there it is the turns answered.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from tsrl_cli.rl.train import train

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("toy_workload", Path(__file__).parents[1] / "rl" / "toy_workload.py")
toy_workload = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toy_workload)


@pytest.fixture(scope="module")
def toy_policies():
    from tsrl_cli.rl.toy import ensure_toy_policy

    return ensure_toy_policy("builtin:toy"), ensure_toy_policy("builtin:toy-teacher")


def one_round(tmp_path, *sets) -> dict:
    from tsrl_cli.config import load_config

    cfg = load_config(sets=[*toy_workload.TOY, f"run.out={tmp_path}", "rounds=1", *sets], flags={})
    train(cfg)
    (row,) = [json.loads(line) for line in (Path(cfg.run_dir()) / "metrics.jsonl").read_text().splitlines()]
    return row


@pytest.mark.parametrize("batching,rollout", [("continuous", "cpu:2"), ("static", "cpu")])
def test_batching_figures_in_metrics(toy_policies, tmp_path, batching, rollout):
    row = one_round(tmp_path, f"rollout.batching={batching}", f"devices.rollout={rollout}")
    n = 2 if rollout == "cpu:2" else 1
    assert row["rollout_batching"] == batching and row["rollout_replicas"] == n
    keys = ["replica_generated_tokens", "replica_tokens_per_s", "replica_queue_wait_mean_s",
            "replica_queue_wait_p95_s", "replica_running_mean", "replica_engine_steps"]
    assert all(len(row[k]) == n for k in keys), {k: row[k] for k in keys}
    assert sum(row["replica_generated_tokens"]) == row["loss_tokens"] > 0
    for r in range(n):
        served = row["replica_generated_tokens"][r] if batching == "continuous" else \
            (row["replica_requests"][r] if n > 1 else row["trajectories"] * row["turns_mean"])
        assert row["replica_running_mean"][r] * row["replica_engine_steps"][r] == pytest.approx(served)
        assert row["replica_tokens_per_s"][r] > 0
        assert row["replica_queue_wait_p95_s"][r] >= row["replica_queue_wait_mean_s"][r] >= 0
