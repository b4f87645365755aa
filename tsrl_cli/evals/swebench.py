"""`tsrl eval swebench`: the training agent loop in each instance's image, graded by the official harness.

Steps, each checked before the next costs anything:
  1. inputs: the prepared dataset (`tsrl prepare-data swebench-verified`), the instances, and the rows
     the harness will grade against;
  2. Docker: the docker CLI answers `docker version` and the Python SDK pings the daemon, else one
     line and exit 2, before any model is loaded;
  3. the swebench package (`pip install -e '.[swebench]'`, major 5);
  4. images: every instance's image must already be on this machine (`docker pull`, or
     `tsrl prepare-data swebench-local` for the local set): nothing is pulled, by the rollouts or by
     the harness, so both run the same image;
  5. rollouts: `--agent policy` runs run_agent in a container of the instance's image (RepairEnv's
     docker executor), commands in /testbed with the image's conda env `testbed` where it has one;
     `--agent oracle` applies the gold patch there instead, `--agent nop` changes nothing (controls
     that need no model). The final diff is `git add -A && git diff --cached --binary <start commit>`
     (the image's HEAD: base_commit plus the harness's setup commit; what mini-swe-agent submits);
  6. predictions.jsonl in SWE-bench's format: instance_id, model_name_or_path, model_patch;
  7. grading: `python -m swebench.harness.run_evaluation` in the output folder (its logs go to
     <out>/logs/run_evaluation/<run_id>/), then its report is read. Only a score the harness
     graded is ever printed.

swebench 5.x grades from the rows themselves: each needs `image`, `eval_script`, `log_parser`,
`eval_type` (the `SWE-bench/SWE-bench_Verified` copy that 5.x reads). Rows with only the classic
columns (`princeton-nlp/SWE-bench_Verified`) cannot be graded by 5.x: pass --harness-dataset with a
dataset the harness can read (a hub id, or a .jsonl/.parquet of 5.x rows) in that case.
`grade_test_log` grades a saved test log through the harness's own parser without Docker.
The harness removes its containers after each instance, never the instance images.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tsrl_cli.agent.loop import AgentLimits, RewardResult
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.devices import engine_device
from tsrl_cli.engines.load import ENGINES, engine_config, open_engine
from tsrl_cli.envs.repair import RepairEnv
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.evals.runner import (
    AGENTS,
    SUMMARY,
    RecordLog,
    agent_tokenizer,
    make_jobs,
    open_out_dir,
    require_docker,
    run_jobs,
    select_instances,
    summarize_eval,
)
from tsrl_cli.files import write_json_atomic, write_jsonl_atomic
from tsrl_cli.sandbox import Limits
from tsrl_cli.sandbox.docker_client import docker_client, image_exists

HARNESS_MAJOR = 5
PREDICTIONS = "predictions.jsonl"
HARNESS_ROWS = "harness_dataset.jsonl"

DATASET_HINT = ("prepare one with `tsrl prepare-data swebench-verified --from PATH` or build the local set with "
                "`tsrl prepare-data swebench-local`")
V5_COLUMNS = ("image", "eval_script", "log_parser", "eval_type")
DEFAULT_LIMITS = AgentLimits(max_turns=50, max_turn_tokens=4096, max_trajectory_tokens=32768, tool_timeout_s=60.0,
                             wall_clock_s=3600.0, max_observation_chars=10000)


class HarnessError(OperationFailed):
    """The official harness ran and failed: nothing was graded (the CLI exits 1)."""


def label(version: str | None, dataset: str, agent: str = "policy") -> str:
    """Names the dataset the run used (a local SWE-bench-format set is not SWE-bench Verified) and the agent."""
    who = {"policy": "tsrl agent loop", "predictions": "predictions from a file"}.get(agent, f"{agent} agent")
    return f"{dataset}: SWE-bench-format instances ({who}; graded by the official swebench {version or '?'} harness)"


def require_swebench() -> str:
    """The installed swebench version, or UsageError saying how to install the pinned major."""
    try:
        import swebench
    except ImportError:
        raise UsageError("grading needs the swebench package: pip install -e '.[swebench]' "
                         f"(swebench {HARNESS_MAJOR}.x), or pass --no-grade to only write predictions") from None
    v = getattr(swebench, "__version__", "?")
    if not v.startswith(f"{HARNESS_MAJOR}."):
        raise UsageError(f"swebench {v} is installed; tsrl grades with swebench {HARNESS_MAJOR}.x "
                         "(pip install -e '.[swebench]')")
    return v


# -- rows and predictions ------------------------------------------------------------------------------------

def harness_row(task) -> dict:
    """A prepared RepairTask as the SWE-bench row it came from (classic columns + 5.x columns)."""
    m = task.meta or {}
    return {
        "instance_id": task.task_id, "repo": task.repo, "base_commit": task.base_ref, "patch": task.gold_patch,
        "test_patch": task.test_patch, "problem_statement": task.problem_statement,
        "hints_text": m.get("hints_text", ""), "created_at": m.get("created_at", ""), "version": m.get("version", ""),
        "environment_setup_commit": m.get("environment_setup_commit", ""),
        "FAIL_TO_PASS": json.dumps(task.fail_to_pass), "PASS_TO_PASS": json.dumps(task.pass_to_pass),
        "image": task.image, "eval_script": task.eval_script, "log_parser": task.log_parser,
        "eval_type": task.eval_type,
    }


def check_row_columns(rows: list[dict], where: str) -> None:
    """UsageError unless every row carries what swebench 5.x grades from (no package needed)."""
    for r in rows:
        missing = [k for k in V5_COLUMNS if not r.get(k)]
        if missing:
            raise UsageError(f"{where}: instance {r['instance_id']} has no {', '.join(missing)}: swebench "
                             f"{HARNESS_MAJOR}.x grades from rows that carry them "
                             "(prepare SWE-bench/SWE-bench_Verified, "
                             "or pass --harness-dataset NAME_OR_FILE)")
        if ">>>>> Start Test Output" not in r["eval_script"] or ">>>>> End Test Output" not in r["eval_script"]:
            raise UsageError(f"{where}: instance {r['instance_id']}: eval_script lacks the harness's test "
                             "output markers")


def check_row_parsers(rows: list[dict], where: str) -> None:
    """UsageError unless every row names a swebench log parser and eval type (needs the package)."""
    from swebench.harness.constants import EvalType
    from swebench.harness.log_parsers import PARSER_REGISTRY

    for r in rows:
        if r["log_parser"] not in PARSER_REGISTRY:
            raise UsageError(f"{where}: instance {r['instance_id']}: log_parser {r['log_parser']!r} is not a swebench "
                             "parser (e.g. parse_log_pytest)")
        if r["eval_type"] not in {e.value for e in EvalType}:
            raise UsageError(f"{where}: instance {r['instance_id']}: eval_type {r['eval_type']!r} is unknown")


def predictions_from_records(records: list[dict], model_name: str) -> list[dict]:
    """One prediction per instance (sample 0 of the first seed): SWE-bench's three keys."""
    return [{"instance_id": r["instance_id"], "model_name_or_path": model_name, "model_patch": r.get("patch") or ""}
            for r in records]


