"""The OPD teacher's price: `tsrl plan` counts every open session's key/value cache (rollout.concurrency x
rollout.max_trajectory_tokens x the KV bytes per token, rl/teacher_worker.teacher_cache_bytes) or the cap
model.teacher_cache_gib sets, and says how many full-length sessions that holds; `tsrl predict` reports the
teacher's busy time per OPD round against the rollout's, the teacher-bound rounds and the positions its
forwards covered per trajectory token (the `teacher` event of events.jsonl).
"""

import json

import pytest
import yaml
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import load_config
from tsrl_cli.plan import plan_experiment
from tsrl_cli.policy import tiny_qwen3_config
from tsrl_cli.predict import predict_trace
from tsrl_cli.traces import load_trace

runner = CliRunner()
KV = 2 * 2 * 2 * 16 * 4  # the tiny teacher's keys and values per token: 2 x 2 layers x 2 KV heads x 16 x 4 bytes


def _opd_experiment(tmp_path, *sets):
    folder = tmp_path / "model"
    folder.mkdir()
    tiny_qwen3_config(vocab_size=512, hidden=64, layers=2, max_positions=512).to_json_file(str(folder / "config.json"))
    doc = {"objective": "opd",
           "model": {"policy": "builtin:toy", "policy_config": str(folder), "teacher_config": str(folder)},
           "rollout": {"max_trajectory_tokens": 256, "prompts_per_round": 2, "group_size": 2, "concurrency": 64},
           "devices": {"teacher": 1}}
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump(doc))
    return load_config(f, list(sets))


def _teacher(cfg, **kw):
    return next(p for p in plan_experiment(cfg, **kw)["processes"] if p["name"] == "teacher")


def test_the_plan_holds_every_open_sessions_cache(tmp_path):
    """64 sessions of 256 tokens at 512 bytes a token beside the traced forward's own prefix: 63 x 256 x 512 bytes
    more; 128 sessions twice that and one more; a cap of 0 GiB keeps one trajectory's cache, and says so."""
    cfg = _opd_experiment(tmp_path)
    t = _teacher(cfg, capacity_gib=1.0)
    assert t["parts"]["other_caches"] == 63 * 256 * KV and t["counts"]["kv_bytes_per_token"] == KV
    assert (t["counts"]["sessions"], t["counts"]["sessions_cached"]) == (64, 64)
    assert "the caches of all 64 open sessions" in t["how"]
    more = _teacher(load_config(tmp_path / "exp.yaml", ["rollout.concurrency=128"]), capacity_gib=1.0)
    assert more["peak_bytes"] - t["peak_bytes"] == 64 * 256 * KV
    capped = _teacher(load_config(tmp_path / "exp.yaml", ["model.teacher_cache_gib=0"]), capacity_gib=1.0)
    assert capped["parts"]["other_caches"] == 0 and capped["counts"]["sessions_cached"] == 1
    assert "caches for 1 of 64 full-length sessions" in capped["how"] and not t["warnings"]
    assert capped["warnings"] == [w for w in capped["warnings"] if "hold 1 of 64 full-length sessions" in w] != []
    assert t["peak_bytes"] - capped["peak_bytes"] == 63 * 256 * KV


def test_a_device_too_small_for_every_session_fails_until_the_cap_is_set(tmp_path):
    """The teacher's device fits its forward and one trajectory's cache but not 10,000 sessions' (1.2 GiB): the plan
    exits 1 naming the teacher; model.teacher_cache_gib brings it back under the device."""
    _opd_experiment(tmp_path)
    exp_path = str(tmp_path / "exp.yaml")
    one = _teacher(load_config(exp_path, ["model.teacher_cache_gib=0"]), capacity_gib=1000.0)
    gib = (one["peak_bytes"] + (1 << 29)) / 2**30  # room for 0.5 GiB of caches more
    res = runner.invoke(app, ["plan", exp_path, "--set", "rollout.concurrency=10000", "--capacity-gib", str(gib),
                              "--json"])
    assert res.exit_code == 1, res.output
    teacher = next(p for p in json.loads(res.stdout)["processes"] if p["name"] == "teacher")
    assert not teacher["fits"] and teacher["parts"]["other_caches"] == 9999 * 256 * KV
    res = runner.invoke(app, ["plan", exp_path, "--set", "rollout.concurrency=10000", "--set",
                              "model.teacher_cache_gib=0.25", "--capacity-gib", str(gib), "--json"])
    assert res.exit_code == 0, res.output
    teacher = next(p for p in json.loads(res.stdout)["processes"] if p["name"] == "teacher")
    assert teacher["fits"] and teacher["counts"]["sessions_cached"] == (1 << 28) // (256 * KV) == 2048
    assert "caches for 2048 of 10000 full-length sessions" in teacher["how"]


