"""`tsrl policy probe`: sample a policy on tasks through the evaluation runner, and report what GRPO
needs to know about it before training: how often it succeeds, and in how many groups (the samples
of one task) the reward varies (a group with equal rewards gives no GRPO signal).

It is `tsrl eval` with another summary: the same jobs (task x sample x seed), the same agent loop,
sandboxes and verifiers, the same resumable output folder (config.json, records.jsonl, summary.json;
evals/runner.py). A re-run with the same settings samples only what is missing.

Labels: tasks of prepared datasets in the local sandbox, whatever the model; embedded tasks with the
tiny default policy are never SWE-bench or Terminal-Bench scores.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from tsrl_cli.agent.loop import AgentLimits
from tsrl_cli.datasets.store import Dataset, open_dataset
from tsrl_cli.devices import engine_device
from tsrl_cli.engines.load import engine_config, open_engine
from tsrl_cli.envs.tasks import make_env
from tsrl_cli.errors import UsageError
from tsrl_cli.evals.runner import SUMMARY, agent_tokenizer, make_jobs, open_out_dir, record_key, run_jobs
from tsrl_cli.files import write_json_atomic
from tsrl_cli.policy import weights_sha256

# `--tasks` shorthands: both embedded sets of a split
TASK_ALIASES = {"embedded-train": ("embedded_repair_train", "embedded_terminal_train"),
                "embedded-heldout": ("embedded_repair_heldout", "embedded_terminal_heldout")}


def expand_task_sets(names: Iterable[str]) -> list[str]:
    return [n for name in names for n in TASK_ALIASES.get(name, (name,))]


def probe_policy(model_dir: str | Path, datasets: Iterable[str | Dataset] = ("embedded-train",), *, samples: int = 8,
                 temperature: float = 1.0, seed: int = 0, limit: int | None = None,
                 out_dir: str | Path | None = None, limits: AgentLimits = AgentLimits(), concurrency: int = 16,
                 max_batch: int = 16, policy=None, device: str | None = None, chat_template: str = "auto",
                 thinking: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Sample every task `samples` times at `temperature`; returns the summary (also OUT/summary.json).

    The hf engine opens `model_dir` on `device` (None: the first GPU where there is one, else cpu).
    `policy` = (engine, tokenizer): probe that instead (an in-memory model being trained, through
    engines/load.py engine_on_model; model_dir then only names it).
    """
    if samples < 1:
        raise UsageError(f"--samples {samples}: must be >= 1")
    if policy is None and not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"--model {model_dir}: not a policy directory (no config.json); the embedded default policy "
                         "is built by `tsrl prepare-data embedded`, any save_pretrained directory with its tokenizer "
                         "(e.g. a tsrl train checkpoint) works too")
    loaded: list[Dataset] = []
    for d in datasets:
        loaded += [d] if isinstance(d, Dataset) else [open_dataset(n, limit) for n in expand_task_sets([d])]
    names = [d.name for d in loaded]
    out = Path(out_dir) if out_dir is not None else Path("results/probe") / Path(model_dir).resolve().name
    if policy is None:  # a bad model fails before OUT exists
        dev = engine_device(device)
        tok = agent_tokenizer(str(model_dir), chat_template, thinking)
        engine, _ = open_engine(str(model_dir), "hf", (dev,))
    else:
        engine, tok = policy
    config = {"model": str(model_dir), "model_sha256": None if policy else weights_sha256(model_dir),
              **engine_config(engine), "temperature": temperature, "top_p": 1.0, "limits": asdict(limits),
              "executor": "local", "label": f"policy probe on {', '.join(names)} (local sandbox)"}
    log = open_out_dir(out, config)
    jobs = make_jobs(loaded, samples, seeds=(seed,))
    keys = {j.key for j in jobs}
    resumed = sum(record_key(r) in keys and not r.get("error") for r in log.load())
    t0 = time.perf_counter()
    records = run_jobs(engine, tok, jobs, make_env=lambda j: make_env(j.task, j.dataset_dir, executor="local"),
                       temperature=temperature, limits=limits, concurrency=concurrency, max_batch=max_batch, log=log,
                       progress=progress, chat_template=chat_template, thinking=thinking)
    summary = summarize_probe(records, time.perf_counter() - t0)
    summary.update(config=config, datasets=names, samples=samples, seed=seed, resumed_trajectories=resumed,
                   out=str(out))
    write_json_atomic(out / SUMMARY, {k: v for k, v in summary.items() if k != "results"}, sort_keys=True)
    return summary


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize_probe(records: list[dict], wall_s: float) -> dict:
    """Success rate, groups with reward variance, turns, tokens and tool time: overall, repair, terminal.

    A group is one task's samples (population variance of their rewards). Records of environments
    that failed to start have no reward: they are counted under `errors` and left out of every rate.
    """
    ok = [r for r in records if not r.get("error") and r.get("reward") is not None]
    groups: dict[tuple[str, str], list[float]] = {}
    for r in ok:
        groups.setdefault((r["dataset"], r["instance_id"]), []).append(r["reward"])
    var = {g: statistics.pvariance(v) if len(v) > 1 else 0.0 for g, v in groups.items()}

    def part(rs):
        if not rs:
            return {}
        gs = {(r["dataset"], r["instance_id"]) for r in rs}
        return {"trajectories": len(rs), "success_rate": round(sum(r["reward"] for r in rs) / len(rs), 4),
                "groups": len(gs), "groups_nonzero_var": sum(var[g] > 0 for g in gs),
                "groups_any_success": sum(max(groups[g]) > 0 for g in gs),
                "mean_turns": round(statistics.mean(r["turns"] for r in rs), 2),
                "mean_tokens": round(statistics.mean(r["tokens"] for r in rs), 1),
                "mean_tool_s": round(statistics.mean(r["tool_s"] for r in rs), 3),
                "exit_reasons": {k: sum(r["exit_reason"].split(":")[0] == k for r in rs)
                                 for k in sorted({r["exit_reason"].split(":")[0] for r in rs})}}

    secs = [r["duration_s"] for r in ok]
    return {"all": part(ok), "repair": part([r for r in ok if r["kind"] == "repair"]),
            "terminal": part([r for r in ok if r["kind"] == "terminal"]),
            "errors": len(records) - len(ok),
            "mean_group_variance": round(statistics.mean(var.values()), 4) if var else 0.0,
            "duration_s": {"p10": round(_pct(secs, 0.1), 2), "p50": round(_pct(secs, 0.5), 2),
                           "p90": round(_pct(secs, 0.9), 2), "max": round(max(secs), 2) if secs else 0.0},
            "wall_s": round(wall_s, 1), "results": records}