def read_predictions(path: str | Path) -> list[dict]:
    """Predictions from .jsonl or .json (list or {id: prediction}); UsageError naming the line and field."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--grade-only {path}: no such file")
    if p.suffix not in (".jsonl", ".json"):
        raise UsageError(f"--grade-only {path}: the harness reads .jsonl or .json predictions")
    try:
        if p.suffix == ".json":
            doc = json.loads(p.read_text())
            preds = list(doc.values()) if isinstance(doc, dict) else doc
            where = [f"{p}: entry {i}" for i in range(len(preds))] if isinstance(preds, list) else []
        else:
            lines = [(i, ln) for i, ln in enumerate(p.read_text().splitlines(), 1) if ln.strip()]
            preds, where = [json.loads(ln) for _, ln in lines], [f"{p}:{i}" for i, _ in lines]
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(preds, list) or not preds:
        raise UsageError(f"{p}: no predictions")
    seen = set()
    for w, pr in zip(where, preds, strict=True):
        if not isinstance(pr, dict):
            raise UsageError(f"{w}: a prediction must be an object")
        for k in ("instance_id", "model_name_or_path"):
            if not isinstance(pr.get(k), str) or not pr[k]:
                raise UsageError(f"{w}: field {k!r}: missing or not a string")
        if pr.get("model_patch") is not None and not isinstance(pr["model_patch"], str):
            raise UsageError(f"{w}: field 'model_patch': not a string")
        if pr["instance_id"] in seen:
            raise UsageError(f"{w}: instance {pr['instance_id']} predicted twice")
        seen.add(pr["instance_id"])
    if len({pr["model_name_or_path"] for pr in preds}) > 1:
        raise UsageError(f"{p}: several model_name_or_path values; the harness reports one model per run")
    return preds


# -- grading -------------------------------------------------------------------------------------------------

def harness_command(dataset_name: str, predictions: Path, run_id: str, out_dir: Path, *, workers: int = 4,
                    timeout_s: int = 1800, instance_ids: list[str] | None = None) -> list[str]:
    """The official harness's command line (swebench 5.x `run_evaluation` flags), run with cwd = out_dir."""
    cmd = [sys.executable, "-m", "swebench.harness.run_evaluation", "--dataset_name", dataset_name, "--split", "test",
           "--predictions_path", str(Path(predictions).resolve()), "--max_workers", str(workers), "--run_id", run_id,
           "--timeout", str(timeout_s), "--report_dir", str(Path(out_dir).resolve())]
    return cmd + (["--instance_ids", *instance_ids] if instance_ids else [])


