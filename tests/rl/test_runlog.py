"""The run log after a crash mid-append: a torn last line is dropped (and rewritten away on resume); a
corrupt line elsewhere is an error naming the file and line, since dropping it would lose a round."""

import pytest

from tsrl_cli.errors import UsageError
from tsrl_cli.rl.runlog import RunLog


def test_torn_last_line_is_dropped_and_resume_rewrites_the_file(tmp_path):
    log = RunLog(tmp_path)
    log.append("metrics.jsonl", [{"round": 1, "loss": 0.5}, {"round": 2, "loss": 0.25}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "lo')  # killed mid-write
    assert [r["round"] for r in log.rows("metrics.jsonl")] == [1, 2]
    log.keep_rounds_up_to(1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"round": 1, "loss": 0.5}\n'
    log.append("metrics.jsonl", [{"round": 2, "loss": 0.125}])
    assert [r["loss"] for r in log.rows("metrics.jsonl")] == [0.5, 0.125]


def test_torn_line_alone_is_rewritten_even_when_no_round_is_dropped(tmp_path):
    log = RunLog(tmp_path)
    log.append("events.jsonl", [{"round": 1, "event": "step"}])
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"round": 2')
    log.keep_rounds_up_to(5)
    assert (tmp_path / "events.jsonl").read_text().endswith("}\n")
    assert log.rows("events.jsonl") == [{"round": 1, "event": "step"}]


def test_a_corrupt_line_before_the_end_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n{torn\n{"round": 2}\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl:2: not a JSON row"):
        RunLog(tmp_path).rows("metrics.jsonl")
