"""`tsrl report` on a synthetic results tree (tests/report/synthetic_runs.py): every table and figure."""

import json
import statistics

import pytest
from report_helpers import read_csv
from synthetic_runs import MODEL, OVERHEAD, TASKS, make_tree
from typer.testing import CliRunner

from tsrl_cli.cli import app

runner = CliRunner()
TABLES = ("step_time", "learner_idle", "memory", "device_hours_to_target", "reward_at_budget", "predicted_vs_measured",
          "trained_vs_sampled")
FIGURES = ("speedup_vs_spread", "predicted_vs_measured", "gantt_round", "reward_curves", "reward_vs_device_s", "memory",
           "trained_vs_sampled")


def test_writes_every_table_and_figure(built):
    out, doc = built
    for name in TABLES:
        assert read_csv(out / "tables" / f"{name}.csv"), name
        assert (out / "tables" / f"{name}.md").read_text().startswith("### ")
    for name in FIGURES:
        png = (out / "figures" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name
        assert read_csv(out / "figures" / f"{name}.csv"), name
    assert sorted(doc["figures"]) == sorted(str(out / "figures" / f"{n}.png") for n in FIGURES)
    assert not list(out.rglob("*.tmp"))  # atomic writes leave no temporary files


def test_step_time_numbers_match_hand_aggregation(built, results_tree):
    out, _ = built
    rows = {(r["experiment"], r["schedule"]): r for r in read_csv(out / "tables" / "step_time.csv")}

    def seed_mean(exp, sched, seed):  # rounds 5-8 of this seed, straight from metrics.jsonl
        ms = [json.loads(x) for x in (results_tree / exp / sched / f"seed{seed}" / "metrics.jsonl").open()]
        return statistics.fmean(m["step_time_s"] for m in ms if m["round"] > 4)

    for exp in ("spread_low", "spread_high"):
        stream = [seed_mean(exp, "stream", s) for s in (42, 43, 44)]
        speed = [seed_mean(exp, "sync", s) / t for s, t in zip((42, 43, 44), stream, strict=True)]
        r = rows[(exp, "stream")]
        assert float(r["step_time_s_mean"]) == pytest.approx(statistics.fmean(stream))
        assert float(r["step_time_s_std"]) == pytest.approx(statistics.stdev(stream))
        assert float(r["speedup_mean"]) == pytest.approx(statistics.fmean(speed))
        assert r["seeds"] == "42 43 44" and r["rounds_per_seed"] == "4"  # seed45 has no DONE: skipped


def test_predicted_against_measured(built):
    out, doc = built
    rows = read_csv(out / "tables" / "predicted_vs_measured_rows.csv")
    assert len(rows) == doc["predicted_rows"] == 2 * 2 * 3 * 4  # 2 experiments x 2 schedules x 3 seeds x rounds 5-8
    # the synthetic runs measure 2 % more than the model: error = 1/1.02 - 1 on every row
    assert all(float(r["error_pct"]) == pytest.approx(100 * (1 / OVERHEAD - 1)) for r in rows)
    assert doc["predicted_mean_abs_error_pct"] == pytest.approx(100 * (1 - 1 / OVERHEAD))
    assert doc["paired_rows"] == 2 * 3 * 4 and doc["paired_mean_abs_error_pct"] == pytest.approx(0, abs=1e-9)


def test_report_md_puts_ours_beside_the_paper(built):
    out, doc = built
    md = (out / "REPORT.md").read_text()
    assert "1313 s -> 687 s" in md and "117.0 GB -> 122.8 GB" in md and "588 paired rows" in md
    # the setup is the runs' own config.yaml: rollout and learner on cpu, the model and tasks it names
    assert f"ours (2 cpu devices (rollout cpu, learner cpu); model {MODEL}; tasks {TASKS})" in md
    assert "paper (one node of 8 B200 GPUs" in md
    assert "figures/gantt_round.png" in md and "rollout.tool_latency_sigma=0.2" in md
    assert "seed45: no DONE" in md and any("seed45" in n for n in doc["notes"])
    spread = read_csv(out / "figures" / "speedup_vs_spread.csv")
    assert [float(r["spread"]) for r in spread] == [0.2, 1.0]


@pytest.mark.slow
def test_include_partial_counts_unfinished_runs(results_tree, tmp_path):
    res = runner.invoke(app, ["report", str(results_tree), "--out", str(tmp_path), "--include-partial", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["runs"] == 13
    rows = {(r["experiment"], r["schedule"]): r for r in read_csv(tmp_path / "tables" / "step_time.csv")}
    assert rows[("spread_high", "stream")]["seeds"] == "42 43 44 45"


def test_missing_inputs_are_skipped_with_notes(tmp_path):
    root = make_tree(tmp_path / "results", experiments=(("only", 0.5),), schedules=("stream",), seeds=(1,), rounds=6)
    run = root / "only" / "stream" / "seed1"
    (run / "events.jsonl").unlink()
    (run / "config.yaml").write_text("rollout: {sigma: 0.5}\n")
    res = runner.invoke(app, ["report", str(root), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    notes = " ".join(doc["notes"])
    assert "no events.jsonl" in notes and "speedup_vs_spread skipped" in notes and "gantt_round skipped" in notes
    assert doc["out"] == str(root / "report")
    md = (root / "report" / "REPORT.md").read_text()
    assert "not measured" in md and "## Notes" in md


def test_empty_and_bad_results_dirs(tmp_path):
    res = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not found" in res.stderr
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["report", str(tmp_path / "empty"), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["runs"] == 0
    assert runner.invoke(app, ["report", str(tmp_path / "empty"), "--warmup", "40"]).exit_code == 2


def test_bad_out_budget_and_rows(tmp_path):
    """One-line errors (exit 2) that name the option and the fix; a metrics row without an integer
    round is counted as unreadable, not a crash."""
    root = make_tree(tmp_path / "r", experiments=(("e", 0.5),), schedules=("stream",), seeds=(1,), rounds=6)
    (tmp_path / "file").write_text("")
    res = runner.invoke(app, ["report", str(root), "--out", str(tmp_path / "file")])
    assert res.exit_code == 2 and "is a file; name a directory" in res.stderr and len(res.stderr.splitlines()) == 1
    res = runner.invoke(app, ["report", str(root), "--budget-device-s", "0"])
    assert res.exit_code == 2 and "--budget-device-s 0" in res.stderr
    with (root / "e" / "stream" / "seed1" / "metrics.jsonl").open("a") as f:
        f.write('{"round": "seven", "reward_mean": 1.0}\n{"round": 7.5}\n')
    res = runner.invoke(app, ["report", str(root), "--json"])
    assert res.exit_code == 0 and "e/stream/seed1/metrics.jsonl: 2 unreadable line(s) ignored" in res.stdout


def test_human_output_and_help(tmp_path):
    root = make_tree(tmp_path / "r", experiments=(("e", 0.5),), schedules=("stream",), seeds=(1,), rounds=6)
    res = runner.invoke(app, ["report", str(root)])
    assert res.exit_code == 0 and "REPORT.md" in res.stdout
    assert runner.invoke(app, ["report", "--help"]).exit_code == 0


def test_async_runs_give_the_budget_comparison(built_async):
    out, _ = built_async
    md = (out / "REPORT.md").read_text()
    assert "stream" in md and "vs async" in md and "device-hours (cpu)" in md
    budget = read_csv(out / "tables" / "reward_at_budget.csv")
    assert [r["schedule"] for r in budget] == ["sync", "stream", "async"]


def test_warmup_defaults_to_the_sweeps(tmp_path):
    """`tsrl report` without --warmup takes the warm-up that `tsrl sweep` wrote to sweep.json."""
    import json as _json

    from tsrl_cli.report.build import WARMUP_ROUNDS, sweep_warmup

    assert sweep_warmup(tmp_path) == WARMUP_ROUNDS
    (tmp_path / "sweep.json").write_text(_json.dumps({"warmup": 2}))
    assert sweep_warmup(tmp_path) == 2
    (tmp_path / "sweep.json").write_text("{not json")
    assert sweep_warmup(tmp_path) == WARMUP_ROUNDS


def test_paired_speedup_rows_by_hand():
    """Sync trace prices sync (10 s), stream trace prices stream (5 s): predicted 2.0 against measured
    10 / 5.5; the stream trace alone predicted 1.5."""
    import pandas as pd

    from tsrl_cli.report.tables import paired_speedup_rows

    base = {"experiment": "e", "seed": 42, "round": 5}
    pred = [{**base, "schedule": "sync", "measured_s": 10.0, "sync_s": 10.0, "stream_s": 6.0,
             "predicted_speedup": 10 / 6},
            {**base, "schedule": "stream", "measured_s": 5.5, "sync_s": 7.5, "stream_s": 5.0, "predicted_speedup": 1.5},
            {**base, "round": 6, "schedule": "stream", "measured_s": 5.5, "sync_s": 7.5, "stream_s": 5.0,
             "predicted_speedup": 1.5}]  # no sync partner in round 6: no row
    (row,) = paired_speedup_rows(pd.DataFrame(pred)).to_dict("records")
    assert row["measured_speedup"] == pytest.approx(10 / 5.5)
    assert row["predicted_speedup"] == pytest.approx(2.0)
    assert row["error_pct"] == pytest.approx(100 * (2.0 - 10 / 5.5) / (10 / 5.5))
    assert row["predicted_speedup_stream_trace"] == 1.5
    assert row["error_pct_stream_trace"] == pytest.approx(100 * (1.5 - 10 / 5.5) / (10 / 5.5))
    assert row["predicted_speedup_sync_trace"] == pytest.approx(10 / 6)
    assert row["error_pct_sync_trace"] == pytest.approx(100 * (10 / 6 - 10 / 5.5) / (10 / 5.5))
