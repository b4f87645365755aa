"""The round engine end to end on the toy workload: real processes, real queues, real engine.

- float64 sync == stream (GRPO 3 rounds, OPD 2 rounds): identical rollouts, weights within 1e-9
- rollouts are a pure function of (weights, seed, round, task, sample): replayed from a checkpoint
- async records staleness >= 1 after round 1; stream records 0
- the run directory follows docs/run-directory.md; DONE is written last
- resume after a crash gives the uninterrupted run's fp32 weights exactly
"""

import asyncio
import json
import queue
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from tsrl_cli.rl.train import train

pytestmark = pytest.mark.slow

METRIC_KEYS = (
    "round", "schedule", "objective", "seed", "policy_version", "step_time_s", "rollout_makespan_s",
    "learner_busy_s", "learner_idle_frac", "last_arrival_to_step_s", "optimizer_step_s", "weight_sync_s",
    "staleness_mean", "staleness_max", "peak_mem_rollout_bytes", "peak_mem_learner_bytes",
    "accumulator_peak_bytes", "trajectories", "tokens", "loss_tokens", "reward_mean", "reward_std", "loss",
    "grad_norm", "wall_s", "core_s",
)
EVENT_KEYS = {
    "item": ["id", "group_id", "sample_index", "turn", "finished_at_s", "backward_start_s", "backward_end_s",
             "learner_cost_s", "tokens", "loss_tokens", "staleness", "reward"],
    "batch_backward": ["start_s", "end_s", "items", "loss_tokens"],
    "group_close": ["group_id", "at_s"],
    "rollout": ["start_s", "end_s"],
    "step": ["start_s", "end_s"],
    "weight_sync": ["start_s", "end_s"],
    "round_end": ["at_s", "learners"],
    "learner_work": ["backwards", "microbatches", "positions", "trajectory_tokens", "padded_tokens", "busy_cpu_s"],
    "teacher": ["busy_s", "busy_cpu_s", "turns", "positions"],
    "sampled": ["tasks", "tokens", "turns"],
    "trajectory": ["id", "group_id", "sample_index", "finished_at_s", "tokens", "loss_tokens", "turns", "exit",
                   "staleness", "reward"],
}


def rows(run_dir, name):
    p = Path(run_dir) / name
    return [json.loads(line) for line in p.read_text().splitlines()] if p.is_file() else []


def weights(run_dir, k):
    return load_file(str(Path(run_dir) / "checkpoints" / f"round-{k}" / "model.safetensors"))


def max_rel(a, b):
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-300)) for k in a)


def rollout_tokens(run_dir):
    return [(r["round"], r["group_id"], r["sample_index"], r["input_ids"]) for r in rows(run_dir, "rollouts.jsonl")]


def check_run_dir(run_dir, cfg):
    run_dir = Path(run_dir)
    metrics, events = rows(run_dir, "metrics.jsonl"), rows(run_dir, "events.jsonl")
    assert [m["round"] for m in metrics] == list(range(1, cfg.rounds + 1))
    for m in metrics:
        assert set(METRIC_KEYS) <= m.keys(), set(METRIC_KEYS) - m.keys()
        assert m["schedule"] == cfg.schedule and m["trajectories"] == 8
        assert m["step_time_s"] > 0 and 0 <= m["learner_busy_s"] and m["learner_idle_frac"] <= 1
    kinds = {e["event"] for e in events}
    assert {"item", "group_close", "step", "weight_sync", "round_end"} <= kinds
    for e in events:
        assert set(EVENT_KEYS[e["event"]]) <= e.keys() and "round" in e
    # the resolved config reloads to the same config; DONE (a JSON summary) was written last
    from tsrl_cli.config import load_config

    assert load_config(run_dir / "config.yaml") == cfg
    assert json.loads((run_dir / "DONE").read_text())["rounds"] == cfg.rounds
    done = (run_dir / "DONE").stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= done for p in run_dir.rglob("*") if p.is_file())
    ck = run_dir / "checkpoints" / f"round-{cfg.rounds}"
    assert {"config.json", "model.safetensors", "optimizer.pt", "state.json", "tokenizer.json"} <= {
        p.name for p in ck.iterdir()}
    return metrics, events


