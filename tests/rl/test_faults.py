"""Faults, with nothing lost: `tsrl train` as a user runs it (a subprocess, the toy workload), killed in
the ways a machine kills it; what was written stays readable and `--resume` ends on the weights of an
uninterrupted run, bit for bit (sync schedule, float32, batch-invariant rollouts: deterministic).
The runs that are not struck (the references, each `--resume`, the sweep run again) run the same
command in this process (conftest.tsrl_here), which spares each a new interpreter and forkserver.

    kill -9 of the main process mid-round            its workers exit too; --resume
    kill -9 of the rollout, learner or teacher        one-line error naming it within seconds, no orphans; --resume
    a full disk while a checkpoint is written        a clear error, the earlier checkpoints intact; --resume
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from worker_procs import alive, held_at, pids

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOY = ["model.policy=builtin:toy", "model.teacher=builtin:toy-teacher", "data.train=[builtin:echo]",
       "rollout.prompts_per_round=2", "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
       "rollout.max_trajectory_tokens=400", "optim.lr=1e-3", "rollout.batch_invariant=true",
       "rollout.tool_latency_median_s=0.2", "rollout.tool_latency_sigma=0.5"]
ROUNDS = 3
# the runs that are struck hold at round 2's start (worker_procs.held_at) until the test has struck
HELD = 2


def train_args(out: Path, objective: str, *extra: str) -> list[str]:
    sets = [a for s in TOY for a in ("--set", s)]
    return ["train", *sets, "--schedule", "sync", "--objective", objective, "--rounds", str(ROUNDS),
            "--save-every", "1", "--out", str(out), "--json", *extra]


def train_cmd(out: Path, objective: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tsrl_cli", *train_args(out, objective, *extra)]


def run(cmd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def start(cmd, marker: Path) -> subprocess.Popen:
    """The run of `cmd`, held at round HELD's start while `marker` exists."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=held_at(HELD, marker))


def wait_for(cond, timeout=120.0, what=""):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def rounds_done(out: Path) -> int:
    p = out / "metrics.jsonl"
    return p.read_text().count("\n") if p.is_file() else 0


