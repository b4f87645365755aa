"""`tsrl eval tbench`: Harbor-format terminal tasks (Terminal-Bench 2.x layout) with tsrl's agent loop.

Each task runs in its environment, then its `tests/test.sh` writes /logs/verifier/reward.txt or
reward.json (envs/terminal.py). Executors:
  docker  the task's prebuilt image (`docker_image` in task.toml), else one built from its
          environment/Dockerfile (TB 1.x: Dockerfile or docker-compose.yaml) before anything runs,
          tagged by the task directory's sha256 and reused (sandbox/images.py; logs in <out>/builds;
          --base-image FROM=LOCAL for machines that cannot pull, recorded in config.json); commands
          run in the Dockerfile's WORKDIR (default /app). Needs a Docker daemon (else exit 2).
--agent oracle runs each task's solution/solve.sh, --agent nop does nothing (Harbor's controls):
their scores come through the same verifier and reward file as the policy's.
  local   a copy of environment/ at /app in the local sandbox: right for tasks whose environment
          is plain files (the embedded suite), an approximation otherwise. Never a
          Terminal-Bench score, and labelled so.
--via-harbor hands the run to the `harbor` CLI (its own Python >= 3.12 environment) with tsrl's
policy served at an OpenAI-compatible endpoint (e.g. `vllm serve DIR --served-model-name
tsrl-policy`). Harbor runs its own agent (terminus-2 by default) with its own prompts, not tsrl's
agent loop, and scores the trials itself: tsrl reports its exit code and where its results are,
never a score of its own for that run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from tsrl_cli.agent.loop import AgentLimits
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.devices import engine_device
from tsrl_cli.engines.load import ENGINES, engine_config, open_engine
from tsrl_cli.envs.images import build_task_images
from tsrl_cli.envs.terminal import TerminalEnv
from tsrl_cli.errors import UsageError
from tsrl_cli.evals.runner import (
    AGENTS,
    SUMMARY,
    agent_tokenizer,
    make_jobs,
    open_out_dir,
    require_docker,
    run_jobs,
    select_instances,
    summarize_eval,
)
from tsrl_cli.files import write_json_atomic
from tsrl_cli.sandbox.images import HARBOR_VERSION, ensure_harbor_image

DOCKER_LIMITS = AgentLimits(max_turns=50, max_turn_tokens=4096, max_trajectory_tokens=32768, tool_timeout_s=180.0,
                            wall_clock_s=900.0, max_observation_chars=10000)
HARBOR_HELP = (
    "`harbor` is not on PATH (it needs Python >= 3.12; this is {python}). Install it in its own environment "
    "(`uv tool install harbor`, or `python3.12 -m venv ~/.harbor && ~/.harbor/bin/pip install harbor` and put "
    "~/.harbor/bin on PATH), or add --harbor-in-docker to run it in a Debian trixie image built here (Python 3.13, "
    "harbor {version}; needs Docker and PyPI once). Agents other than oracle and nop need the policy at an "
    "OpenAI-compatible endpoint (`vllm serve MODEL_DIR --served-model-name tsrl-policy --port 8000`, then "
    "--endpoint http://127.0.0.1:8000/v1)"
)
NO_MODEL_AGENTS = ("oracle", "nop")  # harbor's control agents: they call no model


def label(name: str, source: str, executor: str) -> str:
    if executor == "local":
        return f"{name}: Harbor-format tasks in the local sandbox (not Terminal-Bench)"
    if source == "terminal-bench":
        return f"{name}: Terminal-Bench tasks in their Docker images, tsrl agent loop (not the official Harbor harness)"
    return f"{name}: Harbor-format tasks in their Docker images (not Terminal-Bench)"


def _select(dataset: str, limit: int | None, instances: list[str] | None):
    ds = open_dataset(dataset, hint="prepare it with `tsrl prepare-data terminal-bench --from DIR` "
                                    "(or `tsrl prepare-data embedded`)")
    if any(t.kind != "terminal" for t in ds.tasks):
        raise UsageError(f"{dataset}: not a terminal-task dataset")
    tasks = select_instances(ds.tasks, instances, dataset)
    return replace(ds, tasks=tasks[:limit] if limit else tasks)


def run_tbench(model: str | None, *, dataset: str, executor: str = "docker", engine: str = "hf", samples: int = 1,
               seeds: tuple[int, ...] = (0,), temperature: float = 0.0, max_turns: int | None = None,
               limit: int | None = None, instances: list[str] | None = None, out_dir: str | Path | None = None,
               workers: int = 16, policy=None, progress: Callable[[str], None] | None = None,
               agent: str = "policy", base_images: dict[str, str] | None = None, device: str | None = None,
               chat_template: str = "auto", thinking: bool = False) -> dict:
    """Run tsrl's agent loop on each task in its environment, score with tests/test.sh, summarize.

    `model` opens in the `engine` (hf or vllm) on `device` (None: the first GPU where there is one, else
    cpu), after the task images are built. `policy` = (engine, tokenizer) skips loading `model` (tests
    pass a scripted engine). `agent` oracle|nop: the controls (runner.run_jobs). `base_images`: {FROM:
    local image} for the builds.
    """
    ds = _select(dataset, limit, instances)
    name, tasks, source = ds.name, ds.tasks, ds.manifest.get("source", "?")
    if agent not in AGENTS:
        raise UsageError(f"--agent {agent!r}: use one of {', '.join(AGENTS)}")
    if executor == "docker":
        require_docker("tsrl eval tbench --executor docker")
        base = DOCKER_LIMITS
    elif executor == "local":
        base = AgentLimits()  # the limits the embedded policy is trained with
    else:
        raise UsageError(f"--executor {executor!r}: use docker or local")
    if policy is None and not model and agent == "policy":
        raise UsageError("--model DIR_OR_ID is required (or --agent oracle|nop)")
    opens = agent == "policy" and policy is None  # the engine is opened here (else given, or none at all)
    if opens:
        if engine not in ENGINES:
            raise UsageError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
        dev = engine_device(device)
        tok = agent_tokenizer(model, chat_template, thinking)  # before any output, the builds' logs included
    if max_turns is not None:
        base = replace(base, max_turns=max_turns)

    def limits_for(job):
        t = job.task.agent_timeout_s
        return replace(base, wall_clock_s=float(t)) if executor == "docker" and t else base

    lab = label(name, source, executor) + ("" if agent == "policy" else f" [{agent} agent]")
    model_name = (model or "<given engine>") if agent == "policy" else f"tsrl-{agent}"
    config = {"model": model_name, "temperature": temperature, "top_p": 1.0, "limits": asdict(base),
              "executor": executor, "label": lab}
    out = Path(out_dir) if out_dir is not None else Path("results/eval") / f"tbench-{name}-{Path(model_name).name}"
    images: dict[str, str] = {}
    if executor == "docker":  # every task's image before any model is loaded: a failed build is one line
        images, used = build_task_images([(ds.path, t) for t in tasks], base_images=base_images or {},
                                         log_dir=out / "builds", progress=progress or (lambda m: None))
        config["base_images"] = used
        if used:  # not the tasks' own environments: the label says so
            config["label"] = lab = lab + " (FROM mapped to local images)"
    if agent != "policy":
        pol, tok = None, None
    elif policy is not None:
        pol, tok = policy
    else:
        pol, _ = open_engine(model, engine, (dev,))
    config.update(engine_config(pol) if pol is not None else {"engine": "none", "dtype": None, "device": None})
    log = open_out_dir(out, config)

    def make_env(job):
        if executor == "docker":
            return TerminalEnv(job.task, job.dataset_dir, executor="docker", image=images[job.task.task_id])
        return TerminalEnv(job.task, job.dataset_dir, executor="local")

    t0 = time.perf_counter()
    records = run_jobs(pol, tok, make_jobs([ds], samples, seeds), make_env=make_env, temperature=temperature,
                       limits=limits_for, concurrency=workers, max_batch=16, log=log, progress=progress, agent=agent,
                       chat_template=chat_template, thinking=thinking)
    s = summarize_eval(records, label=lab, datasets=[name])
    s.update(config=config, samples=samples, seeds=list(seeds), out=str(out), wall_s=round(time.perf_counter() - t0, 1))
    write_json_atomic(out / SUMMARY, s, sort_keys=True)
    return s


# -- --via-harbor --------------------------------------------------------------------------------------------

def harbor_command(task_root: str | Path, *, served_model: str, endpoint: str, jobs_dir: str | Path, job_name: str,
                   agent: str = "terminus-2", env: str = "docker", workers: int = 4,
                   include: list[str] | None = None, harbor: str | list[str] = "harbor") -> list[str]:
    """`harbor run` on a local folder of Harbor tasks, the model reached through litellm's `openai/`
    provider at `endpoint` (passed to the agent as api_base; not for oracle and nop, which call none).
    `harbor`: the executable, or the command that runs it (--harbor-in-docker)."""
    cmd = [*([harbor] if isinstance(harbor, str) else harbor), "run", "--path", str(task_root), "--agent", agent]
    if agent not in NO_MODEL_AGENTS:
        cmd += ["--model", f"openai/{served_model}", "--agent-kwarg", f"api_base={endpoint}"]
    cmd += ["--n-concurrent", str(workers), "--env", env, "--jobs-dir", str(jobs_dir), "--job-name", job_name]
    for t in include or []:
        cmd += ["--include-task-name", t]
    return cmd


def endpoint_unreachable_reason(endpoint: str, timeout_s: float = 5.0) -> str | None:
    """None when GET <endpoint>/models answers (an OpenAI-compatible server), else why not."""
    url = endpoint.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return None if r.status == 200 else f"GET {url} answered {r.status}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"GET {url} failed: {getattr(e, 'reason', e)}"


def harbor_in_docker(image: str, task_root: Path, jobs_dir: Path) -> list[str]:
    """The command that runs harbor in `image` against this machine's Docker daemon: its socket mounted,
    the tasks (read-only) and the jobs folder at their own absolute paths, so the paths harbor hands
    the daemon for builds and mounts are the host's."""
    host = os.environ.get("DOCKER_HOST", "")
    sock = host.removeprefix("unix://") if host.startswith("unix://") else "/var/run/docker.sock"
    if shutil.which("docker") is None:
        raise UsageError("--harbor-in-docker: the `docker` CLI is not on PATH (apt-get install docker.io)")
    t, j = task_root.resolve(), jobs_dir.resolve()
    return ["docker", "run", "--rm", "--network", "host", "-v", f"{sock}:/var/run/docker.sock",
            "-v", f"{t}:{t}:ro", "-v", f"{j}:{j}", "-e", "OPENAI_API_KEY", image, "harbor"]


