"""learner.opd_unit: what one OPD backward covers, a teacher-scored turn or a whole trajectory.

- float64, one process, the schedules themselves (rl/schedules.learn_stream, learn_sync with sync_batching
  per_item) fed by a scripted queue: under either unit, token-mean and seq-mean-token-mean, turns arriving
  one at a time or in bursts, the gradient equals the verl-style lazy loss (rl.learner.lazy_loss), an
  independent reference; under `trajectory` each trajectory is one row, at its end, over sum T_i;
- K = 8, 16, 32 model turns (experiments/opd_horizon.py's round): `trajectory` covers <= 1.10x the lazy
  batch's positions (and sum T_i) and is float64 exact; `turn` covers about (K + 1)/2 x sum T_i, so the
  bound can fail;
- a learner group of 2 CPU ranks (tsrl verify's sharded stream): equal to the lazy gradient, one row per
  trajectory at most;
- `tsrl train`, float64, OPD under sync and stream, one process and cpu:2, both aggregations, with the
  exactness certificate every round: the certificate holds, stream ends on sync's weights, and the stream
  run's events show every trajectory backwarded once, after its end;
- a bad value is one line, exit 2 (config and the engine).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tsrl_cli.config import ConfigError, LearnerConfig, LossConfig, load_config
from tsrl_cli.core.graddiff import compare
from tsrl_cli.errors import UsageError
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.rl.schedules import learn_sync

ROOT = Path(__file__).resolve().parents[2]
AGGS = ("token-mean", "seq-mean-token-mean")


def _horizon():
    spec = importlib.util.spec_from_file_location("opd_horizon", ROOT / "experiments" / "opd_horizon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


H = _horizon()


@pytest.fixture(scope="module")
def four_turns(teacher64):
    return H.scored(H.horizon_round(4, trajectories=4, seed=3), teacher64)


def lazy_grads(model, ro, obj):
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(lazy_loss(model, ro, obj), params))


def rel(ref, got):
    cmp = compare([""] * len(ref), ref, got)
    assert cmp["max_abs_grad"] > 1e-6  # a gradient that is not zero
    return cmp["max_rel_diff"]


# ---- the schedules, one process -------------------------------------------------------------------------


@pytest.mark.parametrize("loss_agg", AGGS)
@pytest.mark.parametrize("unit", ["trajectory", "turn"])
@pytest.mark.parametrize("burst", [1, 5])
def test_stream_equals_lazy(tiny64, four_turns, loss_agg, unit, burst):
    obj = Objective("opd", LossConfig(loss_agg=loss_agg))
    work = H.run_round(tiny64, four_turns, obj, "stream", unit, burst)
    assert rel(lazy_grads(tiny64, four_turns, obj), work.grads) <= 1e-10
    lengths = [len(r.input_ids) for r in four_turns]  # each ends at its last turn: a row over it is T_i
    if unit == "trajectory":
        assert work.backwards == len(four_turns) and work.positions == sum(lengths)
        ends = {t["id"]: t["finished_at"] for t in work.trajectories}
        for it in work.items:  # every turn waited for its trajectory's end, and shares that one backward
            assert it["backward_start"] >= ends[f"{it['group_id']}/{it['sample_index']}"]
    else:
        assert work.positions > 1.2 * sum(lengths)  # re-encoding: a turn's row covers its whole prefix


@pytest.mark.parametrize("loss_agg", AGGS)
def test_sync_per_item_with_the_trajectory_unit_equals_lazy(tiny64, four_turns, loss_agg):
    """sync_batching per_item: stream's per-item work after the last arrival (the certificate's recomputation of a
    padded sync step runs the same path)."""
    obj = Objective("opd", LossConfig(loss_agg=loss_agg))
    learner = H.ScriptedLearner(tiny64, obj, H.messages(four_turns), 1, "trajectory")
    learner.cfg.sync_batching = "per_item"
    work = learn_sync(learner, H.plan_of(four_turns))
    assert rel(lazy_grads(tiny64, four_turns, obj), work.grads) <= 1e-10
    assert work.backwards == len(four_turns)


def test_held_turns_are_not_work_until_the_end(tiny64, four_turns):
    obj = Objective("opd", LossConfig(loss_agg="seq-mean-token-mean"))
    r = four_turns[0]
    sl = StreamLearner(tiny64, obj, {r.group_id: 1}, opd_unit="trajectory")
    msgs = [m for m in H.messages([r]) if hasattr(m, "turn")]
    for m in msgs:
        sl.on_turn(m.rollout, m.turn)
    assert not sl.has_work() and sl.step() == [] and sl.acc.peak_open_bytes == 0  # no unit buffer either
    with pytest.raises(RuntimeError, match="not backwarded"):
        sl.close_round()
    sl.end_trajectory(r)
    assert [b.rows for b in sl.step()] == [1] and not sl.has_work()
    assert sl.batches[0].target == ("round",) and sl.batches[0].width == len(r.input_ids)


# ---- K = 8, 16, 32 turns ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("turns", [8, 16, 32])
def test_long_horizons_cost_the_lazy_batch(turns):
    units = ("trajectory", "turn") if turns == 8 else ("trajectory",)
    res = H.measure(turns, repeat=1, hidden=16, layers=1, units=units)
    rows = {r["opd_unit"]: r for r in res["rows"]}
    lazy, traj = rows[None], rows["trajectory"]
    assert traj["positions_over_lazy_batch"] <= 1.10 and traj["positions_over_sum_T"] <= 1.10
    assert traj["backwards"] == res["trajectories"]
    assert all(r["max_rel_diff"] <= 1e-9 for r in res["rows"])
    assert lazy["positions"] == lazy["padded_tokens"]  # the lazy batch: B x T_max
    if "turn" in rows:  # the control: per-turn backwards re-encode, (K + 1)/2 = 4.5 at K = 8
        assert rows["turn"]["positions_over_sum_T"] > 4.0 and rows["turn"]["positions_over_lazy_batch"] > 1.10


# ---- a learner group of 2 CPU ranks ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", AGGS)
def test_group_of_two_ranks_equals_lazy(loss_agg):
    from tsrl_cli.verify import VerifyOptions, run_verify

    res = run_verify(VerifyOptions(objective="opd", learners="cpu:2", groups=2, group_size=4, seed=5,
                                   loss=LossConfig(loss_agg=loss_agg), learner=LearnerConfig(opd_unit="trajectory")))
    assert res["ok"] and res["max_rel_diff"] <= 1e-10 and res["learner_ranks"] == 2, res
    assert res["opd_unit"] == "trajectory"
    assert res["stream_backwards"] <= res["num_trajectories"] < res["num_items"]  # one row per trajectory at most


# ---- tsrl train ------------------------------------------------------------------------------------------

SETS = ["model.policy=builtin:toy", "model.teacher=builtin:toy-teacher", "data.train=[builtin:echo]",
        "rollout.prompts_per_round=2", "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
        "rollout.max_trajectory_tokens=400", "optim.lr=1e-2", "run.save_every=1", "model.dtype=float64",
        "rollout.tool_latency_median_s=0.05", "rollout.tool_latency_sigma=1.0", "run.verify_every=1"]


def _train(out, schedule, learners, loss_agg, unit="trajectory"):
    from tsrl_cli.rl.train import train

    cfg = load_config(sets=[*SETS, f"devices.learner={learners}", f"run.out={out}", f"loss.loss_agg={loss_agg}",
                            f"learner.opd_unit={unit}"], flags={"schedule": schedule, "rounds": 2, "objective": "opd"})
    train(cfg)
    return Path(out)


def _jsonl(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _weights(d):
    from safetensors.torch import load_file

    return load_file(str(Path(d) / "checkpoints" / "round-2" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", AGGS)
@pytest.mark.parametrize("learners", ["cpu", "cpu:2"])
def test_train_sync_and_stream_with_the_trajectory_unit(toy_policies, tmp_path, learners, loss_agg):
    runs = {s: _train(tmp_path / s, s, learners, loss_agg) for s in ("sync", "stream")}
    for d in runs.values():  # the certificate: each round's gradient recomputed the other way, float64
        assert all(r["verify_rel_diff"] <= 1e-9 for r in _jsonl(d / "metrics.jsonl"))
    a, b = _weights(runs["sync"]), _weights(runs["stream"])
    assert max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a) < 1e-9
    ev = _jsonl(runs["stream"] / "events.jsonl")
    turns = [e for e in ev if e["event"] == "item" and e["loss_tokens"]]
    last_scores: dict = {}  # (round, trajectory id) -> when its last turn's scores reached the learner
    for e in turns:
        key = (e["round"], e["id"].rsplit("/", 1)[0])
        last_scores[key] = max(last_scores.get(key, e["finished_at_s"]), e["finished_at_s"])
    # every turn waited for its trajectory's last turn (marked last as it closed, or ended by TrajectoryDone),
    # and a trajectory's turns shared one backward
    assert turns and all(e["backward_start_s"] >= last_scores[(e["round"], e["id"].rsplit("/", 1)[0])] for e in turns)
    starts: dict = {}
    for e in turns:
        starts.setdefault((e["round"], e["id"].rsplit("/", 1)[0]), set()).add(e["backward_start_s"])
    assert all(len(s) == 1 for s in starts.values())
    work = [e for e in ev if e["event"] == "learner_work"]
    # one row per trajectory, each at most T_max wide (rows of a group's micro-batch pad to the widest, so sum T_i
    # is not a bound there): never more than the lazy padded batch B x T_max
    assert all(w["positions"] <= w["padded_tokens"] for w in work)


def test_a_turn_known_last_releases_its_trajectory_before_the_end(tiny64, four_turns):
    """A turn the rollout marked last (it submitted, or max_turns) comes without the placeholder span: the
    trajectory's held turns are one row at its scores, before the TrajectoryDone that waits for the reward; the
    gradient is the lazy one. Control: the same turns with the placeholder stay held until end_trajectory."""
    from tsrl_cli.rollouts import Rollout

    obj = Objective("opd", LossConfig(loss_agg="seq-mean-token-mean"))
    r = four_turns[0]

    def partial(k: int, last: bool) -> Rollout:
        e = r.turn_spans[k][1]
        spans = list(r.turn_spans[:k + 1]) + ([] if last else [(e, e)])
        return Rollout(r.group_id, r.sample_index, r.input_ids[:e], r.loss_mask[:e], 0.0, spans,
                       teacher_logprobs=r.teacher_logprobs[:e])

    n = len(r.turn_spans)
    for last_marked in (True, False):
        sl = StreamLearner(tiny64, obj, {r.group_id: 1}, opd_unit="trajectory")
        for k in range(n):
            sl.on_turn(partial(k, last_marked and k == n - 1), k)
        assert sl.has_work() == last_marked
        if last_marked:
            batches = sl.step()
            assert len(batches) == 1 and len(batches[0].items) == n and not sl.has_work()  # one row, every turn
        sl.end_trajectory(r)  # the TrajectoryDone: a no-op after a last-marked turn
        sl.drain()
        got = sl.close_round()
        assert sl.backwards == 1
        assert rel(lazy_grads(tiny64, [r], obj), got) <= 1e-10


# ---- bad values -------------------------------------------------------------------------------------------


def test_bad_unit_is_refused(tiny64):
    with pytest.raises(ConfigError, match="learner.opd_unit: 'turns' is not one of trajectory, turn"):
        load_config(sets=["learner.opd_unit=turns"])
    with pytest.raises(UsageError, match="OPD unit 'turns' is unknown"):
        StreamLearner(tiny64, Objective("opd"), opd_unit="turns")
