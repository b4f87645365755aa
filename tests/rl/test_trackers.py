"""run.trackers: every metrics row also goes to TensorBoard / W&B (offline here), and reads back equal.

The reference is metrics.jsonl itself: the event file and the offline .wandb file are read back with
the backends' own readers (TensorBoard's EventAccumulator, W&B's record protobuf) and every numeric
key of every round must equal the JSON row exactly. A perturbed row must not (positive control).
"""

import importlib.util
import json
import math
import shutil
import struct
import sys
from pathlib import Path

import pytest
from toy_workload import TOY
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import ConfigError, TrainConfig, load_config
from tsrl_cli.errors import UsageError
from tsrl_cli.rl.trackers import BACKENDS, open_trackers, scalars

HAS_TB = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None


def wandb_env(mp: pytest.MonkeyPatch, home: Path) -> None:
    """Offline, and W&B's own config/cache under `home` (nothing read from or written to the user's)."""
    mp.setenv("WANDB_MODE", "offline")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        mp.setenv(var, str(home / sub))


def expected_from_jsonl(rows: list[dict]) -> dict[str, dict[int, float]]:
    """{key: {round: value}} for the numeric leaves of each row, written independently of trackers.scalars."""
    out: dict[str, dict[int, float]] = {}

    def walk(prefix, d, rnd):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}/", v, rnd)
            elif type(v) in (int, float):
                out.setdefault(prefix + k, {})[rnd] = v

    for r in rows:
        walk("", r, r["round"])
    return out


def mismatches(expected: dict, got: dict) -> list[str]:
    keys = expected.keys() | got.keys()
    return [f"{k}: jsonl {expected.get(k)} != tracker {got.get(k)}" for k in sorted(keys)
            if expected.get(k) != got.get(k)]


def read_tensorboard(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})  # 0: keep every event
    acc.Reload()
    return {tag: {ev.step: make_ndarray(ev.tensor_proto).item() for ev in acc.Tensors(tag)}
            for tag in acc.Tags()["tensors"]}


def wandb_records(path: Path):
    """The records of an offline run's .wandb file: W&B's header, then LevelDB-log framing (32 KiB blocks,
    7-byte record headers: crc32c, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) around Record protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def read_wandb(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, float], list[str]]:
    """({key: {round: value}} from the history, the final summary, the run ids) over the offline runs."""
    history: dict[str, dict[int, float]] = {}
    summary: dict[str, float] = {}
    ids = []
    # in the order the runs ran (a run's file is complete before a resumed run starts; folder names of runs
    # started in the same second get -1, -2 suffixes, which do not sort by time)
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda f: f.stat().st_mtime_ns):
        ids.append(f.stem.removeprefix("run-"))
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                for k, v in row.items():
                    if not k.startswith("_"):
                        history.setdefault(k, {})[row["round"]] = v
            elif kind == "summary":
                summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                for i in rec.summary.update})
    return history, {k: v for k, v in summary.items() if not k.startswith("_")}, ids


# ---- config and errors ------------------------------------------------------------------------------

def test_config_parses_lists_and_rejects_unknown_names(tmp_path):
    assert TrainConfig().run.trackers == ()
    assert load_config(sets=["run.trackers=[tensorboard, wandb]"]).run.trackers == ("tensorboard", "wandb")
    y = tmp_path / "exp.yaml"
    y.write_text("run: {trackers: [wandb]}\n")
    assert load_config(y).run.trackers == ("wandb",)
    with pytest.raises(ConfigError, match="run.trackers: 'mlflow' is not one of tensorboard, wandb"):
        load_config(sets=["run.trackers=[mlflow]"])
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(sets=["run.trackers=[wandb, wandb]"])
    with pytest.raises(ConfigError, match="YAML list syntax"):
        load_config(sets=["run.trackers=wandb"])
    # the names the config allows are the backends trackers.py opens
    for name in BACKENDS:
        load_config(sets=[f"run.trackers=[{name}]"])


def test_scalars_flattens_and_skips_non_numbers():
    row = {"round": 3, "loss": None, "exact": True, "schedule": "stream", "ranks": [1, 2], "reward_mean": 0.5,
           "exit_reasons": {"submitted": 6, "max_turns": 2, "deep": {"x": 1.5, "s": "no"}}}
    assert scalars(row) == {"round": 3, "reward_mean": 0.5, "exit_reasons/submitted": 6,
                            "exit_reasons/max_turns": 2, "exit_reasons/deep/x": 1.5}


def test_cli_unknown_tracker_is_exit_2_one_line():
    res = CliRunner().invoke(app, ["train", "--set", "run.trackers=[mlflow]"])
    assert res.exit_code == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "tensorboard, wandb" in res.stderr


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_cli_missing_package_is_exit_2_before_any_round(name, tmp_path, monkeypatch):
    """The backend's import fails (as where it is not installed): exit 2, one line naming run.trackers and the
    extra, and the run directory never started (no config.yaml, no metrics)."""
    monkeypatch.setitem(sys.modules, BACKENDS[name][0], None)  # `import <name>` now raises ImportError
    out = tmp_path / "run"
    args = ["train", *[a for s in TOY for a in ("--set", s)], "--set", f"run.trackers=[{name}]",
            "--rounds", "1", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "run.trackers" in err[0] and f".[{name}]" in err[0]
    assert not (out / "config.yaml").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.skipif(not HAS_TB, reason="tensorboard not installed (pip install -e '.[tensorboard]')")
def test_backend_that_does_not_import_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UsageError, match=r"run.trackers: tensorboard does not import.*\.\[tensorboard\]"):
        open_trackers(tmp_path, TrainConfig(), ["tensorboard"])


# ---- resume and the offline default, without a run ---------------------------------------------------

@pytest.mark.skipif(not HAS_TB, reason="tensorboard not installed (pip install -e '.[tensorboard]')")
def test_tensorboard_resume_shows_each_round_once(tmp_path):
    """A run logged rounds 1-3, its last checkpoint was round 2: the resumed run re-logs round 3 (first_round 3).
    TensorBoard's own loader (the one its UI uses) then shows rounds 1-2 from the first attempt and 3-4 from
    the second; the interrupted attempt's round 3 is hidden."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    t = open_trackers(tmp_path, TrainConfig(), ["tensorboard"])
    for k in (1, 2, 3):
        t.log({"round": k, "loss": float(k)}, step=k)
    t.close()
    t = open_trackers(tmp_path, TrainConfig(), ["tensorboard"], first_round=3)
    for k in (3, 4):
        t.log({"round": k, "loss": 10.0 * k}, step=k)
    t.log({"eval/x/success": 0.25}, step=2)  # a held-out evaluation arrives after the last round
    t.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={TENSORS: 0})
    acc.Reload()
    loss = [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors("loss")]
    assert loss == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors("eval/x/success")] == [(2, 0.25)]
    assert acc.SummaryMetadata("loss").plugin_data.plugin_name == "scalars"  # drawn as a scalar chart


