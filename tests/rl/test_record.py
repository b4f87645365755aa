"""A round's metrics row and events from hand-built worker reports (rl/reports.py), against values worked
out by hand: a GRPO `stream` round of one group of two trajectories, and an OPD `async` round of one
trajectory of two turns. Times are dyadic (exact in binary), so every figure compares exactly, and key
order too: it is the files' (docs/run-directory.md)."""

import json

import pytest

from tsrl_cli.config import load_config
from tsrl_cli.rl.record import certificate_summary, round_record
from tsrl_cli.rl.reports import (
    Batching,
    BatchSpan,
    Certificate,
    GroupClose,
    LearnerReport,
    LearnerWork,
    PerRank,
    Published,
    RankFigures,
    RolloutReport,
    RoundReports,
    Sampled,
    Span,
    TeacherReport,
    TrajectoryEnd,
    TrajectoryItem,
    TurnItem,
    WeightSync,
)

T0 = 100.0  # the round's start


def same(a, b) -> bool:
    """Equal, keys in the same order (dict equality alone ignores the order the files keep)."""
    return a == b and json.dumps(a) == json.dumps(b)


def rollout(**kw) -> RolloutReport:
    base = dict(version=0, gen_start=T0, gen_end=102.25, last_finished=102.25, trajectories=2, tokens=22,
                loss_tokens=10, reward_mean=0.5, reward_std=0.5, turns_mean=1.5,
                exit_reasons={"submitted": 1, "max_turns": 1}, env_errors=0, resumed_trajectories=0,
                tool_call_errors=1, tool_call_error_kinds={"no_call": 1},
                sampled=Sampled({"echo/a": 2}, [10, 12], [2, 1]), tool_s=0.5, injected_s=0.0, engine="HFEngine",
                replicas=1, batching=Batching("continuous", [10], [4.0], [0.25], [0.5], [1.5], [8]),
                peak_rss=111, peak_device=None)
    return RolloutReport(**{**base, **kw})


def per_rank(loss=None) -> PerRank:
    return PerRank.gathered([RankFigures(peak_rss=222, peak_device=None, accumulator_peak_bytes=333,
                                         accumulator_set_bytes=100, backwards=2, loss=loss)])


