"""Infrastructure failures do not bias a group: a masked trajectory (its sandbox did not start, its engine
failed) is out of its group's statistics and of the loss, in float64, against references written here.

- a group of 8 with one masked member equals the group of its 7 valid members (streamed in random order,
  per item after the last arrival, and the lazy batch), for GRPO, Dr. GRPO and RLOO, affine and buckets;
- a group that masking leaves with one valid member contributes no policy gradient (advantage 0), its
  tokens still counted, as a zero-variance group's;
- `tsrl train` with one injected container-start failure in a group of 8 completes, counts it, and its
  round-1 gradient is the one of the 7 valid members (its norm against a reference on the round-0 weights).
"""

import dataclasses
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from grad_compare import rel

from tsrl_cli.config import LossConfig
from tsrl_cli.core.advantages import ADVANTAGES
from tsrl_cli.policy import forward_logprobs, load_policy
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.rollouts import Rollout
from tsrl_cli.verify import random_rollouts


def grads_of(model, loss):
    return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


def streamed(model, rollouts, obj, order_seed=0, max_items=1):
    sl = StreamLearner(model, obj, Counter(r.group_id for r in rollouts), max_items=max_items)
    for r in random.Random(order_seed).sample(rollouts, len(rollouts)):
        sl.on_trajectory(r)
        sl.drain()
    sl.drain()
    return sl.close_round()


def reference(model, rollouts, adv_of, loss_tokens):
    """token-mean GRPO written out: sum_i A_i * (-sum_t m_t logp_t) / N over the rollouts given."""
    total = 0
    for r in rollouts:
        logp, _ = forward_logprobs(model, torch.tensor([r.input_ids]))
        total = total - adv_of[r.key] * (logp[0] * torch.tensor(r.loss_mask, dtype=logp.dtype)).sum()
    return grads_of(model, total / loss_tokens)


@pytest.fixture(scope="module")
def eight(tiny64):
    """g0: 8 members with binary rewards and g1: 8 with continuous ones; member 3 of g0 masked. It has model
    tokens and a high reward (an engine failure mid-trajectory): counted, it would shift the group's mean."""
    ro = [r for r in random_rollouts(128, 2, 8, seed=11)]
    masked = next(r for r in ro if r.key == ("g0", 3))
    masked.masked, masked.reward = True, 1.0
    assert masked.num_loss_tokens > 0
    return ro


@pytest.mark.parametrize("estimator,buffers", [("group", "affine"), ("group", "buckets"), ("center", "affine"),
                                               ("rloo", "buckets")])
def test_a_masked_member_equals_the_group_without_it(tiny64, eight, estimator, buffers):
    obj = Objective("grpo", LossConfig(adv_norm=estimator, group_buffers=buffers))
    valid = [r for r in eight if not r.masked]
    fn = ADVANTAGES[estimator].advantages
    adv = {}
    for g in ("g0", "g1"):
        members = [r for r in valid if r.group_id == g]
        a = fn(torch.tensor([m.reward for m in members], dtype=torch.float64), 1e-6, "unbiased")
        adv.update({m.key: float(x) for m, x in zip(members, a, strict=True)})
    ref = reference(tiny64, valid, adv, sum(r.num_loss_tokens for r in valid))
    # the learner on the 7 valid members of a group of 7: what masking must equal
    without = streamed(tiny64, valid, obj)
    assert rel(without, ref) <= 1e-9
    for order in range(3):  # streamed: the masked member arrives before, between and after the others
        assert rel(streamed(tiny64, eight, obj, order), ref) <= 1e-9
    assert rel(streamed(tiny64, eight, obj, 0, max_items=None), ref) <= 1e-9  # micro-batched
    assert rel(grads_of(tiny64, lazy_loss(tiny64, eight, obj)), ref) <= 1e-9  # the lazy batch
    # the control: counted as a valid member, the same rollout moves the gradient
    counted = [dataclasses.replace(r, masked=False) for r in eight]
    assert rel(streamed(tiny64, counted, obj), ref) > 1e-3