def harbor_scores(job_dir: Path) -> dict | None:
    """Harbor's own figures from its result.json ({trials, errors, mean} per agent and dataset), or None."""
    try:
        stats = json.loads((job_dir / "result.json").read_text())["stats"]
    except (OSError, ValueError, KeyError):
        return None
    return {name: {"trials": e.get("n_trials"), "errors": e.get("n_errors"),
                   "mean": next((m["mean"] for m in e.get("metrics", []) if "mean" in m), None)}
            for name, e in (stats.get("evals") or {}).items()}


def run_via_harbor(*, dataset: str, served_model: str, endpoint: str, agent: str = "terminus-2", env: str = "docker",
                   workers: int = 4, limit: int | None = None, instances: list[str] | None = None,
                   out_dir: str | Path | None = None, in_docker: bool = False,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Delegate to `harbor run` (see module docstring); returns the command, its exit code, its jobs
    folder and harbor's own scores. in_docker: harbor in the image of sandbox/images.ensure_harbor_image."""
    ds = _select(dataset, limit, instances)
    name, d, tasks = ds.name, ds.path, ds.tasks
    tb1 = [t.task_id for t in tasks if t.format != "harbor"]
    if tb1:
        raise UsageError(f"{len(tb1)} task(s) are Terminal-Bench 1.x (e.g. {tb1[0]}); harbor runs Harbor-format tasks")
    out = Path(out_dir) if out_dir is not None else Path("results/eval") / f"tbench-harbor-{name}-{served_model}"
    exe: str | list[str] | None = shutil.which("harbor")
    if in_docker:
        require_docker("--harbor-in-docker")
        if env != "docker":
            raise UsageError(f"--harbor-in-docker runs harbor's docker environment, not --harbor-env {env}")
        out.mkdir(parents=True, exist_ok=True)
        image = ensure_harbor_image(out / "builds", progress or (lambda m: None))
        exe = harbor_in_docker(image, d / "tasks", out / "harbor")
    elif exe is None:
        raise UsageError(HARBOR_HELP.format(python=f"Python {sys.version_info[0]}.{sys.version_info[1]}",
                                            version=HARBOR_VERSION))
    if env == "docker":
        require_docker("harbor --env docker")
    if agent not in NO_MODEL_AGENTS:
        reason = endpoint_unreachable_reason(endpoint)
        if reason:
            raise UsageError(f"no OpenAI-compatible server at {endpoint} ({reason}); serve the policy first, e.g. "
                             f"`vllm serve MODEL_DIR --served-model-name {served_model} --port 8000`")
    out.mkdir(parents=True, exist_ok=True)
    (out / "harbor").mkdir(exist_ok=True)
    job_name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    subset = [t.task_id for t in tasks] if (limit or instances) else None
    cmd = harbor_command((d / "tasks").resolve(), served_model=served_model, endpoint=endpoint,
                         jobs_dir=(out / "harbor").resolve(), job_name=job_name, agent=agent, env=env, workers=workers,
                         include=subset, harbor=exe)
    # litellm's openai provider wants a key even when the local server ignores it
    proc_env = {**os.environ, "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "EMPTY")}
    job_dir = out / "harbor" / job_name
    log_path = out / "harbor" / f"{job_name}.log"
    # harbor's output goes to our stderr line by line (sys.stderr need not be a file) and to its log
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=proc_env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                      text=True, errors="replace") as proc:
        for line in proc.stdout:
            log.write(line)
            sys.stderr.write(line)
        rc = proc.wait()
    res = {"via": "harbor", "label": f"{name} via harbor ({agent} agent, scored by harbor)", "command": cmd,
           "exit_code": rc, "jobs_dir": str(job_dir), "log": str(log_path), "harbor_scores": harbor_scores(job_dir),
           "note": "scores are harbor's own (its printed table and result.json in jobs_dir); "
                   "tsrl does not re-score them"}
    write_json_atomic(out / "harbor_run.json", res, sort_keys=True)
    return res
