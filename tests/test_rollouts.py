"""The rollout record: malformed lines are reported by line number and field."""

import json

import pytest

from tsrl_cli.errors import UsageError
from tsrl_cli.rollouts import Rollout, read_rollouts, write_rollouts

GOOD = {"group_id": "q1", "sample_index": 0, "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0],
        "reward": 1.0, "turn_spans": [[2, 4]]}


def write(tmp_path, rows):
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_roundtrip(tmp_path):
    ro = Rollout("q", 1, [1, 2, 3], [0, 1, 1], 0.5, [(1, 3)], teacher_logprobs=[0.0, -1.0, -2.0])
    p = tmp_path / "x.jsonl"
    write_rollouts([ro], p)
    assert read_rollouts(p) == [ro]
    assert not (tmp_path / "x.jsonl.tmp").exists()


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"reward": "high"}, "'reward'"),
        ({"loss_mask": [0, 0, 1]}, "'loss_mask' has 3 entries"),
        ({"loss_mask": [1, 0, 1, 1, 0]}, "position 0"),
        ({"loss_mask": [0, 0, 1, 1, 2]}, "0/1"),
        ({"turn_spans": [[3, 2]]}, "'turn_spans'[0]"),
        ({"turn_spans": [[2, 3]]}, "position 3"),
        ({"input_ids": []}, "'input_ids'"),
        ({"teacher_logprobs": [0.0]}, "'teacher_logprobs'"),
        ({"colour": 1}, "unknown field 'colour'"),
        ({"group_id": 3}, "'group_id'"),
    ],
)
def test_malformed_line_names_line_and_field(tmp_path, change, msg):
    p = write(tmp_path, [GOOD, {**GOOD, "sample_index": 1, **change}])
    with pytest.raises(UsageError) as e:
        read_rollouts(p)
    assert f"{p}:2:" in str(e.value) and msg in str(e.value)


def test_missing_field_and_bad_json(tmp_path):
    bad = dict(GOOD)
    del bad["reward"]
    with pytest.raises(UsageError, match=r":1: missing field 'reward'"):
        read_rollouts(write(tmp_path, [bad]))
    with pytest.raises(UsageError, match=r":2: not valid JSON"):
        read_rollouts(write(tmp_path, [GOOD, "{oops"]))


def test_duplicates_missing_file_and_empty(tmp_path):
    with pytest.raises(UsageError, match="duplicate"):
        read_rollouts(write(tmp_path, [GOOD, GOOD]))
    with pytest.raises(UsageError, match="not found"):
        read_rollouts(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(UsageError, match="no rollouts"):
        read_rollouts(tmp_path / "e.jsonl")
