"""A learner of N CPU ranks (gloo, FSDP2 with the folding all-to-all) against a single-process learner.

- float64: `--schedule stream --learner-devices cpu:2 | cpu:4`, 3 rounds, GRPO and OPD, full and LoRA:
  identical rollouts, final weights within 1e-9 relative of the single-process `sync` run
- every buffer set is sharded: each rank holds 1/N of the single-process bytes (within 1 %)
- kill -9 of one rank mid-round: one error line naming that rank, no orphans; --resume on another
  number of ranks ends on the uninterrupted run's weights (float64, within 1e-9)
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from worker_procs import alive, held_at, pids

from tsrl_cli.config import load_config
from tsrl_cli.rl.train import train

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SETS = ["model.policy=builtin:toy", "model.teacher=builtin:toy-teacher", "data.train=[builtin:echo]",
        "rollout.prompts_per_round=2", "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
        "rollout.max_trajectory_tokens=400", "optim.lr=1e-3", "model.dtype=float64", "run.save_rollouts=true",
        "rollout.tool_latency_median_s=0.2", "rollout.tool_latency_sigma=0.5"]
ROUNDS = 3
LORA = ["lora.rank=8"]


def config(out, schedule, objective, lora, learners="cpu", *extra):
    return load_config(sets=[*SETS, *(LORA if lora else []), f"devices.learner={learners}", f"run.out={out}",
                             "run.save_every=1", *extra],
                       flags={"schedule": schedule, "objective": objective, "rounds": ROUNDS})


def rows(d, name):
    return [json.loads(x) for x in (Path(d) / name).read_text().splitlines()]


def weights(d, k=ROUNDS):
    return load_file(str(Path(d) / "checkpoints" / f"round-{k}" / "model.safetensors"))


def max_rel(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-300)) for k in a)


def tokens(d):
    return [(r["round"], r["group_id"], r["sample_index"], r["input_ids"]) for r in rows(d, "rollouts.jsonl")]


@pytest.fixture(scope="module")
def reference(toy_policies, tmp_path_factory):
    """Single-process sync runs: what every learner group must end on."""
    out = {}
    for objective in ("grpo", "opd"):
        for lora in (False, True):
            d = tmp_path_factory.mktemp("ref") / f"{objective}-{lora}"
            train(config(d, "sync", objective, lora))
            # every round has a gradient: a later round's comparison is not one of zeros (toy_workload.py)
            assert all(r["grad_norm"] > 1e-3 for r in rows(d, "metrics.jsonl"))
            out[objective, lora] = d
    return out


@pytest.mark.parametrize("learners", ["cpu:2", "cpu:4"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_stream_on_n_ranks_equals_single_process_sync(reference, tmp_path, objective, lora, learners):
    n = int(learners.split(":")[1])
    d = tmp_path / "run"
    summary = train(config(d, "stream", objective, lora, learners))
    ref = reference[objective, lora]
    assert tokens(d) == tokens(ref) and len(tokens(d)) == 24  # identical token ids, every round
    assert max_rel(weights(ref), weights(d)) < 1e-9
    assert max_rel(weights(ref), weights(ref, 0)) > 1e-4  # the weights really moved
    m = rows(d, "metrics.jsonl")
    assert all(r["learner_ranks"] == n and len(r["accumulator_set_rank_bytes"]) == n for r in m)
    assert summary["staleness_max"] == 0 and all(r["exact"] for r in m)
    # each rank holds 1/N of every buffer set, measured from its accumulator
    single = rows(ref, "metrics.jsonl")[0]["accumulator_set_rank_bytes"][0]
    for r in m:
        assert all(abs(b * n / single - 1) <= 0.01 for b in r["accumulator_set_rank_bytes"]), r
        assert len(r["peak_mem_learner_rank_bytes"]) == n and all(r["peak_mem_learner_rank_bytes"])
    state = json.loads((d / "checkpoints" / f"round-{ROUNDS}" / "state.json").read_text())
    assert state["learner_ranks"] == n
    if lora:  # gathered on save: the merged model beside a PEFT adapter
        assert (d / "checkpoints" / f"round-{ROUNDS}" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_lazy_schedules_on_ranks(reference, tmp_path, schedule):
    """sync and async backward the whole round after the last arrival, split over the ranks."""
    d = tmp_path / "run"
    train(config(d, schedule, "grpo", False, "cpu:2", "loss.kl_coef=0.05", "learner.max_microbatch_tokens=600"))
    one = tmp_path / "one"
    train(config(one, schedule, "grpo", False, "cpu", "loss.kl_coef=0.05"))
    assert max_rel(weights(one), weights(d)) < 1e-9
    assert any(r["microbatches"] > 2 for r in rows(d, "metrics.jsonl"))  # the cap split the lazy batch


def cli(out, learners, *extra):
    sets = [a for s in SETS for a in ("--set", s)]
    return [sys.executable, "-m", "tsrl_cli", "train", *sets, "--learner-devices", learners, "--rounds", str(ROUNDS),
            "--save-every", "1", "--out", str(out), "--json", *extra]


def test_kill_one_rank_then_resume_on_another_n(reference, tsrl_here, tmp_path):
    """The struck run is a subprocess; each resume runs the same command in this process (conftest.tsrl_here)."""
    d, held = tmp_path / "run", tmp_path / "held"
    p = subprocess.Popen(cli(d, "cpu:2"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=held_at(2, held))  # the rollout holds at round 2's start until the kill
    t0 = time.monotonic()
    while not (held.exists() and (d / "metrics.jsonl").is_file() and len(pids(d)) == 4):  # round 1 done, 2 held
        assert time.monotonic() - t0 < 120 and p.poll() is None, p.communicate()
        time.sleep(0.05)
    workers = pids(d)
    t0 = time.monotonic()
    os.kill(workers["learner-1"], signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and time.monotonic() - t0 < 30, (p.returncode, err[-2000:])  # seconds, loaded or not
    first = err.strip().splitlines()[0]
    assert "the learner-1 process was killed by signal 9" in first and "--resume" in first, err
    assert len(err.strip().splitlines()) == 1 and out == ""
    assert not any(alive(q) for q in workers.values())  # no orphans
    for learners in ("cpu:4", "cpu"):  # resume on more ranks, and on one process
        again = tmp_path / learners.replace(":", "")
        subprocess.run(["cp", "-r", str(d), str(again)], check=True)
        res = tsrl_here(*cli(again, learners, "--resume")[3:])
        assert res.returncode == 0, res.stderr[-2000:]
        assert [r["round"] for r in rows(again, "metrics.jsonl")] == list(range(1, ROUNDS + 1))
        assert max_rel(weights(reference["grpo", False]), weights(again)) < 1e-9


def test_under_torchrun_each_process_is_a_rank(reference, tmp_path):
    """torchrun --nproc-per-node 2 (env:// rendezvous): rank 0 runs the run, rank 1 is a learner rank."""
    d = tmp_path / "run"
    port = str(29400 + os.getpid() % 500)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           *cli(d, "cpu:2")[1:]]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["rounds"] == ROUNDS  # one summary: rank 0's
    assert tokens(d) == tokens(reference["grpo", False])
    assert max_rel(weights(reference["grpo", False]), weights(d)) < 1e-9
    assert rows(d, "metrics.jsonl")[-1]["learner_ranks"] == 2


def test_torchrun_needs_one_learner_device_per_process(monkeypatch, toy_policies):
    from tsrl_cli.errors import UsageError
    from tsrl_cli.rl.train import check_torchrun

    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UsageError, match="one learner device per process"):
        check_torchrun(config("x", "stream", "grpo", False, "cpu:4"))
    check_torchrun(config("x", "stream", "grpo", False, "cpu:2"))


def test_verify_on_a_learner_group():
    """`tsrl verify --learner-devices cpu:2`: the same arrivals streamed on 2 ranks, against the lazy gradient."""
    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    res = CliRunner().invoke(app, ["verify", "--objective", "opd", "--learner-devices", "cpu:2", "--queued", "3",
                                   "--groups", "2", "--group-size", "4", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["max_rel_diff"] <= 1e-10 and doc["max_abs_grad"] > 1e-4 and doc["learner_ranks"] == 2
    assert [2 * b for b in doc["buffer_bytes_per_set_rank"]] == [doc["buffer_bytes_per_set"]] * 2