# injected tool latency (seeded, lognormal) spreads the trajectories' finish times; tokens do not change
SPREAD = {"rollout.tool_latency_median_s": 0.05, "rollout.tool_latency_sigma": 1.0}


def early_backwards(events, unit, when):
    """Items whose backward (its `when` time) came before the last arrival of their unit in the same round:
    the overlap streaming exists for. unit(item) -> the unit's key (a GRPO group, an OPD trajectory)."""
    items = [e for e in events if e["event"] == "item"]
    last: dict = {}
    for e in items:
        k = (e["round"], unit(e))
        last[k] = max(last.get(k, float("-inf")), e["finished_at_s"])
    return [e for e in items if e[when] < last[(e["round"], unit(e))]]


def test_grpo_sync_equals_stream_float64(toy_config):
    runs = {}
    for s in ("sync", "stream"):
        cfg = toy_config(out=s, schedule=s, rounds=3, **{"model.dtype": "float64", "run.save_rollouts": True,
                                                         "run.save_every": 1, **SPREAD})
        train(cfg)
        runs[s] = cfg
    a, b = (str(runs[s].run_dir()) for s in ("sync", "stream"))
    ta, tb = rollout_tokens(a), rollout_tokens(b)
    assert len(ta) == 24 and ta == tb  # identical token ids, every round
    from tsrl_cli.rollouts import parse_rollout

    for r in rows(a, "rollouts.jsonl"):  # the rollout schema plus round and policy_version
        assert r.pop("policy_version") == r.pop("round") - 1
        parse_rollout(r, "rollouts.jsonl")
    assert max_rel(weights(a, 3), weights(b, 3)) < 1e-9
    assert max_rel(weights(a, 3), weights(a, 0)) > 1e-3  # and the weights really moved
    for s, d in ((s, str(runs[s].run_dir())) for s in runs):
        metrics, events = check_run_dir(d, runs[s])
        items = [e for e in events if e["event"] == "item"]
        assert len(items) == 24 and all(e["staleness"] == 0 for e in items)
        assert all(m["staleness_max"] == 0 for m in metrics)
        early = early_backwards(events, lambda e: e["group_id"], "backward_start_s")
        if s == "stream":  # per-arrival backwards, each after its arrival
            assert all(e["learner_cost_s"] > 0 and e["backward_start_s"] >= e["finished_at_s"] for e in items)
            assert all(m["accumulator_peak_bytes"] > 0 and m["loss"] is None for m in metrics)
            # the overlap itself: some trajectory's backward started before its group's last member arrived
            assert early, "no backward started before its group closed"
        else:
            assert not early  # the lazy baseline waits: nothing starts before the group's last arrival
            assert all(e["learner_cost_s"] is None for e in items)
            assert sum(e["event"] == "batch_backward" for e in events) == 3
            assert all(m["loss"] is not None for m in metrics)


def test_grpo_kl_seq_mean_sync_equals_stream_float64(toy_config):
    """A KL term to the initial policy (scored on the learner) and per-sequence weights."""
    runs = {}
    for s in ("sync", "stream"):
        cfg = toy_config(out=s, schedule=s, rounds=2, **{"model.dtype": "float64", "loss.kl_coef": 0.1,
                                                         "loss.loss_agg": "seq-mean-token-mean",
                                                         "loss.adv_norm": "center", "loss.max_open_groups": 1})
        train(cfg)
        runs[s] = str(cfg.run_dir())
    assert max_rel(weights(runs["sync"], 2), weights(runs["stream"], 2)) < 1e-9


