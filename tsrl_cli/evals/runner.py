"""Run the training agent loop on evaluation instances with any engine: records, resume, summary.

The agent loop is the one training uses (agent/loop.py::run_agent), batched through the batcher
training uses (engines/batching.py make_batcher), as `tsrl policy probe` is. What changes between the
embedded suite, Terminal-Bench and SWE-bench is only the environment factory (`make_env(job)`) and
the patch collector.

Output folder (results/eval/<name>/):
  config.json    the settings that make records comparable (model, engine and its dtype, sampling,
                 limits, executor; the device is recorded too). A re-run with other settings is
                 refused rather than mixed in.
  records.jsonl  one JSON line per finished instance x sample x seed, each written with one
                 write() and flushed as it finishes; a line torn by a crash is dropped on resume.
  summary.json   resolved rate, n and Wilson 95 % interval per dataset (and per seed when there are
                 several), written to a temporary file and renamed into place.
Resume: a job whose key (dataset, instance_id, sample, seed) has a record is not run again, except
when that record is an environment error (the sandbox or container failed, not the model).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsrl_cli.agent.loop import AgentLimits, run_agent
from tsrl_cli.agent.template import make_renderer
from tsrl_cli.datasets.store import Dataset
from tsrl_cli.engines.batching import make_batcher
from tsrl_cli.engines.protocol import SamplingParams
from tsrl_cli.errors import UsageError
from tsrl_cli.evals.stats import wilson_interval
from tsrl_cli.files import write_json_atomic, write_jsonl_atomic
from tsrl_cli.policy import load_tokenizer
from tsrl_cli.sandbox.docker_client import docker_unavailable_reason as sdk_reason

RECORDS, SUMMARY, CONFIG = "records.jsonl", "summary.json", "config.json"
# Settings that change what a record means: a resumed run must use the same ones.
# The device is recorded beside them but may change (resume on another machine); the dtype may not.
CONFIG_KEYS = ("model", "model_sha256", "engine", "dtype", "temperature", "top_p", "limits", "executor", "label")
DEFAULT_LIMITS = AgentLimits()  # the limits the embedded policy is trained with
AGENTS = ("policy", "oracle", "nop")  # the model; the task's reference solution; no action (Harbor's names)


@dataclass(frozen=True)
class Job:
    """One trajectory to run: a task of a dataset, sample index k, sampling seed."""

    dataset: str  # name in the summary and metrics (the dataset folder's name)
    dataset_dir: Path
    task: Any  # RepairTask | TerminalTask
    sample: int
    seed: int

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.dataset, self.task.task_id, self.sample, self.seed)


def record_key(rec: dict) -> tuple[str, str, int, int]:
    return (rec["dataset"], rec["instance_id"], int(rec["sample"]), int(rec["seed"]))


def make_jobs(datasets: Iterable[Dataset], samples: int = 1, seeds: Iterable[int] = (0,)) -> list[Job]:
    """Every (task, sample, seed) of the datasets, dataset by dataset, in task order."""
    if samples < 1:
        raise UsageError(f"--samples {samples}: must be >= 1")
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seed {seeds}: give one or more distinct seeds")
    return [Job(ds.name, ds.path, t, k, s) for ds in datasets for s in seeds for t in ds.tasks
            for k in range(samples)]


# -- files -----------------------------------------------------------------------------------------------------

class RecordLog:
    """records.jsonl: append-only; the last record of a key wins when read back."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> list[dict]:
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a crash mid-write left a torn last line: drop it, its job runs again
            with open(self.path, "r+b") as f:
                f.truncate(end)
        latest: dict[tuple, dict] = {}
        for i, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                latest[record_key(rec)] = rec
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise UsageError(f"{self.path}:{i}: not an evaluation record; "
                                 "move the file away to start over") from None
        return list(latest.values())

    def append(self, rec: dict) -> None:
        line = (json.dumps(rec, sort_keys=True, default=str) + "\n").encode()
        with open(self.path, "ab") as f:  # one write per record: a crash tears at most the last line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def rewrite(self, records: list[dict]) -> None:
        """Replace the whole file (e.g. after grading filled in `resolved`), via temp + rename."""
        write_jsonl_atomic(self.path, records, sort_keys=True)


