"""tsrl_cli.rundir, the one reader of a run directory: each torn-line policy on a torn last line and
on a corrupt middle line, gzipped files read as plain, config.yaml through load_config (every
committed run's too), checkpoints, DONE, and what predict and the report make of it."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import ConfigError, TrainConfig, dump_config
from tsrl_cli.errors import UsageError
from tsrl_cli.rundir import (
    DROP_LAST,
    EVENTS,
    METRICS,
    SKIP,
    STRICT,
    RunDir,
    read_jsonl,
    read_sweep,
    runs_under,
)

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"round": 1, "x": 0.5}, {"round": 2, "x": 0.25}]
WHOLE = "".join(json.dumps(r) + "\n" for r in ROWS)


def write(p: Path, text: str) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


TORN = WHOLE + '{"round": 3, "x'  # killed mid-append
MIDDLE = WHOLE.replace("\n", '\n{"round": oops\n', 1)  # line 2 corrupt, line 3 whole
NOT_OBJECT = WHOLE + "[1, 2]\n"  # JSON, but not a row


def test_drop_last_leaves_out_a_torn_last_line(tmp_path):
    got = read_jsonl(write(tmp_path / METRICS, TORN), DROP_LAST)
    assert got.rows == ROWS and got.torn and got.lines == [1, 2] and got.skipped == 0
    whole = read_jsonl(write(tmp_path / "w.jsonl", WHOLE), DROP_LAST)
    assert whole.rows == ROWS and not whole.torn
    # a last line without newline is dropped even when it parses: the newline is part of the append
    assert read_jsonl(write(tmp_path / "p.jsonl", WHOLE + '{"round": 3}'), DROP_LAST).rows == ROWS


@pytest.mark.parametrize("text,line,why", [(MIDDLE, 2, "not JSON"), (NOT_OBJECT, 3, "a JSON list, not an object")])
def test_drop_last_raises_on_a_bad_line_before_the_end(tmp_path, text, line, why):
    p = write(tmp_path / METRICS, text)
    with pytest.raises(UsageError) as e:
        read_jsonl(p, DROP_LAST)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: not a JSON row: {why}") and "repair or delete that line" in msg
    assert "\n" not in msg


def test_strict_raises_on_any_bad_line_and_keeps_a_whole_last_line_without_newline(tmp_path):
    with pytest.raises(UsageError, match=r"t.jsonl:3: not a JSON row: not JSON"):
        read_jsonl(write(tmp_path / "t.jsonl", TORN), STRICT)
    with pytest.raises(UsageError, match=r"m.jsonl:2: not a JSON row: not JSON .*one JSON object"):
        read_jsonl(write(tmp_path / "m.jsonl", MIDDLE), STRICT)
    # a file a person wrote may end without a newline: its last row is whole, and kept
    got = read_jsonl(write(tmp_path / "h.jsonl", WHOLE.rstrip("\n")), STRICT)
    assert got.rows == ROWS and got.torn


@pytest.mark.parametrize("text,skipped,lines", [(TORN, 1, [1, 2]), (MIDDLE, 1, [1, 3]), (NOT_OBJECT, 1, [1, 2]),
                                                (WHOLE, 0, [1, 2]), ("\n" + WHOLE + "\n\n", 0, [2, 3])])
def test_skip_counts_bad_lines_and_never_blank_ones(tmp_path, text, skipped, lines):
    got = read_jsonl(write(tmp_path / METRICS, text), SKIP)
    assert (got.rows, got.skipped, got.lines) == (ROWS, skipped, lines)


def test_a_missing_file_has_no_rows_and_an_unknown_policy_is_refused(tmp_path):
    assert RunDir(tmp_path).rows(METRICS) == [] and read_jsonl(tmp_path / "none.jsonl", STRICT).rows == []
    with pytest.raises(ValueError, match="torn='lenient'"):
        read_jsonl(tmp_path / "none.jsonl", "lenient")


def test_gzipped_events_read_as_plain(tmp_path):
    ev = [{"round": k, "event": "item", "id": str(i)} for k in (1, 2) for i in range(3)]
    text = "".join(json.dumps(e) + "\n" for e in ev)
    plain, packed = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    write(plain.root / EVENTS, text)
    packed.root.mkdir()
    (packed.root / (EVENTS + ".gz")).write_bytes(gzip.compress(text.encode()))
    assert packed.file(EVENTS).name == "events.jsonl.gz" and plain.file(EVENTS).name == "events.jsonl"
    assert packed.rows(EVENTS) == plain.rows(EVENTS) == ev
    assert packed.read(EVENTS, SKIP).numbered() == plain.read(EVENTS, SKIP).numbered()
    # the plain file wins when both exist (a run being written beside an old compressed copy)
    write(packed.root / EVENTS, json.dumps(ev[0]) + "\n")
    assert packed.file(EVENTS).name == "events.jsonl" and packed.rows(EVENTS) == ev[:1]
    # the torn-line policy applies to the decompressed text
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress((text + '{"rou').encode()))
    assert read_jsonl(tmp_path / "t.jsonl.gz", DROP_LAST).rows == ev
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(text.encode())[:-9])  # truncated copy
    with pytest.raises(UsageError, match="bad.jsonl.gz: unreadable"):
        read_jsonl(tmp_path / "bad.jsonl.gz", SKIP)


def test_config_loads_through_load_config(tmp_path):
    run = RunDir(tmp_path)
    assert not run.started() and run.config_dict() == {}
    with pytest.raises(UsageError, match="no config.yaml"):
        run.config()
    cfg = TrainConfig(seed=7, sync_batching="per_item")
    write(run.config_path, dump_config(cfg))
    assert run.started() and run.config() == cfg
    assert run.config_dict()["sync_batching"] == "per_item" and run.config_dict()["rollout"]["group_size"] == 8
    # a run's config as an older version wrote it: keys it lacks take today's defaults
    write(run.config_path, "seed: 3\nrollout:\n  group_size: 4\n")
    assert run.config() == TrainConfig(seed=3, rollout=TrainConfig().rollout.__class__(group_size=4))
    assert run.config_dict() == {"seed": 3, "rollout": {"group_size": 4}}  # as written, no defaults
    write(run.config_path, "seed: 3\nrollout:\n  sigma: 0.5\n")
    with pytest.raises(ConfigError, match="rollout.sigma"):
        run.config()
    write(run.config_path, "seed: [3\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        run.config_dict()


def test_every_committed_run_config_loads():
    """The committed reports' runs were written by earlier versions of the code; each still loads."""
    paths = sorted((REPO / "results").rglob("config.yaml"))
    assert len(paths) >= 60  # 63 when written: every report under results/reports/*/runs
    for p in paths:
        cfg = RunDir(p.parent).config()
        assert cfg.schedule in ("sync", "stream", "async"), p