@pytest.mark.skipif(not HAS_WANDB, reason="wandb not installed (pip install -e '.[wandb]')")
def test_wandb_offline_by_default_and_resume_keeps_the_run_id(tmp_path, monkeypatch):
    wandb_env(monkeypatch, tmp_path / "home")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t = open_trackers(run_dir, TrainConfig(), ["wandb"])
    assert len(t.notes) == 1 and "offline" in t.notes[0] and str(run_dir / "wandb") in t.notes[0]
    t.log({"round": 1, "loss": 1.0}, step=1)
    t.log({"round": 2, "loss": 2.0}, step=2)
    t.close()
    t = open_trackers(run_dir, TrainConfig(), ["wandb"], first_round=2)
    t.log({"round": 2, "loss": 20.0}, step=2)
    t.log({"eval/x/success": 0.25}, step=1)  # a held-out evaluation arrives after the last round
    t.close()
    history, summary, ids = read_wandb(run_dir)
    assert len(ids) == 2 and ids[0] == ids[1] == (run_dir / "wandb" / "run_id").read_text().strip()
    assert history["loss"] == {1: 1.0, 2: 20.0} and summary["loss"] == 20.0  # the later offline run's values
    assert history["eval/x/success"] == {1: 0.25}  # logged with its round
    f = next((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    metric = [r.metric for r in wandb_records(f) if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "round" for m in metric)  # charts' x axis: round
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a configured key: wandb's own mode (online) is left alone
    from tsrl_cli.rl.trackers import wandb_key_configured

    assert wandb_key_configured()


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (the dev extra has it)")
def test_a_run_that_stopped_on_an_error_is_a_failed_wandb_run(tmp_path, monkeypatch):
    wandb_env(monkeypatch, tmp_path / "home")
    codes = {}
    for failed in (False, True):  # control: the same run closed normally exits 0
        run_dir = tmp_path / f"run-{failed}"
        run_dir.mkdir()
        t = open_trackers(run_dir, TrainConfig(), ["wandb"])
        t.log({"round": 1, "loss": 1.0}, step=1)
        t.close(failed=failed)
        f = next((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
        codes[failed] = [r.exit.exit_code for r in wandb_records(f) if r.WhichOneof("record_type") == "exit"]
    assert codes == {False: [0], True: [1]}


# ---- a real run -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tracked_run(toy_policies, tmp_path_factory):
    """`tsrl train` on the toy workload, 3 rounds, with every installed tracker; --json must stay one document."""
    names = [n for n, ok in (("tensorboard", HAS_TB), ("wandb", HAS_WANDB)) if ok]
    if not names:
        pytest.skip("neither tensorboard nor wandb is installed (pip install -e '.[tensorboard,wandb]')")
    root = tmp_path_factory.mktemp("tracked")
    out = root / "run"
    args = ["train", *[a for s in TOY for a in ("--set", s)], "--set", f"run.trackers=[{','.join(names)}]",
            "--rounds", "3", "--schedule", "stream", "--out", str(out), "--json"]
    with pytest.MonkeyPatch.context() as mp:
        wandb_env(mp, root / "home")
        res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rounds"] == 3  # nothing else on stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2, 3]
    return out, metrics


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TB, reason="tensorboard not installed (pip install -e '.[tensorboard]')")
def test_tensorboard_values_equal_metrics_jsonl(tracked_run):
    out, metrics = tracked_run
    expected = expected_from_jsonl(metrics)
    assert len(expected) > 20 and {"reward_mean", "step_time_s", "peak_mem_learner_bytes"} <= expected.keys()
    assert any(k.startswith("exit_reasons/") for k in expected)  # a nested dict, flattened
    got = read_tensorboard(out / "tensorboard")
    assert mismatches(expected, got) == []
    # positive control: one value changed in the last bit, or one key dropped, is seen
    perturbed = json.loads(json.dumps(metrics))
    perturbed[1]["step_time_s"] = math.nextafter(perturbed[1]["step_time_s"], math.inf)
    assert [m.split(":")[0] for m in mismatches(expected_from_jsonl(perturbed), got)] == ["step_time_s"]
    del perturbed[1]["step_time_s"], perturbed[2]["reward_mean"]
    assert len(mismatches(expected_from_jsonl(perturbed), got)) == 2
    # the DONE file is still written last
    done = (out / "DONE").stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= done for p in (out / "tensorboard").iterdir())


@pytest.mark.slow
@pytest.mark.skipif(not HAS_WANDB, reason="wandb not installed (pip install -e '.[wandb]')")
def test_wandb_offline_values_equal_metrics_jsonl(tracked_run):
    out, metrics = tracked_run
    expected = expected_from_jsonl(metrics)
    history, summary, ids = read_wandb(out)
    assert len(ids) == 1
    assert mismatches(expected, history) == []
    # the summary is the last metrics row, plus each key the last row lacks at its latest value
    # (W&B keeps the last value logged per key; exit_reasons/<reason> appears only in some rounds)
    last = {k: v[3] for k, v in expected_from_jsonl(metrics[-1:]).items()}
    assert {k: summary.get(k) for k in last} == last
    assert {k: v for k, v in summary.items() if k not in last} == {
        k: v[max(v)] for k, v in expected.items() if k not in last}
    perturbed = json.loads(json.dumps(metrics))
    perturbed[0]["reward_mean"] = math.nextafter(perturbed[0]["reward_mean"], math.inf)
    assert [m.split(":")[0] for m in mismatches(expected_from_jsonl(perturbed), history)] == ["reward_mean"]
    done = (out / "DONE").stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= done for p in (out / "wandb").rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TB, reason="tensorboard not installed (pip install -e '.[tensorboard]')")
def test_resumed_run_logs_each_round_once(toy_config, tmp_path, monkeypatch):
    """A run dies after round 2's metrics but before its checkpoint; --resume re-runs round 2. TensorBoard's
    loader shows rounds 1 and 2 once each, with the values metrics.jsonl now holds (the re-run's)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    from tsrl_cli.rl.train import train

    wandb_env(monkeypatch, tmp_path / "home")
    names = ["tensorboard"] + (["wandb"] if HAS_WANDB else [])
    cfg = toy_config(f"run.trackers=[{','.join(names)}]", out="resumed", schedule="sync", rounds=2,
                     **{"run.save_every": 1})
    train(cfg)
    d = Path(cfg.run_dir())
    first = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(d / "checkpoints" / "round-2")
    (d / "DONE").unlink()
    train(cfg, resume=True)
    metrics = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [1, 2] and metrics[0] == first[0]
    assert metrics[1]["wall_s"] != first[1]["wall_s"]  # round 2 really ran twice, so a stale value would show
    acc = EventAccumulator(str(d / "tensorboard"), size_guidance={TENSORS: 0})
    acc.Reload()
    events = {tag: [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
              for tag in acc.Tags()["tensors"]}
    assert all([s for s, _ in ev] == sorted({s for s, _ in ev}) for ev in events.values())  # each round once
    assert mismatches(expected_from_jsonl(metrics), {t: dict(ev) for t, ev in events.items()}) == []
    if HAS_WANDB:  # the same W&B run id, continued; its later values of round 2 are the resumed run's
        history, _, ids = read_wandb(d)
        assert len(ids) == 2 and ids[0] == ids[1]
        assert mismatches(expected_from_jsonl(metrics), history) == []