def open_out_dir(out_dir: str | Path, config: dict) -> RecordLog:
    """Create the output folder, or check that an existing one was run with the same settings."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / CONFIG
    if cfg_path.is_file():
        old = json.loads(cfg_path.read_text())
        diff = [k for k in CONFIG_KEYS
                if json.dumps(old.get(k), sort_keys=True) != json.dumps(config.get(k), sort_keys=True)]
        if diff:
            k = diff[0]
            raise UsageError(f"{out} holds records made with other settings ({k}: "
                             f"{old.get(k)!r}, now {config.get(k)!r}); "
                             "pass another --out, or delete that folder to start over")
    write_json_atomic(cfg_path, config, sort_keys=True)
    return RecordLog(out / RECORDS)


def agent_tokenizer(model: str, chat_template: str = "auto", thinking: bool = False):
    """The tokenizer of a policy directory or hub id, checked that the agent can talk to it in the chat
    format of --chat-template and --thinking (agent/template.py make_renderer): called before any output
    is written, so a policy the agent cannot talk to fails first. The engine itself comes from
    engines/load.py open_engine."""
    tok = load_tokenizer(model)
    make_renderer(tok, chat_template, thinking, flags=True)
    return tok


# -- running ---------------------------------------------------------------------------------------------------

def _failure(exit_reason: str, resolved: bool | None, reason: str) -> str | None:
    if resolved:
        return None
    if exit_reason == "submitted":
        return reason or "not resolved"
    return f"{exit_reason}; {reason}" if reason else exit_reason


def run_jobs(
    engine,
    tokenizer,
    jobs: list[Job],
    *,
    make_env: Callable[[Job], Any],
    collect_patch: Callable[[Any, Job], Awaitable[str | None]] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    limits: AgentLimits | Callable[[Job], AgentLimits] = DEFAULT_LIMITS,
    concurrency: int = 16,
    max_batch: int = 16,
    log: RecordLog | None = None,
    progress: Callable[[str], None] | None = None,
    agent: str = "policy",
    chat_template: str = "auto",
    thinking: bool = False,
) -> list[dict]:
    """Run every job that has no record yet; return the records of all `jobs`, in job order.

    `engine` is any PolicyEngine (hf, vllm, scripted); one batcher (engines/batching.py make_batcher: continuous
    for hf and vllm) serves all sessions, at most `max_batch` turns in the engine at once.
    `agent`: "policy" (the engine plays), or the controls Harbor names: "oracle" (the env's
    `play_oracle()`: the task's reference solution) and "nop" (nothing); engine and tokenizer may be
    None for those. The reward and the patch come from the same env code in every case.
    `chat_template`, `thinking`: the chat format (agent/template.py make_renderer); each policy record holds
    its label as `chat_format` and its `tool_call_errors` (turns whose call could not run), and records
    of another format in `log` are refused rather than mixed in (records without one are ChatML's).
    An environment that cannot start with a UsageError (no isolation, no image) stops the run.
    Any other environment failure is recorded with `error: true` and is retried on resume.
    """
    previous = {record_key(r): r for r in (log.load() if log else [])}
    todo = [j for j in jobs if j.key not in previous or previous[j.key].get("error")]
    results: dict[tuple, dict] = {j.key: previous[j.key] for j in jobs if j.key in previous}
    if agent not in AGENTS:
        raise UsageError(f"--agent {agent!r}: use one of {', '.join(AGENTS)}")
    limits_for = limits if callable(limits) else (lambda job: limits)
    renderer = make_renderer(tokenizer, chat_template, thinking) if agent == "policy" else None
    made = {r.get("chat_format", "chatml") for r in previous.values()  # a record older than the key is ChatML's
            if not r.get("error") and r.get("exit_reason") not in ("oracle", "nop")} - {None}
    if renderer is not None and made - {renderer.label}:
        raise UsageError(f"{log.path.parent} holds records made in chat format {min(made - {renderer.label})}, "
                         f"now {renderer.label}; pass another --out, or delete that folder to start over")

    def report() -> None:
        if progress is None:
            return
        recs = list(results.values())
        graded = [r for r in recs if r.get("resolved") is not None]
        if graded or not recs:
            tail = f"resolved {sum(bool(r['resolved']) for r in graded)}/{len(graded)}"
        else:  # SWE-bench: graded later by the harness
            tail = f"non-empty patches {sum(bool(r.get('patch')) for r in recs)}/{len(recs)}"
        progress(f"evaluated {len(recs)}/{len(jobs)} ({tail})")

    async def one(job: Job, batcher, sem: asyncio.Semaphore) -> None:
        async with sem:
            t0 = time.monotonic()
            env = make_env(job)
            rec = {"dataset": job.dataset, "instance_id": job.task.task_id, "sample": job.sample, "seed": job.seed,
                   "kind": job.task.kind, "patch": None, "error": False,
                   "chat_format": renderer.label if renderer is not None else None}
            try:
                await env.start()
                if agent == "policy":
                    res = await run_agent(
                        env, batcher.generate, renderer, group_id=job.task.task_id, sample_index=job.sample,
                        sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=job.seed),
                        limits=limits_for(job), seed_key=("eval", job.dataset, job.task.task_id, job.sample),
                    )
                    reward, exit_reason = res.reward, res.exit_reason
                    played = {"turns": res.num_turns, "tokens": len(res.rollout.input_ids),
                              "loss_tokens": sum(res.rollout.loss_mask),
                              "tool_s": round(sum(e["duration_s"] for e in res.events if e["event"] == "tool"), 3),
                              "tool_call_errors": len(res.tool_call_errors),
                              "tool_call_error_kinds": dict(Counter(res.tool_call_errors))}
                else:  # a control: the reference solution or nothing, scored by the same env code
                    c0 = time.monotonic()
                    if agent == "oracle":
                        await env.play_oracle()
                    played = {"turns": 0, "tokens": 0, "loss_tokens": 0, "tool_s": round(time.monotonic() - c0, 3),
                              "tool_call_errors": 0, "tool_call_error_kinds": {}}
                    reward, exit_reason = await env.reward(), agent
                if collect_patch is not None:
                    rec["patch"] = await collect_patch(env, job)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - the sandbox or container failed: recorded, retried on resume
                rec.update(reward=None, resolved=False, turns=0, tokens=0, loss_tokens=0, tool_s=0.0, error=True,
                           exit_reason="env_error", reward_reason="", failure=f"env_error: {type(e).__name__}: {e}")
            else:
                graded = reward.details.get("graded", True)
                resolved = bool(reward.details.get("resolved", reward.reward >= 1.0)) if graded else None
                rec.update(
                    reward=float(reward.reward) if graded else None, resolved=resolved, **played,
                    exit_reason=exit_reason, reward_reason=reward.reason,
                    failure=(_failure("submitted" if agent != "policy" else exit_reason, resolved, reward.reason)
                             if graded else None),
                )
            finally:
                await env.close()
            rec["duration_s"] = round(time.monotonic() - t0, 3)
        if log is not None:
            log.append(rec)
        results[job.key] = rec
        report()

    async def main() -> None:
        batcher = make_batcher(engine, max_batch) if agent == "policy" else None
        try:
            sem = asyncio.Semaphore(concurrency)
            await asyncio.gather(*(one(j, batcher, sem) for j in todo))
        finally:
            if batcher is not None:
                batcher.close()

    report()
    if todo:
        asyncio.run(main())
    return [results[j.key] for j in jobs]


# -- summary ---------------------------------------------------------------------------------------------------

def _part(recs: list[dict]) -> dict:
    graded = [r for r in recs if r.get("resolved") is not None and not r.get("error")]
    n, k = len(graded), sum(bool(r["resolved"]) for r in graded)
    low, high = wilson_interval(k, n)
    rewards = [r["reward"] for r in graded if r.get("reward") is not None]
    reasons: dict[str, int] = {}
    for r in recs:
        key = str(r.get("exit_reason", "?")).split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "n": n, "resolved": k, "success": round(k / n, 6) if n else None,
        "ci95_low": round(low, 6), "ci95_high": round(high, 6),
        "mean_reward": round(sum(rewards) / len(rewards), 6) if rewards else None,
        "mean_turns": round(sum(r.get("turns", 0) for r in recs) / len(recs), 3) if recs else None,
        "mean_tokens": round(sum(r.get("tokens", 0) for r in recs) / len(recs), 1) if recs else None,
        "tool_call_errors": sum(r.get("tool_call_errors", 0) for r in recs),
        "errors": sum(bool(r.get("error")) for r in recs),
        "ungraded": sum(r.get("resolved") is None and not r.get("error") for r in recs),
        "exit_reasons": dict(sorted(reasons.items())),
    }


def summarize_eval(records: list[dict], *, label: str, datasets: list[str]) -> dict:
    """Resolved rate, n and Wilson 95 % interval per dataset, per seed when several, and overall.

    n counts graded trajectories (instance x sample x seed); environment errors and ungraded
    records are left out of n and counted apart, so they can never pass for failures or successes.
    """
    out = {"label": label, "datasets": {}}
    for name in datasets:
        recs = [r for r in records if r["dataset"] == name]
        part = _part(recs)
        seeds = sorted({r["seed"] for r in recs})
        if len(seeds) > 1:
            part["per_seed"] = {str(s): _part([r for r in recs if r["seed"] == s]) for s in seeds}
        out["datasets"][name] = part
    out["all"] = _part(records)
    out["metrics"] = eval_metrics(out)
    return out


def eval_metrics(summary: dict) -> dict[str, float]:
    """Flat metrics for a training run's metrics.jsonl: eval/<dataset>/{success,n,ci95_low,ci95_high}."""
    m: dict[str, float] = {}
    for name, d in summary["datasets"].items():
        m[f"eval/{name}/success"] = d["success"] if d["success"] is not None else float("nan")
        m[f"eval/{name}/n"] = d["n"]
        m[f"eval/{name}/ci95_low"] = d["ci95_low"]
        m[f"eval/{name}/ci95_high"] = d["ci95_high"]
    return m


# -- Docker ----------------------------------------------------------------------------------------------------

def docker_unavailable_reason(timeout_s: float = 20.0) -> str | None:
    """None when the docker CLI is on PATH and a daemon answers it and the Python SDK; else why not."""
    exe = shutil.which("docker")
    if exe is None:
        return "the docker CLI is not on PATH"
    try:
        r = subprocess.run([exe, "version", "--format", "{{.Server.Version}}"], check=False, capture_output=True,
                           text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"`docker version` got no answer from the daemon within {timeout_s:.0f} s"
    if r.returncode != 0 or not r.stdout.strip():
        lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
        return f"no Docker daemon reachable ({lines[-1] if lines else f'docker version exited {r.returncode}'})"

    return sdk_reason()  # the sandbox and the swebench harness talk to the daemon through the SDK


def require_docker(what: str) -> None:
    reason = docker_unavailable_reason()
    if reason:
        raise UsageError(f"{what} needs Docker, and it is not available here: {reason}. Nothing was run or graded; "
                         "run it where a Docker daemon answers (`docker info`)")


def select_instances(tasks: list, instances, dataset: str) -> list:
    """The tasks named by --instances, in that order (all when none); an unknown id is a usage error."""
    if not instances:
        return tasks
    by_id = {t.task_id: t for t in tasks}
    unknown = [i for i in instances if i not in by_id]
    if unknown:
        raise UsageError(f"--instances: {', '.join(unknown[:3])} not in {dataset}")
    return [by_id[i] for i in instances]
