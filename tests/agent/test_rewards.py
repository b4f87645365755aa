"""Test-log parsing and rewards on hand-written pytest output."""

import pytest

from tsrl_cli.agent.rewards import parse_pytest_log, read_reward_file, repair_reward

LOG = """
============================= test session starts ==============================
collected 3 items

tests/test_calc.py .F.                                                   [100%]
=========================== short test summary info ============================
PASSED tests/test_calc.py::test_add
PASSED tests/test_calc.py::test_mul
FAILED tests/test_calc.py::test_sub - assert -1 == 1
========================= 1 failed, 2 passed in 0.02s =========================
"""


def test_parse_rA_summary():
    assert parse_pytest_log(LOG) == {"tests/test_calc.py::test_add": "PASSED", "tests/test_calc.py::test_mul": "PASSED",
                                     "tests/test_calc.py::test_sub": "FAILED"}
    assert parse_pytest_log("tests/t.py::test_x PASSED [ 50%]") == {"tests/t.py::test_x": "PASSED"}


def test_repair_reward_modes():
    st = parse_pytest_log(LOG)
    f2p, p2p = ["tests/test_calc.py::test_sub"], ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"]
    r = repair_reward(st, f2p, p2p)
    assert r.reward == 0.0 and not r.details["resolved"] and "FAIL_TO_PASS 0/1" in r.reason
    assert repair_reward(st, f2p, p2p, "pass_ratio").reward == pytest.approx(2 / 3)
    st["tests/test_calc.py::test_sub"] = "PASSED"
    assert repair_reward(st, f2p, p2p).reward == 1.0
    assert repair_reward({}, f2p, p2p).details["missing"] == f2p + p2p
    with pytest.raises(ValueError):
        repair_reward(st, f2p, p2p, "half")


def test_reward_files(tmp_path):
    assert read_reward_file(tmp_path).reward == 0.0
    (tmp_path / "reward.json").write_text('{"reward": 0.5}')
    assert read_reward_file(tmp_path).reward == 0.5
    (tmp_path / "reward.txt").write_text("1\n")
    assert read_reward_file(tmp_path).reward == 1.0
    (tmp_path / "reward.txt").write_text("yes")
    r = read_reward_file(tmp_path)
    assert r.reward == 0.0 and "unreadable" in r.reason
