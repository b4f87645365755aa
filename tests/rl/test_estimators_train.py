"""Advantage estimators, std choices, buffer forms and granularities through `tsrl train`, every schedule,
one process and a learner group of two CPU ranks, float64.

Each run certifies every round (run.verify_every=1, rl/certificate.py): the step's gradient is recomputed
the other way, from the estimator's definition (core.advantages: the lazy padded batch), and the run
stops above 1e-9. The rows then show each round certified and with a real gradient. The stream and sync
runs of one variant also end on the same weights.
"""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tsrl_cli.config import load_config
from tsrl_cli.rl.train import train

pytestmark = pytest.mark.slow
SETS = ["model.policy=builtin:toy", "model.teacher=builtin:toy-teacher", "data.train=[builtin:echo]",
        "rollout.prompts_per_round=2", "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
        "rollout.max_trajectory_tokens=400", "optim.lr=1e-3", "model.dtype=float64", "run.verify_every=1",
        "run.verify_tol=1e-9", "rollout.tool_latency_median_s=0.1", "run.save_every=2"]
ROUNDS = 2
VARIANTS = {
    "population_std": ["loss.adv_std=population"],  # the authors' definition (thundersync)
    "rloo_buckets": ["loss.adv_norm=rloo", "loss.group_buffers=buckets"],
    "group_granularity": ["learner.granularity=group", "loss.adv_std=population"],
}


def run(out: Path, schedule: str, learners: str, variant: str) -> list[dict]:
    cfg = load_config(sets=[*SETS, *VARIANTS[variant], f"devices.learner={learners}", f"run.out={out}"],
                      flags={"schedule": schedule, "objective": "grpo", "rounds": ROUNDS})
    train(cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == ROUNDS
    for r in rows:
        assert r["verify_rel_diff"] is not None and r["verify_rel_diff"] <= 1e-9, r["verify_rel_diff"]
        assert r["grad_norm"] > 1e-3  # a real gradient, not a comparison of zeros
    return rows


def weights(d: Path):
    return load_file(str(d / "checkpoints" / f"round-{ROUNDS}" / "model.safetensors"))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("learners", ["cpu", "cpu:2"])
def test_every_schedule_certified(toy_policies, tmp_path, variant, learners):
    for schedule in ("sync", "stream", "async"):
        run(tmp_path / schedule, schedule, learners, variant)
    a, b = weights(tmp_path / "sync"), weights(tmp_path / "stream")
    assert max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-300)) for k in a) < 1e-9


def test_the_std_choice_reaches_the_learner(toy_policies, tmp_path):
    """Positive control of the runs above: round 1 (same weights, same rollouts) under verl's unbiased std has a
    gradient smaller by (N - 1) / N) ** 0.5 in every group of N = 4 with reward variance, so by that factor in
    norm (AdamW's step hides a uniform scale, so the weights are not the comparison)."""
    pop = run(tmp_path / "population", "sync", "cpu", "population_std")
    cfg = load_config(sets=[*SETS, f"run.out={tmp_path / 'unbiased'}"],
                      flags={"schedule": "sync", "objective": "grpo", "rounds": ROUNDS})
    train(cfg)
    unb = [json.loads(x) for x in (tmp_path / "unbiased" / "metrics.jsonl").read_text().splitlines()]
    assert unb[0]["grad_norm"] / pop[0]["grad_norm"] == pytest.approx((3 / 4) ** 0.5, rel=1e-5)