def report_path(out_dir: Path, model_name: str, run_id: str) -> Path:
    """Where make_run_report writes: <report_dir>/<model_name_or_path, / as __>.<run_id>.json."""
    return Path(out_dir) / f"{model_name.replace('/', '__')}.{run_id}.json"


def grade(predictions: Path, dataset_name: str, out_dir: Path, *, run_id: str, workers: int = 4,
          timeout_s: int = 1800, instance_ids: list[str] | None = None,
          progress: Callable[[str], None] = lambda m: None) -> dict:
    """Run the official harness on a predictions file; return its run report (resolved_ids, ...).

    The harness's own output goes to <out>/harness.log; its per-instance logs to <out>/logs/.
    """
    preds = read_predictions(predictions)
    cmd = harness_command(dataset_name, predictions, run_id, out_dir, workers=workers, timeout_s=timeout_s,
                          instance_ids=instance_ids)
    progress(f"grading {len(preds)} prediction(s) with the swebench harness (log: {Path(out_dir) / 'harness.log'})")
    with open(Path(out_dir) / "harness.log", "ab") as logf:
        logf.write(("$ " + shlex.join(cmd) + "\n").encode())
        logf.flush()
        rc = subprocess.run(cmd, check=False, cwd=out_dir, stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL).returncode
    rep = report_path(out_dir, preds[0]["model_name_or_path"], run_id)
    if rc != 0 or not rep.is_file():
        raise HarnessError(f"the swebench harness failed (exit code {rc}, no report at {rep}); see "
                           f"{Path(out_dir) / 'harness.log'}. Nothing was graded")
    return json.loads(rep.read_text())