# ---------------------------------------------------------------------------- tsrl predict: the teacher's load


def _run(d, busy, rollout=4.0, positions=150):
    """A stream OPD run of two rounds: trajectories A (30 tokens) and B (20 tokens), one turn item each, the
    rollout generating for `rollout` s, the teacher busy `busy[k]` s of round k covering `positions`."""
    d.mkdir()
    ev = []
    for k in (1, 2):
        for gid, end, at in (("A", 30, 1.0), ("B", 20, 2.0)):
            ev.append({"round": k, "event": "item", "id": f"{gid}/0/t0", "group_id": gid, "sample_index": 0,
                       "turn": 0, "finished_at_s": at, "learner_cost_s": 1.0, "tokens": 5, "loss_tokens": 5,
                       "staleness": 0, "prefix_tokens": end, "last": True})
            ev.append({"round": k, "event": "trajectory", "id": f"{gid}/0", "group_id": gid, "sample_index": 0,
                       "finished_at_s": at + 0.5, "tokens": end})
        ev += [{"round": k, "event": "rollout", "start_s": 0.0, "end_s": rollout},
               {"round": k, "event": "teacher", "busy_s": busy[k - 1], "busy_cpu_s": 0.1, "turns": 2,
                "positions": positions},
               {"round": k, "event": "learner_work", "positions": 50, "trajectory_tokens": 50, "padded_tokens": 60},
               {"round": k, "event": "step", "start_s": 5.0, "end_s": 5.5},
               {"round": k, "event": "round_end", "at_s": 5.5, "learners": 1}]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"round": k, "schedule": "stream", "step_time_s": 5.5}) + "\n"
                                             for k in (1, 2)))
    (d / "config.yaml").write_text("name: x\nobjective: opd\n")
    return d


def test_predict_reports_the_teachers_busy_time_and_bound_rounds(tmp_path):
    """Round 1: teacher busy 3 s of a 4 s rollout (not bound); round 2: 6 s (bound). Its forwards covered 150
    positions for 50 trajectory tokens: 3 per token, prefixes re-scored."""
    trace = load_trace(_run(tmp_path / "run", busy=(3.0, 6.0)))
    assert [(r.teacher_busy_s, r.teacher_positions) for r in trace.rounds] == [(3.0, 150), (6.0, 150)]
    doc = predict_trace(trace, warmup=0)
    rows = {r["round"]: r["teacher"] for r in doc["rounds"]}
    assert rows[1]["bound"] is False and rows[2]["bound"] is True
    assert rows[2]["busy_over_rollout"] == pytest.approx(1.5) and rows[1]["positions_per_token"] == pytest.approx(3.0)
    t = doc["teacher"]
    assert t["bound_rounds"] == [2] and t["busy_s"] == pytest.approx(4.5) and t["rollout_s"] == pytest.approx(4.0)
    assert t["busy_over_rollout"] == pytest.approx(1.125) and t["positions_per_token"] == pytest.approx(3.0)
    human = runner.invoke(app, ["predict", "--trace", str(tmp_path / "run"), "--warmup", "0"])
    text = " ".join(human.stdout.replace("│", " ").split())  # the table's cells, unwrapped
    assert human.exit_code == 0 and "teacher-bound in 1 of 2 rounds; 3 positions per trajectory token" in text, text


def test_predict_without_a_teacher_event_reports_none(tmp_path):
    """A trace without `teacher` events (a minimal trace, or a run before them): no teacher figures, no claim."""
    d = _run(tmp_path / "run", busy=(1.0, 1.0))
    lines = [x for x in (d / "events.jsonl").read_text().splitlines() if '"teacher"' not in x]
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")
    doc = predict_trace(load_trace(d), warmup=0)
    assert doc["teacher"] is None and all(r["teacher"] is None for r in doc["rounds"])