def weights(out: Path, k: int = ROUNDS) -> dict:
    return load_file(str(out / "checkpoints" / f"round-{k}" / "model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(toy_policies, tsrl_here, tmp_path_factory):
    """Uninterrupted runs, one per objective: the weights every resumed run must end on."""
    out = {}
    for objective in ("grpo", "opd"):
        d = tmp_path_factory.mktemp("ref") / objective
        res = tsrl_here(*train_args(d, objective))
        assert res.returncode == 0, res.stderr[-3000:]
        # every round has a gradient, so a resumed round that trained on other trajectories would end elsewhere
        assert all(json.loads(x)["grad_norm"] > 1e-3 for x in (d / "metrics.jsonl").read_text().splitlines())
        out[objective] = d
    return out


def check_resumed(d: Path, objective: str, reference, tsrl_here) -> None:
    assert not (d / "DONE").exists()
    res = tsrl_here(*train_args(d, objective, "--resume"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))  # nothing torn, nothing twice
    assert same(weights(d), weights(reference[objective]))


def test_kill_9_of_the_main_process_mid_round(reference, tsrl_here, tmp_path):
    d, held = tmp_path / "run", tmp_path / "held"
    p = start(train_cmd(d, "grpo"), held)
    wait_for(lambda: held.exists() and rounds_done(d) == HELD - 1 and len(pids(d)) == 3, what="round 2 held")
    workers = pids(d)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    wait_for(lambda: not any(alive(q) for q in workers.values()), timeout=15, what="the workers to exit")
    check_resumed(d, "grpo", reference, tsrl_here)


@pytest.mark.parametrize("victim,objective", [("rollout", "grpo"), ("learner", "grpo"), ("teacher", "opd")])
def test_kill_9_of_a_worker(victim, objective, reference, tsrl_here, tmp_path):
    d, held = tmp_path / "run", tmp_path / "held"
    p = start(train_cmd(d, objective), held)
    n = 4 if objective == "opd" else 3
    wait_for(lambda: held.exists() and rounds_done(d) == HELD - 1 and len(pids(d)) == n, what="round 2 held")
    workers = pids(d)
    t0 = time.monotonic()
    os.kill(workers[victim], signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    # held, a run that missed the death would wait forever: the bound checks seconds, not minutes, with the
    # room a loaded machine needs (11.4 s measured at load ~4 on 2 cores, the test under nice 19)
    assert time.monotonic() - t0 < 30 and p.returncode == 1, (p.returncode, err[-2000:])
    first = err.strip().splitlines()[0]
    assert first.startswith("error: the ") and f"the {victim} process was killed by signal 9" in first, err
    assert "--resume" in first and "Traceback" not in err and out == ""
    assert not any(alive(q) for q in workers.values())  # no orphans
    assert not (d / "processes.json").exists()
    check_resumed(d, objective, reference, tsrl_here)


def test_full_disk_while_writing_a_checkpoint(reference, tsrl_here, tmp_path):
    """The run directory on a small tmpfs: round-0 and round-1 fit, round-2 does not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    ckpt = sum(f.stat().st_size for f in (reference["grpo"] / "checkpoints" / "round-1").rglob("*") if f.is_file())
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = int(2.6 * ckpt) + (256 << 10)  # two checkpoints, the run's logs, not a third checkpoint
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        d = mnt / "run"
        res = run(train_cmd(d, "grpo"))
        assert res.returncode == 1, res.stderr[-2000:]
        first = res.stderr.strip().splitlines()[0]
        assert "no space left" in first and "--resume" in first and "Traceback" not in res.stderr, res.stderr
        failed = int(first.split("checkpoint round-")[1].split()[0])
        entries = sorted(p.name for p in (d / "checkpoints").iterdir())
        assert entries == [f"round-{k}" for k in range(failed)], entries  # complete ones only, no temporary left
        assert all((d / "checkpoints" / e / "state.json").is_file() for e in entries)
        assert failed >= 2 and same(weights(d, failed - 1), weights(reference["grpo"], failed - 1))  # intact
        moved = tmp_path / "moved"
        shutil.copytree(d, moved)  # a disk with room
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    check_resumed(moved, "grpo", reference, tsrl_here)


def test_sigterm_in_a_sweep_then_the_next_sweep_continues(toy_policies, tsrl_here, tmp_path):
    """SIGTERM while the first of two runs trains: the sweep stops (its workers too); the same sweep again
    finishes what was left, and every run ends on the weights of an uninterrupted sweep."""
    exp = tmp_path / "toy.yaml"
    import yaml

    doc = {"name": "toyfault", "schedule": "sync", "run": {"save_every": 1}}
    for s in TOY:
        key, value = s.split("=", 1)
        node = doc
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    exp.write_text(yaml.safe_dump(doc))

    def sweep(out):
        return ["sweep", str(exp), "--schedules", "sync", "--seeds", "1,2", "--rounds", str(ROUNDS), "--warmup", "1",
                "--out", str(out), "--json"]

    ref = tsrl_here(*sweep(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "out"
    first, held = out / "toyfault" / "sync" / "seed1", tmp_path / "held"
    p = start([sys.executable, "-m", "tsrl_cli", *sweep(out)], held)
    wait_for(lambda: held.exists() and rounds_done(first) == HELD - 1 and len(pids(first)) == 3,
             what="round 2 of the first run held")
    workers = pids(first)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode != 0 and not any(alive(q) for q in workers.values())
    again = tsrl_here(*sweep(out))
    assert again.returncode == 0, again.stderr[-2000:]
    for seed in (1, 2):
        d = f"toyfault/sync/seed{seed}"
        assert same(weights(out / d), weights(tmp_path / "ref" / d)), seed
        rows = [json.loads(x)["round"] for x in (out / d / "metrics.jsonl").read_text().splitlines()]
        assert rows == list(range(1, ROUNDS + 1))