def grade_test_log(row: dict, prediction: dict, log_path: str | Path) -> dict:
    """Grade one saved test log (the harness's test_output.txt) with swebench's own parser and rules.

    No Docker: this is `swebench.harness.grading.get_eval_report` on `make_test_spec(row)`.
    Returns the per-instance report: patch_exists, patch_successfully_applied, resolved, tests_status.
    """
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(row)
    return get_eval_report(spec, prediction, str(log_path), include_tests_status=True)[prediction["instance_id"]]


def summary_from_report(report: dict, instance_ids: list[str], dataset: str, label_: str) -> dict:
    """Resolved rate over the instances we predicted (empty patches and harness errors count as
    unresolved, as in SWE-bench), with the harness's own counts kept beside it."""
    resolved = set(report.get("resolved_ids", []))
    records = [{"dataset": dataset, "instance_id": i, "sample": 0, "seed": 0, "resolved": i in resolved,
                "reward": float(i in resolved)} for i in instance_ids]
    s = summarize_eval(records, label=label_, datasets=[dataset])
    s["harness"] = {k: report.get(k) for k in ("total_instances", "submitted_instances", "completed_instances",
                                                 "resolved_instances", "unresolved_instances", "empty_patch_instances",
                                                 "error_instances", "infra_failure_instances", "error_ids",
                                                 "schema_version")}
    return s


# -- the environment -----------------------------------------------------------------------------------------

class SWEbenchEnv(RepairEnv):
    """RepairEnv's docker executor (start state checked out in /testbed, PRELUDE before every command,
    play_oracle); grading is the harness's job, not this env's."""

    def __init__(self, task, *, limits: Limits | None = None):
        super().__init__(task, executor="docker", limits=limits)

    async def reward(self) -> RewardResult:
        return RewardResult(0.0, "graded by the swebench harness", {"graded": False})

    async def patch(self) -> str:
        """The prediction: the whole final diff (the harness, not tsrl, decides what counts)."""
        return (await asyncio.to_thread(self.final_diff))[1]


def missing_images(images: list[str]) -> list[str]:
    """The images this machine's Docker daemon does not have, in the given order, once each."""
    client = docker_client(60, "tsrl eval swebench")
    try:
        return [image for image in dict.fromkeys(images) if not image_exists(client, image)]
    finally:
        client.close()


def require_images(images: list[str], where: str) -> None:
    """UsageError unless every image is here: neither the rollouts nor the harness may pull one."""
    missing = missing_images(images)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UsageError(f"{where}: image {missing[0]}{more} is not on this machine, and tsrl pulls nothing (the "
                         f"harness would, unchecked): `docker pull {missing[0]}` where a registry is reachable, or "
                         "`tsrl prepare-data swebench-local` for the local set's images")


async def _swebench_patch(env: SWEbenchEnv, job) -> str:
    return await env.patch()


# -- the command ---------------------------------------------------------------------------------------------