def test_rollouts_are_a_pure_function_of_weights_seed_round_task_sample(toy_config, tmp_path):
    """Replay round-3 trajectories in this process from the round-2 checkpoint: same tokens.
    From the initial weights they differ: the rollout process really trains on new weights."""
    from tsrl_cli.rl.rollout_worker import RolloutWorker
    from tsrl_cli.rl.types import GroupSpec

    cfg = toy_config(out="pure", schedule="stream", rounds=3,
                     **{"model.dtype": "float64", "run.save_rollouts": True, "run.save_every": 1})
    train(cfg)
    recorded = {(r["group_id"], r["sample_index"]): r["input_ids"]
                for r in rows(cfg.run_dir(), "rollouts.jsonl") if r["round"] == 3}

    def replay(model_dir):
        w = RolloutWorker(cfg, str(model_dir), str(model_dir), 2, queue.Queue(), queue.Queue(), queue.Queue(), None)
        try:
            out = {}
            for gid, i in recorded:
                msg = asyncio.run(w.run_one(3, 2, GroupSpec(gid, gid, 4), i))
                out[(gid, i)] = msg.rollout.input_ids
            return out
        finally:
            w.pool.close()

    assert replay(Path(cfg.run_dir()) / "checkpoints" / "round-2") == recorded
    from tsrl_cli.rl.toy import ensure_toy_policy

    assert replay(ensure_toy_policy("builtin:toy")) != recorded


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_opd_sync_equals_stream_float64(toy_config, loss_agg):
    """seq-mean-token-mean: a trajectory's 1/n waits for its last turn (TrajectoryDone). Per-turn backwards
    (learner.opd_unit turn), whose overlap with the rollout is checked below; tests/rl/test_opd_unit.py runs
    the trajectory unit."""
    runs = {}
    for s in ("sync", "stream"):
        cfg = toy_config(out=s, objective="opd", schedule=s, rounds=2,
                         **{"model.dtype": "float64", "run.save_rollouts": True, "loss.loss_agg": loss_agg, **SPREAD,
                            "learner.opd_unit": "turn"})
        train(cfg)
        runs[s] = str(cfg.run_dir())
    assert rollout_tokens(runs["sync"]) == rollout_tokens(runs["stream"])
    assert max_rel(weights(runs["sync"], 2), weights(runs["stream"], 2)) < 1e-9
    items = [e for e in rows(runs["stream"], "events.jsonl") if e["event"] == "item"]
    assert items and all(e["turn"] is not None and e["reward"] is None for e in items)
    # each turn's way to the learner: closed in the rollout, scored by the teacher, then its backward
    assert all(e["closed_at_s"] <= e["teacher_start_s"] <= e["finished_at_s"] <= e["backward_start_s"]
               and e["prefix_tokens"] >= e["tokens"] for e in items)
    for s in ("sync", "stream"):
        ev = rows(runs[s], "events.jsonl")
        work = [e for e in ev if e["event"] == "learner_work"]
        teacher = [e for e in ev if e["event"] == "teacher"]
        assert len(work) == len(teacher) == 2
        # the teacher's forwards cover each trajectory's tokens once (its key/value cache), at most sum T_i
        assert all(t["positions"] <= w["trajectory_tokens"] for t, w in zip(teacher, work, strict=True))
    m = rows(runs["stream"], "metrics.jsonl")
    assert all(r["opd_reverse_kl"] is not None and r["peak_mem_teacher_bytes"] for r in m)
    # the overlap itself: some turn's backward ended before its trajectory's last turn was scored

    def traj(e):
        return e["group_id"], e["sample_index"]

    assert early_backwards(rows(runs["stream"], "events.jsonl"), traj, "backward_end_s")
    assert not early_backwards(rows(runs["sync"], "events.jsonl"), traj, "backward_end_s")


def test_async_staleness(toy_config):
    cfg = toy_config(out="async", schedule="async", rounds=3, **{"offpolicy.tis_cap": 2.0})
    summary = train(cfg)
    metrics = rows(cfg.run_dir(), "metrics.jsonl")
    assert metrics[0]["staleness_max"] == 0  # round 1: generated by the initial weights, trained at version 0
    assert all(m["staleness_mean"] >= 1 and m["exact"] is False for m in metrics[1:])
    items = [e for e in rows(cfg.run_dir(), "events.jsonl") if e["event"] == "item" and e["round"] > 1]
    assert items and all(e["staleness"] == 1 for e in items)
    assert summary["exact"] is False and summary["staleness_max"] == 1