def test_checkpoints_need_their_state_json(tmp_path):
    run = RunDir(tmp_path)
    assert run.checkpoints() == {}
    for k in (0, 2, 10):
        write(run.checkpoint_path(k) / "state.json", "{}")
    write(run.checkpoint_path(3) / "model.safetensors", "")  # the learner was killed while writing it
    write(tmp_path / "checkpoints" / "round-x" / "state.json", "{}")  # not a round
    assert run.checkpoint_path(2) == tmp_path / "checkpoints" / "round-2"
    assert list(run.checkpoints()) == [0, 2, 10]  # by round, not by name (round-10 < round-2)
    assert run.checkpoints()[10] == run.checkpoint_path(10)


def test_done_and_its_summary(tmp_path):
    run = RunDir(tmp_path)
    assert not run.done() and run.summary() is None
    write(run.done_path, json.dumps({"rounds": 4}) + "\n")
    assert run.done() and run.summary() == {"rounds": 4}
    write(run.done_path, "{torn")
    with pytest.raises(UsageError, match="DONE: not JSON"):
        run.summary()


def test_runs_under_and_the_sweep_file(tmp_path):
    for d in ("e/sync/seed1", "e/stream/seed1", "deep/x/stream/seed2"):
        write(tmp_path / d / METRICS, WHOLE)
    write(tmp_path / "e" / "notes" / "config.yaml", "")  # no metrics: not a run
    assert [r.root.relative_to(tmp_path).as_posix() for r in runs_under(tmp_path)] == \
        ["deep/x/stream/seed2", "e/stream/seed1", "e/sync/seed1"]
    assert read_sweep(tmp_path) == {}
    write(tmp_path / "sweep.json", "{not json")
    assert read_sweep(tmp_path) == {}
    write(tmp_path / "sweep.json", json.dumps({"warmup": 2}))
    assert read_sweep(tmp_path) == {"warmup": 2}