def run_swebench(model: str | None, *, engine: str = "vllm", dataset: str = "data/swebench_verified",
                 instances: list[str] | None = None, workers: int = 4, temperature: float = 0.0,
                 max_turns: int | None = None, out_dir: str | Path | None = None, grade_only: str | None = None,
                 harness_dataset: str | None = None, no_grade: bool = False, timeout_s: int = 1800,
                 agent: str = "policy", device: str | None = None, chat_template: str = "auto",
                 thinking: bool = False, progress: Callable[[str], None] = lambda m: None) -> dict:
    """`tsrl eval swebench`: rollouts -> predictions.jsonl -> official harness -> summary (see module docstring).

    The policy's engine (`engine` hf or vllm) opens on `device` (None: the first GPU where there is one,
    else cpu) once Docker, the harness and the images are there, before anything is written."""
    if grade_only is not None:
        return _grade_only(grade_only, dataset, harness_dataset, out_dir, workers, timeout_s, instances, progress)
    if agent not in AGENTS:
        raise UsageError(f"--agent {agent!r}: use one of {', '.join(AGENTS)}")
    if agent == "policy" and not model:
        raise UsageError("--model DIR_OR_ID is required (or --agent oracle|nop, or --grade-only PREDICTIONS)")
    if agent != "policy" and model:
        raise UsageError(f"--agent {agent} needs no model: drop --model {model}")
    if workers < 1:
        raise UsageError(f"--workers {workers}: must be >= 1")
    if agent == "policy" and engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    dev = engine_device(device) if agent == "policy" else None

    ds = open_dataset(dataset, hint=DATASET_HINT)
    if any(t.kind != "repair" for t in ds.tasks):
        raise UsageError(f"{dataset}: not a repair dataset")
    ds = replace(ds, tasks=select_instances(ds.tasks, instances, dataset))
    name, tasks = ds.name, ds.tasks
    model_name = model if agent == "policy" else f"tsrl-{agent}"  # model_name_or_path of the predictions
    out = Path(out_dir) if out_dir is not None else Path("results/eval") / f"swebench-{Path(model_name).name}"
    rows = None if (no_grade or harness_dataset) else [harness_row(t) for t in tasks]
    if rows:
        check_row_columns(rows, dataset)  # before Docker: a fix the user can make anywhere
    require_docker("tsrl eval swebench")  # before any model is loaded
    version = None if no_grade else require_swebench()
    if rows:
        check_row_parsers(rows, dataset)
    require_images([t.image for t in tasks], dataset)

    limits = DEFAULT_LIMITS if max_turns is None else AgentLimits(**{**DEFAULT_LIMITS.__dict__, "max_turns": max_turns})
    pol, tok = None, None
    if agent == "policy":
        tok = agent_tokenizer(model, chat_template, thinking)
        pol, _ = open_engine(model, engine, (dev,))
    engines = engine_config(pol) if pol is not None else {"engine": "none", "dtype": None, "device": None}
    config = {"model": model_name, **engines, "temperature": temperature, "top_p": 1.0,
              "limits": dict(limits.__dict__), "executor": "docker", "label": label(version, name, agent)}
    log = open_out_dir(out, config)
    harness_ds = harness_dataset
    if rows:
        write_jsonl_atomic(out / HARNESS_ROWS, rows)
        harness_ds = str((out / HARNESS_ROWS).resolve())
    t0 = time.perf_counter()
    jobs = make_jobs([ds], samples=1, seeds=(0,))
    records = run_jobs(pol, tok, jobs, make_env=lambda j: SWEbenchEnv(j.task), collect_patch=_swebench_patch,
                       temperature=temperature, limits=limits, concurrency=workers, max_batch=max(8, workers),
                       log=log, progress=progress, agent=agent, chat_template=chat_template, thinking=thinking)
    preds = predictions_from_records([r for r in records if not r.get("error")], model_name)
    write_jsonl_atomic(out / PREDICTIONS, preds)
    base = {"config": config, "out": str(out), "predictions": str(out / PREDICTIONS), "wall_s": None,
            "errors": [r["instance_id"] for r in records if r.get("error")]}
    if no_grade or not preds:
        s = summarize_eval(records, label=label(version, name, agent), datasets=[name])
        s.update(base, graded=False, wall_s=round(time.perf_counter() - t0, 1))
        write_json_atomic(out / SUMMARY, s, sort_keys=True)
        return s
    report = grade(out / PREDICTIONS, harness_ds, out, run_id=out.name,
                   workers=workers, timeout_s=timeout_s, instance_ids=[p["instance_id"] for p in preds],
                   progress=progress)
    resolved = set(report.get("resolved_ids", []))
    for r in records:
        if not r.get("error"):
            r["resolved"], r["reward"] = r["instance_id"] in resolved, float(r["instance_id"] in resolved)
    _rewrite_graded(log, records)
    s = summarize_eval(records, label=label(version, name, agent), datasets=[name])
    s.update(base, graded=True, harness={k: report.get(k) for k in ("resolved_instances", "unresolved_instances",
                                                                      "empty_patch_instances", "error_instances",
                                                                      "error_ids", "schema_version")},
             wall_s=round(time.perf_counter() - t0, 1))
    write_json_atomic(out / SUMMARY, s, sort_keys=True)
    return s