@pytest.mark.parametrize("estimator", ["group", "center"])
def test_a_group_left_with_one_valid_member_contributes_no_policy_gradient(tiny64, estimator):
    ro = random_rollouts(128, 2, 2, seed=5)  # g0 and g1, two members each
    ro[0].masked = True  # g0 keeps one valid member: no baseline left
    lone = ro[1]
    lone.reward = 0.75  # verl's singleton rule would push it by this raw reward
    obj = Objective("grpo", LossConfig(adv_norm=estimator))
    others = [r for r in ro if r.group_id == "g1"]
    a = ADVANTAGES[estimator].advantages(torch.tensor([r.reward for r in others], dtype=torch.float64))
    adv = {**{r.key: float(x) for r, x in zip(others, a, strict=True)}, lone.key: 0.0}
    n = sum(r.num_loss_tokens for r in ro if not r.masked)  # the lone member's tokens still count in N
    ref = reference(tiny64, [lone, *others], adv, n)
    assert rel(streamed(tiny64, ro, obj), ref) <= 1e-9
    assert rel(streamed(tiny64, ro, obj, order_seed=3), ref) <= 1e-9
    assert rel(grads_of(tiny64, lazy_loss(tiny64, ro, obj)), ref) <= 1e-9


def test_the_masked_flag_round_trips_and_stays_out_of_unmasked_rows(tmp_path):
    from tsrl_cli.rollouts import parse_rollout

    r = Rollout("g", 0, [1, 2, 3], [0, 1, 1], 0.0, [(1, 3)])
    assert "masked" not in r.to_json()  # rows of unmasked trajectories are as before
    m = dataclasses.replace(r, masked=True)
    assert m.to_json()["masked"] is True and parse_rollout(m.to_json(), "x").masked
    with pytest.raises(Exception, match="masked"):
        parse_rollout({**m.to_json(), "masked": "yes"}, "x")


SETS = ["model.policy=builtin:toy", "data.train=[builtin:echo]", "rollout.prompts_per_round=2",
        "rollout.group_size=8", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
        "rollout.max_trajectory_tokens=400",
        "optim.lr=1e-3", "model.dtype=float64", "run.save_rollouts=true", "run.save_every=1", "run.verify_every=1"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["stream", "sync"])
def test_a_round_with_one_failed_container_start(toy_policies, tmp_path, schedule):
    """Sample 3 of round 1's first group cannot start its container (tsrl_cli/rl/faults.py FAIL_START_ENV):
    1 of 16 trajectories, under rollout.max_env_error_frac 0.1. The round completes and counts it; the
    certificate holds; the round's gradient norm equals that of the 7 valid members' reference on the round-0
    weights (and not that of 8 members, the failure scored 0)."""
    from tsrl_cli.rl.faults import FAIL_START_ENV

    d = tmp_path / "run"
    args = [a for s in SETS for a in ("--set", s)]
    # a process of its own: the hook is read by the rollout worker, which a forkserver started earlier would not see
    out = subprocess.run([sys.executable, "-m", "tsrl_cli", "train", *args, "--schedule", schedule, "--rounds", "1",
                          "--out", str(d), "--json"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, FAIL_START_ENV: "1:0:3"})
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads((d / "metrics.jsonl").read_text().splitlines()[0])
    assert (row["env_errors"], row["masked_trajectories"], row["trajectories"]) == (1, 1, 16)
    assert row["verify_rel_diff"] <= 1e-9
    ro = [json.loads(x) for x in (d / "rollouts.jsonl").read_text().splitlines()]
    failed = [r for r in ro if r.get("masked")]
    assert len(failed) == 1 and failed[0]["sample_index"] == 3
    rollouts = [Rollout(r["group_id"], r["sample_index"], r["input_ids"], r["loss_mask"], r["reward"],
                        [tuple(s) for s in r["turn_spans"]], masked=r.get("masked", False)) for r in ro]
    model, _ = load_policy(Path(d) / "checkpoints" / "round-0", dtype="float64")
    valid = [r for r in rollouts if not r.masked]
    fn = ADVANTAGES["group"].advantages

    def advantages(members):
        out = {}
        for g in {r.group_id for r in members}:
            ms = [r for r in members if r.group_id == g]
            out.update({m.key: float(a) for m, a in zip(ms, fn(torch.tensor([m.reward for m in ms])), strict=True)})
        return out

    n = sum(r.num_loss_tokens for r in valid)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                 for g in reference(model, valid, advantages(valid), n)]))
    assert float(norm) > 1e-3 and row["grad_norm"] == pytest.approx(float(norm), rel=1e-9)
    scored_zero = [dataclasses.replace(r, masked=False) for r in rollouts]  # the failure as a reward of 0
    wrong = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference(
        model, scored_zero, advantages(scored_zero), n)]))
    assert abs(float(wrong) - row["grad_norm"]) / row["grad_norm"] > 1e-6