def test_rundir_imports_no_torch_pandas_or_numpy():
    code = ("import sys\nimport tsrl_cli.rundir\n"
            "print(sorted(m for m in ('torch', 'pandas', 'numpy', 'typer', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


# ---------------------------------------------------------------------------- what the callers make of it

def stream_run(d: Path, config: str | None, torn: bool = False) -> Path:
    """A stream run of one round: items of 10 and 30 tokens arriving at 1 and 2 s, costing 1 and 3 s."""
    ev = [{"round": 1, "event": "item", "id": "a", "finished_at_s": 1.0, "learner_cost_s": 1.0, "tokens": 10},
          {"round": 1, "event": "item", "id": "b", "finished_at_s": 2.0, "learner_cost_s": 3.0, "tokens": 30}]
    write(d / EVENTS, "".join(json.dumps(e) + "\n" for e in ev) + ('{"round": 2, "ev' if torn else ""))
    write(d / METRICS, json.dumps({"round": 1, "schedule": "stream", "step_time_s": 5.0}) + "\n")
    if config is not None:
        write(d / "config.yaml", config)
    return d


@pytest.mark.parametrize("config,padded", [(None, True), ("seed: 1\n", True), ("sync_batching: padded\n", True),
                                           ("sync_batching: per_item\n", False),
                                           ("sync_batching: 'per_item'  # quoted\n", False)])
def test_predict_takes_sync_batching_from_the_config(tmp_path, config, padded):
    from tsrl_cli.predict import load_trace, predict_rounds

    trace = load_trace(stream_run(tmp_path / "r", config))
    assert trace.padded_sync is padded
    # the sync baseline after the last arrival (2 s): padded, one batch of 2 x 30 positions priced from the
    # items' 4 s over their 40 tokens (4 * 60 / 40 = 6 s); per_item, the items' own 4 s
    assert predict_rounds(trace)[0]["sync_s"] == pytest.approx(2.0 + (6.0 if padded else 4.0))


def test_predict_drops_a_runs_torn_line_and_refuses_a_bad_trace_row(tmp_path):
    from tsrl_cli.predict import load_trace

    run = stream_run(tmp_path / "r", None, torn=True)
    assert [r.round for r in load_trace(run).rounds] == [1]  # the run being written: its torn line left out
    with pytest.raises(UsageError, match=r"events.jsonl:3: not a JSON row"):
        load_trace(run / EVENTS)  # the same file named alone must be whole
    p = write(tmp_path / "trace.jsonl", '{"finished_at_s": 1, "learner_cost_s": 2}\n{oops\n')
    res = CliRunner().invoke(app, ["predict", "--trace", str(p)])
    assert res.exit_code == 2 and f"{p}:2: not a JSON row" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_report_counts_unreadable_metrics_lines(tmp_path):
    from tsrl_cli.report.load import load_results

    d = tmp_path / "exp" / "sync" / "seed1"
    write(d / METRICS, MIDDLE + '{"round": 3, "x')  # a corrupt middle line and a torn last one
    write(d / "DONE", "{}")
    res = load_results(tmp_path)
    assert res.rounds["round"].tolist() == [1, 2]
    assert "exp/sync/seed1/metrics.jsonl: 2 unreadable line(s) ignored" in res.notes


def test_report_notes_a_config_this_version_does_not_load(tmp_path):
    from tsrl_cli.report.load import load_results

    d = tmp_path / "exp" / "sync" / "seed1"
    write(d / METRICS, WHOLE)
    write(d / "DONE", "{}")
    write(d / "config.yaml", "rollout:\n  sigma: 0.5\n")
    res = load_results(tmp_path)
    assert res.runs[0].config == {"rollout": {"sigma": 0.5}}  # read as written
    assert any(n.startswith("exp/sync/seed1: config.yaml does not load in this version") and "rollout.sigma" in n
               for n in res.notes)
    write(d / "config.yaml", "rollout: [0.5\n")
    res = load_results(tmp_path)
    assert res.runs[0].config == {} and any("not valid YAML" in n and n.endswith("; ignored") for n in res.notes)
