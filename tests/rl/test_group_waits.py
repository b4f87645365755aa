"""Waiting is not a failure: a learner group of 2 CPU ranks whose compute collectives time out after 5 s
(learner.collective_timeout_s=5) outlives two waits longer than that, and ends on the unheld run's weights.

- the rollout held 10 s before the run's first trajectory: rank 0 waits for it at the queue, rank 1 for
  rank 0's broadcast of the arrivals (a control message)
- rank 0's write of round 1's checkpoint held 8 s (TSRL_HOLD_CHECKPOINT_AT_ROUND): rank 1 waits for it on the
  control group, then for round 2's arrivals

Control messages (broadcasts of arrivals, barriers, gathers of reports) travel on a gloo group of their own
with no practical timeout (rl/group.py). This test fails where they share the default group with the
compute collectives: rank 1's broadcast then times out after 5 s in the first hold, and the run stops with
`the learner-1 process failed` (seen once with LearnerGroup.join leaving `control` unset).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tsrl_cli.rl.faults import HOLD_CHECKPOINT_ENV, HOLD_ENV

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SETS = ["model.policy=builtin:toy", "data.train=[builtin:echo]", "rollout.prompts_per_round=2",
        "rollout.group_size=4", "rollout.max_turns=3", "rollout.max_turn_tokens=32",
        "rollout.max_trajectory_tokens=400", "optim.lr=1e-3", "model.dtype=float64",
        "rollout.tool_latency_median_s=0.2", "rollout.tool_latency_sigma=0.5"]
ROUNDS = 2
TIMEOUT_S = 5  # the compute collectives' limit in the held run
ROLLOUT_HOLD_S = 10  # before the first trajectory: twice the limit
CHECKPOINT_HOLD_S = 8  # inside rank 0's write of round 1's checkpoint


def args(out: Path, *extra: str) -> list[str]:
    sets = [a for s in SETS for a in ("--set", s)]
    return ["train", *sets, "--learner-devices", "cpu:2", "--rounds", str(ROUNDS), "--save-every", "1",
            "--out", str(out), "--json", *extra]


def weights(d: Path) -> dict:
    return load_file(str(d / "checkpoints" / f"round-{ROUNDS}" / "model.safetensors"))


def max_rel(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-300)) for k in a)


def test_waits_longer_than_the_collective_timeout_do_not_end_the_run(toy_policies, tsrl_here, tmp_path):
    held, marker = tmp_path / "held", tmp_path / "marker"
    env = dict(os.environ, **{HOLD_ENV: f"1:{marker}", HOLD_CHECKPOINT_ENV: f"1:{CHECKPOINT_HOLD_S}"})
    p = subprocess.Popen([sys.executable, "-m", "tsrl_cli",
                          *args(held, "--set", f"learner.collective_timeout_s={TIMEOUT_S}")],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.monotonic()
    while not marker.exists():  # the rollout holds round 1's weights, before its first trajectory
        assert time.monotonic() - t0 < 300 and p.poll() is None, p.communicate()
        time.sleep(0.05)
    time.sleep(ROLLOUT_HOLD_S)
    assert p.poll() is None, p.communicate()  # the learner ranks are still there, waiting
    marker.unlink()
    out, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    assert json.loads(out)["rounds"] == ROUNDS
    rows = [json.loads(x) for x in (held / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["checkpoint_s"] >= CHECKPOINT_HOLD_S > TIMEOUT_S  # the write really was held that long
    assert rows[0]["learner_ranks"] == 2

    unheld = tmp_path / "unheld"
    res = tsrl_here(*args(unheld))
    assert res.returncode == 0, res.stderr[-3000:]
    assert max_rel(weights(unheld), weights(held)) < 1e-9
    assert max_rel(weights(unheld), load_file(str(unheld / "checkpoints" / "round-0" / "model.safetensors"))) > 1e-4
