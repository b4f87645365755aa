"""`tsrl eval swebench` end to end on the local SWE-bench-format set (tsrl_cli/embedded/swebench_set.py):
its images built here, the agent's containers, and grading by swebench's own `run_evaluation`, offline.

The grader is checked with controls: the gold patches resolve and the empty and PASS_TO_PASS-breaking
patches do not, each read from the harness's own per-instance report. Skipped, with the reason, where no
Docker daemon answers (CI sets TSRL_REQUIRE_DOCKER=1: then a failure).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app

pytest.importorskip("swebench", reason="swebench is not installed (pip install -e '.[swebench]')")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_set(docker_base_image, tmp_path_factory):
    """The prepared set and its build (shared with tests/envs/test_repair_docker.py: the same folder, so the
    second build in a session finds it and keeps it)."""
    from tsrl_cli.embedded.swebench_set import prepare_swebench_local

    out = tmp_path_factory.getbasetemp() / "swebench_local"
    res = prepare_swebench_local(out)
    return {"out": out, **res["build"], "ids": sorted(res["build"]["images"])}


def cli(*args: str) -> dict:
    res = CliRunner().invoke(app, ["eval", "swebench", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def instance_reports(out: Path) -> dict[str, dict]:
    """{instance_id: the harness's report.json entry} of every instance the harness ran in `out`."""
    return {p.parent.name: json.loads(p.read_text())[p.parent.name]
            for p in out.glob("logs/run_evaluation/*/*/*/report.json")}


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_gold_patches_resolve_offline_and_the_images_stay(local_set, tmp_path):
    import docker

    s = cli("--grade-only", local_set["controls"]["gold"], "--dataset", str(local_set["out"]), "--out",
            str(tmp_path / "gold"), "--workers", "3")
    assert s["datasets"]["swebench_local"]["resolved"] == 3 and s["harness"]["resolved_instances"] == 3
    reps = instance_reports(tmp_path / "gold")
    assert sorted(reps) == local_set["ids"]
    assert all(r["resolved"] and r["patch_successfully_applied"] for r in reps.values())
    logs = list((tmp_path / "gold").glob("logs/run_evaluation/*/*/*/run_instance.log"))
    assert len(logs) == 3 and not any("attempting to pull" in p.read_text() for p in logs)  # nothing pulled
    client = docker.from_env()
    try:
        for tag in local_set["images"].values():
            client.images.get(tag)  # ImageNotFound if the harness's clean-up had removed it
    finally:
        client.close()


def test_empty_and_pass_to_pass_breaking_patches_do_not_resolve(local_set, tmp_path):
    """One harness run: the first instance with the empty patch, the others with their break_p2p patch."""
    ids = local_set["ids"]
    empty = {p["instance_id"]: p for p in read_jsonl(local_set["controls"]["empty"])}
    brk = {p["instance_id"]: p for p in read_jsonl(local_set["controls"]["break_p2p"])}
    preds = [{**empty[ids[0]], "model_name_or_path": "mixed"}]
    preds += [{**brk[i], "model_name_or_path": "mixed"} for i in ids[1:]]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    s = cli("--grade-only", str(tmp_path / "mixed.jsonl"), "--dataset", str(local_set["out"]), "--out",
            str(tmp_path / "mixed"), "--workers", "2")
    assert s["datasets"]["swebench_local"]["resolved"] == 0 and s["datasets"]["swebench_local"]["n"] == 3
    assert s["harness"]["empty_patch_instances"] == 1 and s["harness"]["unresolved_instances"] == 2
    reps = instance_reports(tmp_path / "mixed")
    assert sorted(reps) == ids[1:]  # the harness runs no container for an empty patch
    for i in ids[1:]:
        st = reps[i]["tests_status"]
        assert reps[i]["patch_successfully_applied"] and not reps[i]["resolved"]
        assert st["FAIL_TO_PASS"]["failure"] == []  # the bug is fixed ...
        assert sorted(st["PASS_TO_PASS"]["failure"]) == sorted(local_set["break_p2p_fails"][i])  # ... another added


def test_agent_oracle_resolves_and_nop_does_not(local_set, tmp_path):
    """The agent path (containers per instance, predictions, harness), with the two controls as the agent."""
    ids = local_set["ids"][:2]
    oracle = cli("--agent", "oracle", "--dataset", str(local_set["out"]), "--instances", ",".join(ids), "--out",
                 str(tmp_path / "oracle"), "--workers", "2")
    d = oracle["datasets"]["swebench_local"]
    assert (d["n"], d["resolved"], d["errors"]) == (2, 2, 0), oracle
    assert oracle["label"].startswith("swebench_local: SWE-bench-format instances (oracle agent;")  # not "SWE-bench"
    gold = {p["instance_id"]: p["model_patch"] for p in read_jsonl(local_set["controls"]["gold"])}
    preds = read_jsonl(tmp_path / "oracle" / "predictions.jsonl")
    assert {p["model_name_or_path"] for p in preds} == {"tsrl-oracle"}
    def strip(diff: str) -> list[str]:  # index lines name blobs, abbreviated to a length git chooses
        return [ln for ln in diff.splitlines() if not ln.startswith("index ")]

    for p in preds:  # the container's diff is the gold patch
        assert strip(p["model_patch"]) == strip(gold[p["instance_id"]])

    nop = cli("--agent", "nop", "--dataset", str(local_set["out"]), "--instances", ids[0], "--out",
              str(tmp_path / "nop"))
    d = nop["datasets"]["swebench_local"]
    assert (d["n"], d["resolved"], d["errors"]) == (1, 0, 0) and nop["harness"]["empty_patch_instances"] == 1
    assert read_jsonl(tmp_path / "nop" / "predictions.jsonl")[0]["model_patch"] == ""


def test_a_missing_image_is_refused_before_anything_runs(local_set, tmp_path):
    from tsrl_cli.datasets.prepare import PrepareOptions, prepare

    rows = read_jsonl(local_set["rows"])
    rows[0]["image"] = "tsrl-local/sweb.eval.x86_64.none:000000000000"
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(PrepareOptions(source="swebench-verified", origin=str(tmp_path / "rows.jsonl"), out=str(tmp_path / "ds")))
    res = CliRunner().invoke(app, ["eval", "swebench", "--agent", "nop", "--dataset", str(tmp_path / "ds"),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "none:000000000000 is not on this machine" in res.stderr, res.output
    assert not (tmp_path / "out" / "records.jsonl").exists()
