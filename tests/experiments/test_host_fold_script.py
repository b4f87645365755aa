"""experiments/host_fold.py on the CPU: its figures are its own timings' arithmetic (the fold it times,
ParallelAxpy, is checked bit for bit in tests/rl/test_hostfold.py).

The reference for the rates is the byte count of one fold (buffer read and written in float32, the
gradient read in its own dtype) over the seconds the script reports; the node projection is that
rate applied to the node's shard, recomputed here.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("grad_dtype,bytes_per", [("float32", 12), ("bfloat16", 10)])
def test_rates_and_the_projection_are_the_timings_arithmetic(grad_dtype, bytes_per):
    n = 3 * (1 << 20) + 5
    res = subprocess.run([sys.executable, "experiments/host_fold.py", "--elements", str(n), "--threads", "1,2",
                          "--grad-dtype", grad_dtype, "--repeats", "2", "--params", "1e9", "--ranks", "4",
                          "--folds", "10", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["bytes_per_element"] == bytes_per and out["torch_threads"] == 1
    assert [r["threads"] for r in out["rows"]] == [1, 2]
    for r in out["rows"]:
        assert r["seconds"] > 0 and r["gb_per_s"] == pytest.approx(n * bytes_per / r["seconds"] / 1e9)
    best = max(r["gb_per_s"] for r in out["rows"])
    node = out["node"]
    assert node["elements_per_rank"] == 2.5e8
    assert node["fold_s"] == pytest.approx(2.5e8 * bytes_per / best / 1e9)
    assert node["fold_s_per_round"] == pytest.approx(10 * node["fold_s"])
