"""The rows the bias audit reads (docs/run-directory.md), written by a real toy run: the rollout side's
`sampled` tally, each trajectory's turns and exit reason, OPD `trajectory` rows, and `deferred` under
loss.max_open_groups. The tally comes from the rollout process and the item rows from the learner, so
their agreement is a check between two processes; tsrl report's table on the same run reads the same."""

import json
from collections import Counter
from pathlib import Path

import pytest

from tsrl_cli.config import LossConfig
from tsrl_cli.report import bias
from tsrl_cli.report.load import load_results
from tsrl_cli.rl.learner import Objective, StreamLearner
from tsrl_cli.rl.train import train
from tsrl_cli.verify import random_rollouts

SPREAD = {"rollout.tool_latency_median_s": 0.05, "rollout.tool_latency_sigma": 1.0}


def events(cfg):
    return [json.loads(line) for line in (Path(cfg.run_dir()) / "events.jsonl").read_text().splitlines()]


def metrics(cfg):
    return [json.loads(line) for line in (Path(cfg.run_dir()) / "metrics.jsonl").read_text().splitlines()]


def by_round(ev, kind):
    out = {}
    for e in ev:
        if e["event"] == kind:
            out.setdefault(e["round"], []).append(e)
    return out


@pytest.mark.parametrize("cap, held", [(None, set()), (1, {"g1"}), (0, {"g0", "g1"})])
def test_stream_learner_names_the_groups_the_cap_held_back(tiny64, cap, held):
    """g0's first member arrives and is backwarded (it opens a buffer); g1's first member arrives while
    g0 is open: with cap 1 it waits (has_work looks, finds nothing to do), and the group completes later."""
    g0a, g0b, g1a, g1b = random_rollouts(tiny64.config.vocab_size, groups=2, group_size=2, seed=3)
    sl = StreamLearner(tiny64, Objective("grpo", LossConfig(max_open_groups=cap)), {"g0": 2, "g1": 2})
    sl.on_trajectory(g0a)
    sl.drain()
    sl.on_trajectory(g1a)
    sl.drain()
    for r in (g0b, g1b):
        sl.on_trajectory(r)
    sl.drain()
    assert sl.deferred == held


@pytest.mark.slow
@pytest.mark.parametrize("cap", [None, 0])
def test_grpo_rows_agree_with_the_rollout_tally(toy_config, cap):
    """cap 0: no group may open a buffer, so every backward waits for its group's close, and the groups
    the learner looked at before their close are flagged `deferred`; no cap: none is."""
    sets = {**SPREAD} if cap is None else {**SPREAD, "loss.max_open_groups": cap}
    cfg = toy_config(out=f"t/stream/seed{cap or 7}", schedule="stream", rounds=2, **sets)
    train(cfg)
    ev, m = events(cfg), metrics(cfg)
    items, sampled = by_round(ev, "item"), by_round(ev, "sampled")
    assert sorted(sampled) == [1, 2] and all(len(s) == 1 for s in sampled.values())
    for row in m:
        k = row["round"]
        s, its = sampled[k][0], sorted(items[k], key=lambda e: (e["group_id"], e["sample_index"]))
        assert s["tokens"] == [e["tokens"] for e in its] and s["turns"] == [e["turns"] for e in its]
        assert s["tasks"] == dict(Counter(bias.task_of(e["group_id"]) for e in its))
        assert Counter(e["exit"] for e in its) == Counter(row["exit_reasons"])
        assert sum(e["turns"] for e in its) == pytest.approx(row["turns_mean"] * len(its))
        close = {e["group_id"]: e["at_s"] for e in ev if e["event"] == "group_close" and e["round"] == k}
        for gid in close:
            flags = {e["deferred"] for e in its if e["group_id"] == gid}
            assert flags == {True} or flags == {False}  # a group is held back as a whole
        if cap == 0:
            assert all(e["backward_start_s"] >= close[e["group_id"]] for e in its)
        assert {e["deferred"] for e in its} <= {cap == 0}
    flagged = [e for e in ev if e["event"] == "item" and e["deferred"]]
    assert bool(flagged) is (cap == 0)
    table, tasks, _ = bias.bias_table(load_results(Path(cfg.run_dir()).parents[2]))
    (r,) = table.records()
    assert (r["sampled"], r["trained"], r["sampled_source"]) == (16, 16, "rollout")
    assert r["deferred"] == len(flagged) and r["max_open_groups"] == cap
    assert r["tokens_sampled_p90"] == r["tokens_trained_p90"] and r["turns_sampled_mean"] == r["turns_trained_mean"]
    assert r["staleness_shares"] == "0: 100 %" and set(tasks["trained_pct"]) == {100.0}


@pytest.mark.slow
def test_opd_trajectory_rows_agree_with_the_rollout_tally(toy_config):
    cfg = toy_config(out="o/stream/seed1", objective="opd", schedule="stream", rounds=1, **SPREAD)
    train(cfg)
    ev = events(cfg)
    (s,) = by_round(ev, "sampled")[1]
    trajs = sorted(by_round(ev, "trajectory")[1], key=lambda e: (e["group_id"], e["sample_index"]))
    assert s["tokens"] == [e["tokens"] for e in trajs] and s["turns"] == [e["turns"] for e in trajs]
    turn_rows = Counter((e["group_id"], e["sample_index"]) for e in ev if e["event"] == "item")
    assert [turn_rows[(e["group_id"], e["sample_index"])] for e in trajs] == s["turns"]  # a turn row per model turn
    assert all(e["staleness"] == 0 and e["exit"] for e in trajs)