def _rewrite_graded(log: RecordLog, records: list[dict]) -> None:
    """records.jsonl with `resolved` from the harness (other records in the file kept as they were)."""
    by_key = {(r["dataset"], r["instance_id"], r["sample"], r["seed"]): r for r in records}
    old = log.load()
    log.rewrite([by_key.get((r["dataset"], r["instance_id"], r["sample"], r["seed"]), r) for r in old])


def _grade_only(predictions: str, dataset: str, harness_dataset: str | None, out_dir, workers: int, timeout_s: int,
                instances, progress) -> dict:
    """Grade a predictions file against the rows of the prepared `dataset`, or against `harness_dataset`
    (a hub id, or a .jsonl/.json/.parquet file of swebench 5.x rows) when given."""
    preds = read_predictions(predictions)
    if instances:
        preds = [p for p in preds if p["instance_id"] in set(instances)]
        if not preds:
            raise UsageError(f"--instances: none of them is in {predictions}")
    out = Path(out_dir) if out_dir is not None else Path("results/eval") / f"swebench-grade-{Path(predictions).stem}"
    rows = images = None
    if harness_dataset is None:  # a prepared tsrl dataset: hand the harness its rows
        by_id = {t.task_id: t for t in open_dataset(dataset, hint=DATASET_HINT).tasks}
        unknown = [p["instance_id"] for p in preds if p["instance_id"] not in by_id]
        if unknown:
            raise UsageError(f"{predictions}: instance {unknown[0]} is not in {dataset}; grade it against the "
                             "dataset it was predicted on (--dataset DIR)")
        rows = [harness_row(by_id[p["instance_id"]]) for p in preds]
        check_row_columns(rows, dataset)
        images = [r["image"] for r in rows]
    elif Path(harness_dataset).suffix in (".jsonl", ".json", ".parquet") and not Path(harness_dataset).is_file():
        raise UsageError(f"--harness-dataset {harness_dataset}: no such file (a hub id, "
                         "or a file of swebench 5.x rows)")
    require_docker("tsrl eval swebench --grade-only")
    version = require_swebench()
    if images is None and Path(harness_dataset).suffix in (".jsonl", ".json"):
        from swebench.harness.utils import load_swebench_dataset

        ids = {p["instance_id"] for p in preds}
        images = [r["image"] for r in load_swebench_dataset(harness_dataset)
                  if r["instance_id"] in ids and r.get("image")]
    if images:  # a hub dataset is fetched by the harness, its images with it: that run is online anyway
        require_images(images, harness_dataset or dataset)
    out.mkdir(parents=True, exist_ok=True)
    harness_ds = harness_dataset
    if rows:
        check_row_parsers(rows, dataset)
        write_jsonl_atomic(out / HARNESS_ROWS, rows)
        harness_ds = str((out / HARNESS_ROWS).resolve())
    sub = out / PREDICTIONS
    if Path(predictions).resolve() != sub.resolve():
        write_jsonl_atomic(sub, preds)
    t0 = time.perf_counter()
    report = grade(sub, harness_ds, out, run_id=out.name, workers=workers, timeout_s=timeout_s,
                   instance_ids=[p["instance_id"] for p in preds], progress=progress)
    name = Path(dataset).name if Path(dataset).is_dir() else dataset
    s = summary_from_report(report, [p["instance_id"] for p in preds], name, label(version, name, "predictions"))
    s.update(out=str(out), predictions=str(sub), graded=True, wall_s=round(time.perf_counter() - t0, 1))
    write_json_atomic(out / SUMMARY, s, sort_keys=True)
    return s
