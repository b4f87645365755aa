"""Rewards from real tests: pytest logs for repair tasks, reward files for terminal tasks.

Repair tasks (SWE-smith / SWE-bench semantics): after submission the task's tests run; the
instance is resolved when every FAIL_TO_PASS test and every PASS_TO_PASS test passes.
  binary:     1.0 when resolved, else 0.0 (SWE-bench's "resolved")
  pass_ratio: passing tests among FAIL_TO_PASS + PASS_TO_PASS
Terminal tasks (Harbor): tests/test.sh writes /logs/verifier/reward.txt (a number) or
reward.json ({"reward": x}).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tsrl_cli.agent.loop import RewardResult

REWARD_MODES = ("binary", "pass_ratio")
_STATUS = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)")


def parse_pytest_log(text: str) -> dict[str, str]:
    """Test id -> status from pytest `-rA` short summary lines ("PASSED path::test", "FAILED path::test - msg").

    Also accepts the verbose form "path::test PASSED". The last status seen for a test wins.
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        m = _LINE.match(line)
        if m:
            out[m.group(2)] = m.group(1)
            continue
        parts = line.split()
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in _STATUS:
            out[parts[0]] = parts[1]
    return out


def repair_reward(status: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str],
                  mode: str = "binary") -> RewardResult:
    """Score parsed test statuses against the task's FAIL_TO_PASS and PASS_TO_PASS lists."""
    if mode not in REWARD_MODES:
        raise ValueError(f"reward mode {mode!r} is unknown; use one of {', '.join(REWARD_MODES)}")
    ok = lambda t: status.get(t) in ("PASSED", "XFAIL")  # noqa: E731 - SWE-bench counts XFAIL as pass
    f2p = sum(ok(t) for t in fail_to_pass)
    p2p = sum(ok(t) for t in pass_to_pass)
    total = len(fail_to_pass) + len(pass_to_pass)
    resolved = f2p == len(fail_to_pass) and p2p == len(pass_to_pass)
    reward = float(resolved) if mode == "binary" else ((f2p + p2p) / total if total else 0.0)
    return RewardResult(reward, f"FAIL_TO_PASS {f2p}/{len(fail_to_pass)}, PASS_TO_PASS {p2p}/{len(pass_to_pass)}",
                        {"resolved": resolved, "fail_to_pass_passed": f2p, "pass_to_pass_passed": p2p,
                         "missing": [t for t in fail_to_pass + pass_to_pass if t not in status]})


def read_reward_file(logs_dir: str | Path) -> RewardResult:
    """Harbor verifier output: reward.txt (a number) or reward.json ({"reward": x}); missing -> 0."""
    d = Path(logs_dir)
    txt, js = d / "reward.txt", d / "reward.json"
    try:
        if txt.is_file():
            return RewardResult(float(txt.read_text().strip()), "reward.txt")
        if js.is_file():
            data = json.loads(js.read_text())
            return RewardResult(float(data["reward"] if isinstance(data, dict) else data), "reward.json")
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        return RewardResult(0.0, f"unreadable reward file: {type(e).__name__}: {e}")
    return RewardResult(0.0, "the verifier wrote no reward file")