def test_a_grpo_stream_round():
    cfg = load_config(sets=["schedule=stream", "objective=grpo", "seed=3"])
    items = [
        TrajectoryItem(id="g/0", group_id="g", sample_index=0, turn=None, finished_at=101.0, backward_start=101.5,
                       backward_end=102.0, tokens=10, loss_tokens=4, staleness=0, reward=1.0, turns=2,
                       exit="submitted", deferred=False),
        # backwarded with another item in one micro-batch: a quarter of its loss tokens, a quarter of its time
        TrajectoryItem(id="g/1", group_id="g", sample_index=1, turn=None, finished_at=102.5, backward_start=103.0,
                       backward_end=104.0, tokens=12, loss_tokens=6, staleness=0, reward=0.0, share=0.25, turns=1,
                       exit="max_turns", deferred=True),
    ]
    le = LearnerReport(version=1, items=items, group_close=[GroupClose("g", 102.5)], batch=None, trajectories=[],
                       last_arrival=102.5, busy_s=2.5, step=Span(104.0, 104.5), publish=Published(104.5, 104.75, 1000),
                       grad_norm=0.125, model_bytes=4000, trainable_bytes=1000, opd_reverse_kl=None, microbatches=2,
                       learners=1, work=LearnerWork(22, 22, 24, 1.25, real_positions=20), ranks=per_rank(),
                       verify=Certificate(verify_rel_diff=2.0 ** -40, verify_s=0.25), checkpoint="ckpt/round-1",
                       checkpoint_s=0.75)
    sync = WeightSync(104.5, 105.0, bytes=2000, hosts=2)  # publish start to the engines' load end
    row, events = round_record(cfg, 1, RoundReports(rollout(), le), T0, sync)
    assert same(row, {
        "round": 1, "schedule": "stream", "objective": "grpo", "seed": 3, "policy_version": 0,
        "step_time_s": 5.0, "rollout_makespan_s": 2.5, "learner_busy_s": 2.5, "learner_idle_frac": 0.5,
        "last_arrival_to_step_s": 2.0, "optimizer_step_s": 0.5, "weight_sync_s": 0.5,
        "staleness_mean": 0.0, "staleness_max": 0, "peak_mem_rollout_bytes": 111, "peak_mem_learner_bytes": 222,
        "accumulator_peak_bytes": 333, "peak_device_rollout_bytes": None, "peak_device_learner_bytes": None,
        "model_param_bytes": 4000, "trainable_param_bytes": 1000, "trajectories": 2, "tokens": 22,
        "loss_tokens": 10, "reward_mean": 0.5, "reward_std": 0.5, "loss": None, "env_errors": 0,
        "masked_trajectories": 0,
        "tool_call_errors": 1, "tool_call_error_kinds": {"no_call": 1}, "resumed_trajectories": 0,
        "grad_norm": 0.125, "wall_s": None, "core_s": None, "exact": True, "turns_mean": 1.5,
        "exit_reasons": {"submitted": 1, "max_turns": 1}, "weight_bytes": 1000, "weight_sync_bytes": 2000,
        "weight_sync_hosts": 2, "rollout_engine": "HFEngine", "rollout_replicas": 1, "replica_requests": None,
        "rollout_batching": "continuous", "replica_generated_tokens": [10], "replica_tokens_per_s": [4.0],
        "replica_queue_wait_mean_s": [0.25], "replica_queue_wait_p95_s": [0.5], "replica_running_mean": [1.5],
        "replica_engine_steps": [8], "learner_ranks": 1, "microbatches": 2, "learner_positions": 22,
        "learner_real_positions": 20, "peak_mem_learner_rank_bytes": [222],
        "peak_device_learner_rank_bytes": [None], "accumulator_peak_rank_bytes": [333],
        "accumulator_set_rank_bytes": [100], "backwards_rank": [2], "checkpoint_s": 0.75,
        "verify_rel_diff": 2.0 ** -40, "verify_s": 0.25,
    })
    assert same(events, [
        {"round": 1, "event": "item", "id": "g/0", "group_id": "g", "sample_index": 0, "turn": None,
         "finished_at_s": 1.0, "backward_start_s": 1.5, "backward_end_s": 2.0, "learner_cost_s": 0.5, "tokens": 10,
         "loss_tokens": 4, "staleness": 0, "reward": 1.0, "turns": 2, "exit": "submitted", "deferred": False},
        {"round": 1, "event": "item", "id": "g/1", "group_id": "g", "sample_index": 1, "turn": None,
         "finished_at_s": 2.5, "backward_start_s": 3.0, "backward_end_s": 4.0, "learner_cost_s": 0.25, "tokens": 12,
         "loss_tokens": 6, "staleness": 0, "reward": 0.0, "turns": 1, "exit": "max_turns", "deferred": True},
        {"round": 1, "event": "sampled", "tasks": {"echo/a": 2}, "tokens": [10, 12], "turns": [2, 1]},
        {"round": 1, "event": "group_close", "group_id": "g", "at_s": 2.5},
        {"round": 1, "event": "rollout", "start_s": 0.0, "end_s": 2.25},
        {"round": 1, "event": "step", "start_s": 4.0, "end_s": 4.5},
        {"round": 1, "event": "weight_sync", "start_s": 4.5, "end_s": 5.0},
        {"round": 1, "event": "learner_work", "backwards": 2, "microbatches": 2, "positions": 22,
         "trajectory_tokens": 22, "padded_tokens": 24, "busy_cpu_s": 1.25, "real_positions": 20},
        {"round": 1, "event": "round_end", "at_s": 5.0, "learners": 1},
    ])


