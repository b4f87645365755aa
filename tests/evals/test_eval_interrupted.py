"""SIGINT in `tsrl eval`: the records written so far stay whole, and the same command again runs only
what is missing and ends with the records of an uninterrupted evaluation. The interrupted eval is a
subprocess; the uninterrupted one and the run again are the same command in this process
(conftest.tsrl_here)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _records(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k not in ("duration_s", "tool_s")} for r in rows),
                  key=lambda r: (r["dataset"], r["instance_id"], r["sample"]))


def test_sigint_then_the_eval_continues(suite, ckpt, tsrl_here, tmp_path):
    sets = f"{suite / 'embedded_repair_heldout'},{suite / 'embedded_terminal_heldout'}"

    def cmd(out):  # one session at a time: each trajectory is then its own engine batch, deterministic
        return ["eval", "embedded", "--model", str(ckpt), "--datasets", sets, "--concurrency", "1", "--samples", "2",
                "--out", str(out), "--json"]

    ref = tsrl_here(*cmd(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    out, ready = tmp_path / "out", tmp_path / "held"
    # held before its third trajectory (held_eval.py): the SIGINT lands mid-run, whatever the machine's load
    held = [sys.executable, str(Path(__file__).with_name("held_eval.py")), str(ready), "2", "--", *cmd(out)]
    p = subprocess.Popen(held, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not ready.exists():
        assert time.monotonic() - t0 < 300 and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    partial = _records(out)  # every line whole
    assert len(partial) == 2 < len(_records(tmp_path / "ref"))
    again = tsrl_here(*cmd(out))
    assert again.returncode == 0, again.stderr[-2000:]
    assert _records(out) == _records(tmp_path / "ref")
    ref_summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert json.loads((out / "summary.json").read_text())["all"] == ref_summary["all"]