def test_resume_fp32_equals_uninterrupted(toy_config):
    sets = {"schedule": "sync", "rounds": 3, "run.save_every": 1, "rollout.batch_invariant": True}
    full = toy_config(out="full", **sets)
    train(full)
    crashed = toy_config(out="crashed", **sets)
    train(crashed)
    d = Path(crashed.run_dir())  # a crash during round 3: its checkpoint and DONE never written
    shutil.rmtree(d / "checkpoints" / "round-3")
    (d / "DONE").unlink()
    summary = train(crashed, resume=True)
    assert summary["rounds"] == 3
    assert [m["round"] for m in rows(d, "metrics.jsonl")] == [1, 2, 3]
    a, b = weights(full.run_dir(), 3), weights(d, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a = torch.load(Path(full.run_dir()) / "checkpoints/round-3/optimizer.pt", weights_only=True)
    opt_b = torch.load(d / "checkpoints/round-3/optimizer.pt", weights_only=True)
    assert all(torch.equal(opt_a["state"][i]["exp_avg"], opt_b["state"][i]["exp_avg"]) for i in opt_a["state"])


def test_cli_json_and_resume_errors(toy_policies, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    args = ["train", "experiments/smoke/tiny_cpu.yaml", "--rounds", "2", "--out", str(out), "--schedule", "sync"]
    res = runner.invoke(app_(), [*args, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["rounds"] == 2 and doc["schedule"] == "sync" and doc["run_dir"] == str(out)
    res = runner.invoke(app_(), args)  # the same directory again, without --resume
    assert res.exit_code == 2 and "--resume" in res.stderr
    res = runner.invoke(app_(), [*args, "--resume"])  # complete: nothing to resume
    assert res.exit_code == 2 and "complete" in res.stderr
    res = runner.invoke(app_(), [*args, "--resume", "--lr", "0.5"])
    assert res.exit_code == 2 and "optim.lr" in res.stderr


def test_scope_error_before_any_process(toy_config):
    from tsrl_cli.errors import UsageError

    with pytest.raises(UsageError, match="norm-constant"):
        train(toy_config(**{"loss.loss_agg": "seq-mean-token-sum-norm"}))


def test_bench_speedup_json(toy_policies, tmp_path):
    res = CliRunner().invoke(app_(), ["bench", "speedup", "experiments/smoke/tiny_cpu.yaml", "--rounds", "2",
                                      "--schedules", "sync,stream", "--out", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc["schedules"]) == {"sync", "stream"}
    st = doc["schedules"]["stream"]
    assert doc["schedules"]["sync"]["speedup_vs_sync"] == 1.0 and st["speedup_vs_sync"] > 0
    assert st["rounds_measured"] == 1 and st["accumulator_peak_bytes"] > 0 and "memory_overhead_bytes" in st


def test_bench_speedup_measures_stream_per_group(toy_policies, tmp_path):
    """stream-group: stream with learner.granularity group, measured beside stream; both granularities predicted."""
    res = CliRunner().invoke(app_(), ["bench", "speedup", "experiments/smoke/tiny_cpu.yaml", "--rounds", "2",
                                      "--schedules", "sync,stream,stream-group", "--out", str(tmp_path / "b"),
                                      "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc["schedules"]) == {"sync", "stream", "stream-group"}
    cfg = (tmp_path / "b" / "stream-group" / "rep0" / "config.yaml").read_text()
    assert "granularity: group" in cfg and "schedule: stream" in cfg
    pred = doc["schedules"]["stream"]["predicted"]
    assert pred["stream_group_s"] >= pred["stream_s"] > 0  # waiting for a group never drains sooner


def app_():
    from tsrl_cli.cli import app

    return app


@pytest.mark.sandboxed
def test_prepared_dataset_in_real_sandboxes(toy_config, tmp_path, prepare_fixture):
    """The same engine on a prepared dataset: one sandbox per trajectory and the task's own verifier."""
    prepare_fixture("terminal-bench", "tests/fixtures/terminal_bench", tmp_path / "tb")
    cfg = toy_config(f"data.train=[{tmp_path / 'tb'}]", "rollout.prompts_per_round=1", "rollout.group_size=2",
                     "rollout.max_turns=2", out="sandbox", rounds=1)
    train(cfg)
    m = rows(cfg.run_dir(), "metrics.jsonl")
    assert len(m) == 1 and m[0]["trajectories"] == 2
    assert not any(k.startswith("env_error") for k in m[0]["exit_reasons"])


@pytest.mark.sandboxed
def test_eval_every_writes_held_out_metrics(toy_config, tmp_path, prepare_fixture, monkeypatch):
    """eval.every K: the initial and every K-th round's weights are evaluated on a held-out set; the
    numbers join that round's metrics row (and equal a direct evaluation of the same checkpoint, here
    sampled at eval.temperature 1 with eval seed 0, which repeats exactly)."""
    import tsrl_cli.rl.train as train_mod  # where the trainer finds evaluate_embedded
    from tsrl_cli.evals.embedded import evaluate_embedded
    from tsrl_cli.policy import load_policy

    seen = []  # the sampling settings each checkpoint's evaluation ran with

    def spy(*args, **kw):
        seen.append((kw.get("samples"), kw.get("temperature")))
        return evaluate_embedded(*args, **kw)

    monkeypatch.setattr(train_mod, "evaluate_embedded", spy)
    prepare_fixture("terminal-bench", "tests/fixtures/terminal_bench", tmp_path / "tb")
    held = str(tmp_path / "tb")
    cfg = toy_config("eval.every=2", f"eval.datasets=[{held}]", "eval.temperature=1.0", "eval.samples=2",
                     "rollout.max_turns=2", out="ev", rounds=2)
    train(cfg)
    m = rows(cfg.run_dir(), "metrics.jsonl")
    assert len(m) == 2 and not any(k.startswith("eval/") for k in m[0])
    keys = {f"eval/tb/{s}" for s in ("success", "n", "ci95_low", "ci95_high")}  # the dataset's folder name
    assert keys <= set(m[1]) and m[1]["eval/tb/n"] >= 1
    assert (cfg.run_dir() / "eval_round0.json").is_file() and (cfg.run_dir() / "DONE").is_file()
    assert seen == [(2, 1.0), (2, 1.0)]  # round-0 and round-2
    model, tok = load_policy(cfg.run_dir() / "checkpoints" / "round-2")
    direct = evaluate_embedded(model, tok, [held], samples=2, temperature=1.0)
    assert {k: m[1][k] for k in keys} == direct["metrics"]  # seeded: the same checkpoint gives the same numbers


def test_sync_per_item_equals_padded_and_stream_float64(toy_config):
    """sync_batching=per_item (stream's per-item backwards after the last arrival) computes the same
    gradient as the padded lazy batch and as stream: only the timing differs."""
    runs = {}
    for name, sched, mode in (("padded", "sync", "padded"), ("per_item", "sync", "per_item"),
                              ("stream", "stream", "padded")):
        cfg = toy_config(f"sync_batching={mode}", out=name, schedule=sched, rounds=2, **{"model.dtype": "float64"})
        train(cfg)
        runs[name] = str(cfg.run_dir())
    assert max_rel(weights(runs["padded"], 2), weights(runs["per_item"], 2)) < 1e-9
    assert max_rel(weights(runs["stream"], 2), weights(runs["per_item"], 2)) < 1e-9
    batches = [e for e in rows(runs["per_item"], "events.jsonl") if e["event"] == "batch_backward"]
    assert len(batches) == 2 and all(b["padded"] is False for b in batches)
    assert all(b["padded"] is True for b in rows(runs["padded"], "events.jsonl") if b["event"] == "batch_backward")


def test_unsubmitted_reward_replaces_only_unsubmitted_scores(toy_config):
    """rollout.unsubmitted_reward: the same trajectories (tokens), the verifier's reward where the agent
    submitted, the configured number everywhere else."""
    from tsrl_cli.rl.rollout_worker import RolloutWorker
    from tsrl_cli.rl.toy import ensure_toy_policy
    from tsrl_cli.rl.types import GroupSpec

    model_dir = str(ensure_toy_policy("builtin:toy"))

    def sample(*sets):
        cfg = toy_config(*sets, "rollout.max_turns=2", out="u")
        w = RolloutWorker(cfg, model_dir, model_dir, 0, queue.Queue(), queue.Queue(), queue.Queue(), None)
        try:
            return {(k, i): asyncio.run(w.run_one(1, 0, GroupSpec(k, k, 8), i)) for k in list(w.tasks)[:4]
                    for i in range(8)}
        finally:
            w.pool.close()

    base, alt = sample(), sample("rollout.unsubmitted_reward=-1.5")
    reasons = {m.exit_reason for m in base.values()}
    assert "submitted" in reasons and reasons - {"submitted"}, reasons  # both kinds occur, or the test proves nothing
    for key, m in base.items():
        a = alt[key]
        assert a.rollout.input_ids == m.rollout.input_ids and a.exit_reason == m.exit_reason
        assert a.rollout.reward == (m.rollout.reward if m.exit_reason == "submitted" else -1.5)


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc), so that the test sees forkserver children too."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the worker processes")
def test_sigterm_stops_the_worker_processes(toy_policies, tmp_path):
    """A killed `tsrl train` takes its rollout and learner processes with it (they used to keep running)."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "tsrl_cli", "train", "experiments/smoke/tiny_cpu.yaml",
                          "--rounds", "500", "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not rows(out, "metrics.jsonl") and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.5)
        assert rows(out, "metrics.jsonl"), "the run never finished a round"
        workers = _descendants(p.pid)
        assert len(workers) >= 2  # rollout and learner (and the forkserver)
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while (workers & _descendants(1) - _zombies()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not (workers & (_descendants(1) - _zombies())), "worker processes outlived the killed run"
        assert not (out / "DONE").exists()
    finally:
        if p.poll() is None:
            p.kill()
        for pid in locals().get("workers", set()) & _descendants(1):  # a failed run leaves nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _zombies() -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                out.add(int(stat.parent.name))
        except OSError:
            pass
    return out


def _no_sleep_image() -> str:
    """A local image whose containers cannot start: it holds one file and no `sleep` binary, so the
    sandbox's idle `sleep infinity` fails at container start (the image itself is present)."""
    import io
    import tarfile

    import docker

    tag = "tsrl-test-no-sleep:1"
    client = docker.from_env()
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("README")
            body = b"an image with no programs in it\n"
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        client.api.import_image_from_data(buf.getvalue(), repository="tsrl-test-no-sleep", tag="1")
    finally:
        client.close()
    return tag


def _hello_world_with_image(tmp_path, prepare_fixture, image: str):
    """The Terminal-Bench hello-world fixture, prepared, its task's docker_image set to `image`."""
    import shutil

    src = tmp_path / "src" / "hello-world"
    shutil.copytree("tests/fixtures/terminal_bench/hello-world", src)
    toml = src / "task.toml"
    text = toml.read_text()
    assert 'docker_image = "ghcr.io/laude-institute/t-bench/hello-world:2.0"' in text
    toml.write_text(text.replace("ghcr.io/laude-institute/t-bench/hello-world:2.0", image))
    return prepare_fixture("terminal-bench", tmp_path / "src", tmp_path / "tb")


def _docker_train_args(ds) -> list[str]:
    return ["train", "--set", "model.policy=builtin:toy", "--set", f"data.train=[{ds}]",
            "--set", "rollout.prompts_per_round=1", "--set", "rollout.group_size=2", "--set", "rollout.max_turns=2",
            "--set", "rollout.executor=docker", "--rounds", "1"]


def test_environment_that_does_not_start_stops_the_run(toy_config, tmp_path, prepare_fixture, docker_base_image):
    """A broken environment is never a reward: a task whose image is present but whose container cannot
    start (no `sleep` in it) fails its environment start; past rollout.max_env_error_frac (0.1) of the round the
    run exits 1 with one line naming the round, the task and the cause, and the learner never steps on it. With
    rollout.max_env_error_frac=1 the same run trains, counts them per round and masks them. Images that can be
    built start (tests/rl/test_train_docker.py)."""
    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    base = _docker_train_args(_hello_world_with_image(tmp_path, prepare_fixture, _no_sleep_image()))
    res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "loud")])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 1, res.output[-2000:]
    assert "failed for their infrastructure (first: task " in lines[-2], lines[-3:]
    assert lines[-2].startswith("error: the rollout process failed: round 1: "), lines[-3:]
    assert "rollout.max_env_error_frac is 0.1" in lines[-2]
    assert not (tmp_path / "loud" / "metrics.jsonl").is_file() or not rows(tmp_path / "loud", "metrics.jsonl")
    res = CliRunner().invoke(app, [*base, "--set", "rollout.max_env_error_frac=1", "--out", str(tmp_path / "counted"),
                                   "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    m = rows(tmp_path / "counted", "metrics.jsonl")
    assert m[0]["env_errors"] == 2 and m[0]["exit_reasons"] == {"env_error": 2} and m[0]["masked_trajectories"] == 2


def test_missing_task_image_is_named_before_round_1(toy_config, tmp_path, prepare_fixture, docker_base_image):
    """A prebuilt task image that is not on the daemon stops `tsrl train` before any process starts: exit 2,
    one line naming the image, its task and the `tsrl env pull` that fetches it (no session pulls it inside
    an environment start). Control: the same dataset with a present image gets past this check (the test
    above, whose run reaches round 1)."""
    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    ds = _hello_world_with_image(tmp_path, prepare_fixture, "tsrl-test-absent-image:never")
    res = CliRunner().invoke(app, [*_docker_train_args(ds), "--out", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "image tsrl-test-absent-image:never (task tb/hello-world) is not on this Docker daemon" in line, line
    assert f"tsrl env pull {ds}" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_held_out_evaluation_runs_on_the_rollout_device(toy_config, monkeypatch):
    """After the rounds, eval.every's checkpoints are served where this node's engines ran (a GPU on a
    GPU node, not the CPU); with remote servers, on the first GPU; cpu where there is none."""
    import torch

    from tsrl_cli.rl.train import eval_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # what devices.cuda_count asks
    assert eval_device(toy_config()) == "cpu"
    assert eval_device(toy_config("devices.rollout=2-3")) == "cuda:2"
    remote = ("rollout.engine=openai", "rollout.servers=[http://127.0.0.1:1]")
    assert eval_device(toy_config(*remote)) == "cuda:0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert eval_device(toy_config(*remote)) == "cpu"


def test_bench_balance_auto_runs_the_timed_schedules_at_the_balanced_latency(toy_policies, tmp_path, monkeypatch):
    """--balance auto: the latency `balance` finds (its arithmetic: tests/rl/test_bench_balance.py) is the one the
    timed runs use, and --json carries the calibration."""
    from tsrl_cli.rl import bench

    seen = []

    def balanced(base, out_root, progress=None):
        seen.append(base.rollout.tool_latency_median_s)
        return {"tool_latency_median_s": 0.07, "learner_work_s": 1.0, "generation_s": 0.3,
                "makespan_per_latency_s": 10.0, "calibration": []}

    monkeypatch.setattr(bench, "balance", balanced)
    res = CliRunner().invoke(app_(), ["bench", "speedup", "experiments/smoke/tiny_cpu.yaml", "--rounds", "2",
                                      "--schedules", "sync,stream", "--balance", "auto", "--tool-latency", "0.5",
                                      "--out", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert seen == [0.5] and doc["balance"]["tool_latency_median_s"] == 0.07 == doc["tool_latency_median_s"]
    for s in ("sync", "stream"):
        cfg = yaml.safe_load((tmp_path / "b" / s / "rep0" / "config.yaml").read_text())
        assert cfg["rollout"]["tool_latency_median_s"] == 0.07
    off = CliRunner().invoke(app_(), ["bench", "speedup", "experiments/smoke/tiny_cpu.yaml", "--rounds", "2",
                                      "--schedules", "stream", "--tool-latency", "0.5", "--out", str(tmp_path / "c"),
                                      "--json"])
    assert off.exit_code == 0 and json.loads(off.stdout)["balance"] is None and seen == [0.5]  # the control


def test_a_calibration_run_reports_its_own_medians(toy_policies, tmp_path):
    """bench._calibrate: a short stream run at the given latency, its rounds after the first read back as medians."""
    import statistics

    from tsrl_cli.config import load_config
    from tsrl_cli.rl import bench

    base = load_config("experiments/smoke/tiny_cpu.yaml", ["rollout.tool_latency_median_s=0.5"])
    got = bench._calibrate(base, 0.05, tmp_path / "c", lambda ev: None)
    rows = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == bench.BALANCE_ROUNDS
    assert got["rollout_makespan_s"] == statistics.median(r["rollout_makespan_s"] for r in rows[1:])
    assert got["learner_busy_s"] == statistics.median(r["learner_busy_s"] for r in rows[1:])
    cfg = yaml.safe_load((tmp_path / "c" / "config.yaml").read_text())
    assert cfg["rollout"]["tool_latency_median_s"] == 0.05 and cfg["schedule"] == "stream"
