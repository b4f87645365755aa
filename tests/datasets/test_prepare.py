"""The pipeline: counts after each filter, train/eval separation, bad input, atomic writes, re-runs, hub path."""

import json
import sys
import types

import pytest

from tsrl_cli.datasets.check import check, show
from tsrl_cli.datasets.prepare import PrepareOptions, prepare
from tsrl_cli.datasets.records import RepairTask, load_dataset_dir, read_tasks
from tsrl_cli.errors import UsageError


def run(source, origin, out, **kw):
    return prepare(PrepareOptions(source=source, origin=str(origin), out=str(out), **kw))


@pytest.fixture
def verified(fixtures, tmp_path):
    run("swebench-verified", fixtures / "swebench_verified", tmp_path / "data" / "swebench_verified")
    return tmp_path / "data"


def test_records_round_trip_through_parquet(fixtures, tmp_path):
    res = run("swebench-verified", fixtures / "swebench_verified", tmp_path / "v")
    assert res["written"] == 4 and not res["unchanged"]
    m, tasks = load_dataset_dir(tmp_path / "v")
    assert m["role"] == "eval" and m["split"] == "test" and m["file"] == "test.parquet"
    assert all(isinstance(t, RepairTask) for t in tasks) and tasks[0].task_id == "django__django-11099"
    assert tasks[0].fail_to_pass == ["tests/test_x.py::test_f"] and tasks[0].meta["version"] == "3.0"
    assert tasks[-1].eval_type == "pytest"
    assert check(str(tmp_path / "v"))["ok"]


def test_swe_smith_counts_and_separation(fixtures, verified):
    res = run("swe-smith", fixtures / "swe_smith", verified / "swe_smith")
    assert res["counts"] == [["input", 6], ["valid", 6], ["non-empty problem statement", 5],
                             ["dedupe (same patch or instruction)", 4], ["not in evaluation sets", 2]]
    ov = res["overlaps"]
    assert ov["eval_sets"] == [str(verified / "swebench_verified")]
    assert ov["repos"] == ["django/django", "psf/requests"] and ov["removed"] == 2
    _, tasks = load_dataset_dir(verified / "swe_smith")
    assert {t.upstream_repo for t in tasks} == {"pandas-dev/pandas", "gin-gonic/gin"}


def test_keep_eval_repos_still_drops_eval_instances(fixtures, verified, tmp_path):
    # a training row that IS an evaluation instance
    row = json.loads((fixtures / "swebench_verified" / "test.jsonl").read_text().splitlines()[0])
    smith = json.loads((fixtures / "swe_smith" / "train.jsonl").read_text().splitlines()[1])
    smith["instance_id"] = row["instance_id"]
    src = tmp_path / "mixed.jsonl"
    src.write_text((fixtures / "swe_smith" / "train.jsonl").read_text() + json.dumps(smith) + "\n")
    res = run("swe-smith", src, verified / "s", keep_eval_repos=True, dedupe=False)
    assert res["overlaps"]["same_instance"] == 1 and res["overlaps"]["removed"] == 1
    ids = {t.task_id for t in load_dataset_dir(verified / "s")[1]}
    assert "django__django-11099" not in ids and "django__django.4a72da71.func_basic__abc123" in ids


def test_filters_language_include_exclude_limit(fixtures, tmp_path):
    out = tmp_path / "s"
    res = run("swe-smith", fixtures / "swe_smith", out, languages=("Python",), exclude=("django/*",), limit=2)
    steps = [s for s, _ in res["counts"]]
    assert steps == ["input", "valid", "non-empty problem statement", "language python", "exclude django/*",
                     "dedupe (same patch or instruction)", "limit 2"]
    assert [n for _, n in res["counts"]] == [6, 6, 5, 4, 3, 2, 2]
    res = run("swe-smith", fixtures / "swe_smith", out, include=("gin-gonic/*", "swesmith/psf__*"))
    assert res["written"] == 2
    res = run("swe-smith", fixtures / "swe_smith", out, nonempty_statement=False, dedupe=False)
    assert res["written"] == 6


def test_terminal_sources_and_instruction_overlap(fixtures, tmp_path):
    data = tmp_path / "data"
    tb = run("terminal-bench", fixtures / "terminal_bench", data / "terminal_bench")
    assert tb["written"] == 3 and (data / "terminal_bench" / "tasks" / "csv-to-parquet" / "run-tests.sh").is_file()
    res = run("seta-env", fixtures / "seta_env", data / "seta_env")
    # 4 dirs; one repeats another's instruction (dedupe); one repeats a Terminal-Bench instruction (eval)
    assert [n for _, n in res["counts"]] == [4, 4, 3, 2]
    assert res["overlaps"]["same_instance"] == 1
    assert check(str(data / "seta_env"))["ok"] and check(str(data / "terminal_bench"))["ok"]
    assert show(str(data / "seta_env"), rows=1)["rows"][0]["task_id"] == "ask_ubuntu_1042__d1"