def test_an_opd_async_round():
    """One trajectory of two turns made with the previous weights (staleness 1); async's round ends at the
    publish, with no bytes or hosts of a load; the lazy batch after the last arrival; the teacher's figures."""
    cfg = load_config(sets=["schedule=async", "objective=opd", "loss.loss_agg=seq-mean-token-mean", "seed=5"])
    turn = dict(group_id="g", sample_index=0, tokens=4, staleness=1, reward=None, backward_start=103.0,
                backward_end=104.0)
    items = [TurnItem(id="g/0/t0", turn=0, finished_at=100.75, loss_tokens=3, closed_at=100.5, teacher_start=100.5,
                      prefix_tokens=8, last=False, **turn),
             TurnItem(id="g/0/t1", turn=1, finished_at=102.0, loss_tokens=4, closed_at=101.5, teacher_start=101.75,
                      prefix_tokens=12, last=True, **turn)]
    end = TrajectoryEnd("g/0", "g", 0, finished_at=102.5, tokens=14, loss_tokens=7, staleness=1, reward=1.0, turns=2,
                        exit="submitted")
    le = LearnerReport(version=2, items=items, group_close=[GroupClose("g", 102.5)],
                       batch=BatchSpan(103.0, 104.0, items=2, padded=True, loss_tokens=7), trajectories=[end],
                       last_arrival=102.5, busy_s=1.5, step=Span(104.0, 104.5), publish=Published(104.5, 105.0, 1000),
                       grad_norm=0.5, model_bytes=4000, trainable_bytes=4000, opd_reverse_kl=0.375, microbatches=1,
                       learners=1, work=LearnerWork(14, 14, 14, 1.0), ranks=per_rank(loss=0.25))
    ro = rollout(version=1, gen_start=99.0, gen_end=102.0, trajectories=1, tokens=14, loss_tokens=7, reward_mean=1.0,
                 reward_std=0.0, turns_mean=2.0, exit_reasons={"submitted": 1}, tool_call_errors=0,
                 tool_call_error_kinds={}, sampled=Sampled({"echo/a": 1}, [14], [2]), engine="VLLMEngine",
                 batching=Batching())
    te = TeacherReport(busy_s=0.5, busy_cpu_s=0.25, turns=2, positions=12, peak_rss=444, peak_device=None)
    row, events = round_record(cfg, 2, RoundReports(ro, le, te), T0, WeightSync(104.5, 105.0))
    want = {"round": 2, "schedule": "async", "objective": "opd", "seed": 5, "policy_version": 1, "step_time_s": 5.0,
            "rollout_makespan_s": 2.5, "learner_busy_s": 1.5, "learner_idle_frac": 0.7,
            "last_arrival_to_step_s": 2.0, "optimizer_step_s": 0.5, "weight_sync_s": 0.5, "staleness_mean": 1.0,
            "staleness_max": 1, "loss": 0.25, "exact": False, "weight_bytes": 1000, "weight_sync_bytes": None,
            "weight_sync_hosts": None, "rollout_engine": "VLLMEngine", "rollout_batching": None,
            "replica_generated_tokens": None, "replica_engine_steps": None, "microbatches": 1,
            "peak_mem_teacher_bytes": 444, "peak_device_teacher_bytes": None, "teacher_busy_s": 0.5,
            "opd_reverse_kl": 0.375}
    assert {k: row[k] for k in want} == want
    assert list(row)[-4:] == ["peak_mem_teacher_bytes", "peak_device_teacher_bytes", "teacher_busy_s",
                              "opd_reverse_kl"]  # no checkpoint_s, no verify_*: neither happened this round
    assert [e["event"] for e in events] == ["item", "item", "trajectory", "sampled", "batch_backward", "group_close",
                                            "rollout", "step", "weight_sync", "learner_work", "teacher", "round_end"]
    assert same(events[1], {"round": 2, "event": "item", "id": "g/0/t1", "group_id": "g", "sample_index": 0,
                            "turn": 1, "finished_at_s": 2.0, "backward_start_s": 3.0, "backward_end_s": 4.0,
                            "learner_cost_s": None, "tokens": 4, "loss_tokens": 4, "staleness": 1, "reward": None,
                            "closed_at_s": 1.5, "teacher_start_s": 1.75, "prefix_tokens": 12, "last": True,
                            "deferred": None})
    assert same(events[2], {"round": 2, "event": "trajectory", "id": "g/0", "group_id": "g", "sample_index": 0,
                            "tokens": 14, "loss_tokens": 7, "staleness": 1, "reward": 1.0, "turns": 2,
                            "exit": "submitted", "finished_at_s": 2.5})
    assert same(events[4], {"round": 2, "event": "batch_backward", "start_s": 3.0, "end_s": 4.0, "items": 2,
                            "loss_tokens": 7, "padded": True})
    assert same(events[6], {"round": 2, "event": "rollout", "start_s": -1.0, "end_s": 2.0})  # async: began before
    assert same(events[10], {"round": 2, "event": "teacher", "busy_s": 0.5, "busy_cpu_s": 0.25, "turns": 2,
                             "positions": 12})


def test_report_rows_read_by_name():
    item = TrajectoryItem(id="g/0", group_id="g", sample_index=0, turn=None, finished_at=1.0, backward_start=None,
                          backward_end=None, tokens=1, loss_tokens=0, staleness=0, reward=0.0, turns=1, exit="x")
    assert item["id"] == "g/0" and item["exit"] == "x"
    with pytest.raises(KeyError):  # a turn item's field, not this one's: as a dict would
        item["closed_at"]


def test_certificate_summary_by_hand():
    rows = [{"learner_busy_s": 2.0, "verify_rel_diff": 1e-12, "verify_s": 0.5}, {"learner_busy_s": 3.0},
            {"learner_busy_s": 2.0, "verify_rel_diff": 3e-12, "verify_s": 0.5}]
    assert certificate_summary(rows) == {"verify_rounds": 2, "verify_rel_diff_max": 3e-12,
                                         "verify_share_of_learner": 0.25}
    assert certificate_summary([{"learner_busy_s": 1.0}]) == {"verify_rounds": 0, "verify_rel_diff_max": None,
                                                              "verify_share_of_learner": None}