def test_eval_set_reports_overlap_with_training_sets(fixtures, tmp_path):
    data = tmp_path / "data"
    run("seta-env", fixtures / "seta_env", data / "seta_env")
    res = run("terminal-bench", fixtures / "terminal_bench", data / "terminal_bench")
    assert res["overlaps"]["train_sets"] == [str(data / "seta_env")]
    assert res["overlaps"]["same_instance"] == 1 and res["written"] == 3  # reported, never removed from an eval set


def test_explicit_eval_set_of_the_wrong_kind(fixtures, verified):
    with pytest.raises(UsageError, match="holds repair tasks"):
        run("seta-env", fixtures / "seta_env", verified / "seta", eval_sets=(str(verified / "swebench_verified"),))


def test_skip_counts_malformed_rows_for_training_sets(fixtures, tmp_path):
    res = run("swe-smith", fixtures / "malformed" / "swe_smith.jsonl", tmp_path / "s")
    assert res["written"] == 1 and res["malformed"]["count"] == 7
    fields = [m["field"] for m in res["malformed"]["first"]]
    assert fields == ["patch", "patch", "FAIL_TO_PASS", "FAIL_TO_PASS", "PASS_TO_PASS", "instance_id", "(line)"]
    assert res["malformed"]["first"][0]["message"].endswith(
        "swe_smith.jsonl:2 (pandas-dev__pandas.95280573.pr_53652): field 'patch': missing")


@pytest.mark.parametrize("source,origin,msg", [
    ("swe-smith", "malformed/swe_smith.jsonl",
     "swe_smith.jsonl:2 (pandas-dev__pandas.95280573.pr_53652): field 'patch'"),
    ("swebench-verified", "malformed/swebench_partial_v5.jsonl", "(django__django-11099): field 'eval_type'"),
    ("terminal-bench", "malformed/tasks", "bad_toml (bad_toml): field 'task.toml'"),
])
def test_fail_stops_and_leaves_nothing(fixtures, tmp_path, source, origin, msg):
    out = tmp_path / "data" / "x"
    with pytest.raises(UsageError) as e:
        run(source, fixtures / origin, out, on_error="fail")
    assert msg in str(e.value)
    assert not (tmp_path / "data").exists()  # stopped before anything was written, temporary folders included


def test_eval_sets_fail_by_default(fixtures, tmp_path):
    with pytest.raises(UsageError, match="field 'FAIL_TO_PASS'"):
        run("swebench-verified", fixtures / "malformed" / "swebench_f2p_bad_json.jsonl", tmp_path / "v")
    assert not (tmp_path / "v").exists()


def test_failed_write_keeps_previous_output(fixtures, tmp_path, monkeypatch):
    out = tmp_path / "v"
    run("swebench-verified", fixtures / "swebench_verified", out)
    before = (out / "manifest.json").read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("tsrl_cli.datasets.prepare.write_tasks", boom)
    with pytest.raises(OSError):
        run("swebench-verified", fixtures / "swebench_verified", out, limit=1)
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]  # no temporary folder left


def test_rerun_is_a_no_op_and_changes_rewrite(fixtures, tmp_path):
    out = tmp_path / "v"
    run("swebench-verified", fixtures / "swebench_verified", out)
    stamp = (out / "manifest.json").stat().st_mtime_ns, (out / "test.parquet").stat().st_mtime_ns
    again = run("swebench-verified", fixtures / "swebench_verified", out)
    assert again["unchanged"] and stamp == ((out / "manifest.json").stat().st_mtime_ns,
                                            (out / "test.parquet").stat().st_mtime_ns)
    assert not run("swebench-verified", fixtures / "swebench_verified", out, limit=2)["unchanged"]
    assert len(read_tasks(out / "test.parquet", "repair")) == 2


def test_check_finds_tampering(fixtures, tmp_path):
    out = tmp_path / "t"
    run("terminal-bench", fixtures / "terminal_bench", out)
    (out / "tasks" / "hello-world" / "tests" / "test.sh").write_text("exit 0\n")
    res = check(str(out))
    assert not res["ok"] and res["problems"] == ["hello-world: tasks/hello-world: content differs from dir_sha256"]
    (out / "test.parquet").write_bytes((out / "test.parquet").read_bytes())  # same bytes: still fine
    (out / "manifest.json").write_text((out / "manifest.json").read_text().replace('"written": 3', '"written": 4'))
    assert any("the manifest says 4" in p for p in check(str(out))["problems"])


def test_incomplete_dataset_is_not_read(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(UsageError, match="no manifest.json"):
        check(str(tmp_path / "half"))


def test_parquet_and_hub_snapshot_layout(fixtures, tmp_path):
    """SWE-smith's real form is parquet with list columns; a hub snapshot keeps it in data/<split>-*.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (fixtures / "swe_smith" / "train.jsonl").read_text().splitlines()]
    snap = tmp_path / "snapshot" / "data"
    snap.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), snap / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), snap / "test-00000-of-00001.parquet")  # not ours: ignored
    res = run("swe-smith", tmp_path / "snapshot", tmp_path / "s")
    jsonl = run("swe-smith", fixtures / "swe_smith", tmp_path / "s2")
    assert res["counts"] == jsonl["counts"]
    assert res["content_sha256"] == jsonl["content_sha256"]  # same records whatever the file format


def test_hub_uses_the_same_code_as_local(fixtures, tmp_path, monkeypatch):
    rows = [json.loads(line) for line in (fixtures / "swebench_verified" / "test.jsonl").read_text().splitlines()]
    calls = []
    fake_datasets = types.SimpleNamespace(
        load_dataset=lambda hub_id, split, revision: calls.append((hub_id, split, revision)) or rows)
    fake_hub = types.SimpleNamespace(
        HfApi=lambda: types.SimpleNamespace(dataset_info=lambda hub_id: types.SimpleNamespace(sha="abc123")),
        snapshot_download=lambda repo_id, repo_type: str(fixtures / "seta_env"),
    )
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake_hub)
    hub = run("swebench-verified", "hub", tmp_path / "hub")
    local = run("swebench-verified", fixtures / "swebench_verified", tmp_path / "local")
    assert calls == [("princeton-nlp/SWE-bench_Verified", "test", "abc123")]
    assert hub["source_revision"] == "abc123" and hub["dataset_id"] == "princeton-nlp/SWE-bench_Verified"
    assert hub["content_sha256"] == local["content_sha256"]
    seta = run("seta-env", "hub", tmp_path / "seta")
    assert seta["dataset_id"] == "camel-ai/SETA-Env" and seta["written"] == 3


def test_hub_unreachable_is_one_line(monkeypatch, tmp_path):
    def offline(hub_id):
        raise ConnectionError("Failed to resolve 'huggingface.co'\nmore detail")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(HfApi=lambda: types.SimpleNamespace(dataset_info=offline)))
    with pytest.raises(UsageError) as e:
        run("swe-smith", "hub", tmp_path / "s")
    assert "cannot load SWE-bench/SWE-smith from the hub (ConnectionError: Failed to resolve" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()


def test_hub_without_datasets_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import raises ImportError
    with pytest.raises(UsageError, match=r"pip install 'tsrl\[hub\]'"):
        run("swe-smith", "hub", tmp_path / "s")


@pytest.mark.parametrize("source,origin,msg", [
    ("terminal-bench", "hub", "has no Hugging Face dataset"),
    ("swe-bench", "hub", "unknown source"),
    ("seta-env", "README.md", "pass a folder"),
    ("seta-env", "/nonexistent", "not found"),
])
def test_bad_source_or_origin(fixtures, tmp_path, source, origin, msg):
    with pytest.raises(UsageError, match=msg):
        prepare(PrepareOptions(source=source, origin=str(fixtures.parent.parent / origin) if origin == "README.md"
                               else origin, out=str(tmp_path / "x")))


@pytest.mark.parametrize("kw,msg", [
    ({"on_error": "ignore"}, "--on-error"), ({"limit": 0}, "--limit"), ({"languages": ("go",)}, "--language"),
])
def test_bad_options(fixtures, tmp_path, kw, msg):
    src = "seta-env" if "languages" in kw else "swe-smith"
    origin = fixtures / ("seta_env" if src == "seta-env" else "swe_smith")
    with pytest.raises(UsageError, match=msg):
        run(src, origin, tmp_path / "x", **kw)


def test_reprepared_eval_set_refreshes_training_manifest(fixtures, verified):
    run("swe-smith", fixtures / "swe_smith", verified / "swe_smith")
    run("swebench-verified", fixtures / "swebench_verified", verified / "swebench_verified", limit=1)  # django only
    res = run("swe-smith", fixtures / "swe_smith", verified / "swe_smith")
    assert not res["unchanged"] and res["overlaps"]["repos"] == ["django/django"] and res["written"] == 3


def test_refuses_to_replace_a_folder_it_did_not_write(fixtures, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not a prepared dataset"):
        run("swebench-verified", fixtures / "swebench_verified", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    assert run("swebench-verified", fixtures / "swebench_verified", tmp_path / "empty")["written"] == 4
