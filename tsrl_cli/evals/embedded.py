"""`tsrl eval embedded`: the held-out embedded repair and terminal tasks in the local sandbox.

These numbers are the project's own tasks, solved by a tiny local model in a local sandbox: they
are labelled "embedded held-out (local sandbox, tiny model)" everywhere, and are never SWE-bench
or Terminal-Bench scores.

The trainer's `eval_every` calls `evaluate_embedded(model, tokenizer, ...)` with the in-memory
policy and logs `summary["metrics"]`:

    eval/<dataset>/success    resolved rate (resolved / n); NaN when n = 0
    eval/<dataset>/n          graded trajectories (tasks x samples x seeds)
    eval/<dataset>/ci95_low   Wilson 95 % interval, low end
    eval/<dataset>/ci95_high  Wilson 95 % interval, high end

Usage:  tsrl eval embedded --model data/embedded_policy/student --limit 10
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from tsrl_cli.agent.loop import AgentLimits
from tsrl_cli.agent.template import make_renderer
from tsrl_cli.datasets.store import Dataset, open_dataset, prepare_hint
from tsrl_cli.devices import engine_device
from tsrl_cli.engines.load import engine_config, engine_on_model, open_engine
from tsrl_cli.envs.tasks import make_env
from tsrl_cli.errors import UsageError
from tsrl_cli.evals.runner import (
    DEFAULT_LIMITS,
    SUMMARY,
    Job,
    agent_tokenizer,
    make_jobs,
    open_out_dir,
    run_jobs,
    summarize_eval,
)
from tsrl_cli.files import write_json_atomic

LABEL = "embedded held-out (local sandbox, tiny model)"
DEFAULT_MODEL = "data/embedded_policy/student"
DEFAULT_DATASETS = ("embedded_repair_heldout", "embedded_terminal_heldout")


# -- the final diff of a repair task ---------------------------------------------------------------------------

_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".git", ".mypy_cache", ".ruff_cache"}


def _tree(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.suffix != ".pyc"
            and not _SKIP_PARTS & set(p.relative_to(root).parts)}


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def tree_diff(before: str | Path, after: str | Path) -> str:
    """A git-style unified diff from folder `before` to folder `after` (what `git diff` would show
    in a repository at `before` whose working copy is `after`); `git apply` reads it.

    Caches (__pycache__, .pyc, .pytest_cache) are ignored; file modes are not compared.
    """
    a, b = _tree(Path(before)), _tree(Path(after))
    out = []
    for rel in sorted(a.keys() | b.keys()):
        old = a[rel].read_bytes() if rel in a else None
        new = b[rel].read_bytes() if rel in b else None
        if old == new:
            continue
        head = f"diff --git a/{rel} b/{rel}\n"
        try:
            old_t = old.decode() if old is not None else ""
            new_t = new.decode() if new is not None else ""
        except UnicodeDecodeError:
            out.append(head + f"Binary files a/{rel} and b/{rel} differ\n")
            continue
        if old is None:
            head += "new file mode 100644\n"
        elif new is None:
            head += "deleted file mode 100644\n"
        body = difflib.unified_diff(_lines(old_t), _lines(new_t), "/dev/null" if old is None else f"a/{rel}",
                                    "/dev/null" if new is None else f"b/{rel}")
        # difflib leaves a last line without its newline as is; git writes the marker below
        out.append(head + "".join(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in body))
    return "".join(out)


async def local_patch(env, job: Job) -> str | None:
    """Repair tasks in the local sandbox: the diff from the start state to the graded working copy
    (test files already restored by the verifier). Terminal tasks have no patch: None."""
    sb = getattr(env, "sandbox", None)
    if job.task.kind != "repair" or sb is None or sb.executor != "local":
        return None
    return await asyncio.to_thread(tree_diff, env.repo_dir, sb.workdir)


# -- evaluation ------------------------------------------------------------------------------------------------

def evaluate_embedded(
    model,
    tokenizer,
    datasets: Iterable[str | Dataset] = DEFAULT_DATASETS,
    *,
    samples: int = 1,
    seeds: Iterable[int] = (0,),
    temperature: float = 0.0,
    limits: AgentLimits = DEFAULT_LIMITS,
    limit: int | None = None,
    out_dir: str | Path | None = None,
    model_name: str = "<in-memory>",
    engine=None,
    concurrency: int = 16,
    max_batch: int = 16,
    progress: Callable[[str], None] | None = None,
    chat_template: str = "auto",
    thinking: bool = False,
) -> dict:
    """Run the agent on held-out embedded tasks; returns the summary (see module docstring).

    Args:
        model: a loaded causal LM, served by the hf engine on its own device and dtype
            (engines/load.py engine_on_model); its train/eval mode is restored after. Ignored when
            `engine` is given (an opened engine, or a scripted one in tests).
        datasets: prepared dataset names or folders, or opened datasets (datasets.store.open_dataset).
        samples, seeds: trajectories per task and seed; n in the summary counts all of them.
        temperature: 0 = greedy (the default for evaluation).
        out_dir: when given, records.jsonl, config.json and summary.json go there, and finished
            trajectories are not run again.
        chat_template, thinking: the chat format (model.chat_template, rollout.thinking: a training run's).
    """
    loaded = [d if isinstance(d, Dataset) else open_dataset(d, limit) for d in datasets]
    jobs = make_jobs(loaded, samples, seeds)
    # a tokenizer the agent cannot use fails before out_dir is written
    make_renderer(tokenizer, chat_template, thinking)
    was_training = getattr(model, "training", False)
    if engine is None:
        engine = engine_on_model(model, tokenizer)  # the hf engine puts the model in eval mode
    config = {"model": model_name, **engine_config(engine), "temperature": temperature, "top_p": 1.0,
              "limits": asdict(limits), "executor": "local", "label": LABEL}
    t0 = time.perf_counter()
    try:
        log = open_out_dir(out_dir, config) if out_dir is not None else None
        records = run_jobs(engine, tokenizer, jobs,
                           make_env=lambda j: make_env(j.task, j.dataset_dir, executor="local"),
                           collect_patch=local_patch, temperature=temperature, limits=limits, concurrency=concurrency,
                           max_batch=max_batch, log=log, progress=progress, chat_template=chat_template,
                           thinking=thinking)
    finally:
        if was_training:
            model.train()
    summary = summarize_eval(records, label=LABEL, datasets=[d.name for d in loaded])
    summary.update(config=config, samples=samples, seeds=list(seeds), wall_s=round(time.perf_counter() - t0, 1),
                   out=str(out_dir) if out_dir is not None else None)
    if out_dir is not None:
        write_json_atomic(Path(out_dir) / SUMMARY, summary, sort_keys=True)
    return summary


def run_embedded_eval(model_dir: str = DEFAULT_MODEL, datasets: Iterable[str] = DEFAULT_DATASETS, *,
                      out_dir: str | Path | None = None, device: str | None = None, samples: int = 1,
                      seeds: Iterable[int] = (0,), limit: int | None = None, chat_template: str = "auto",
                      thinking: bool = False, **kw) -> dict:
    """`tsrl eval embedded`: check the inputs, open the policy directory's hf engine on `device` (None: the
    first GPU where there is one, else cpu; devices.engine_device), evaluate, write the results."""
    if not (Path(model_dir) / "config.json").is_file():
        raise UsageError(f"--model {model_dir}: no policy directory there (no config.json); "
                         f"{prepare_hint('embedded_repair_train')}, "
                         "or pass --model DIR (any save_pretrained directory with its tokenizer, "
                         "e.g. a tsrl train checkpoint)")
    loaded = [open_dataset(d, limit) for d in datasets]
    seeds = tuple(seeds)
    make_jobs(loaded, samples, seeds)  # --samples and --seed checked before the model loads
    dev = engine_device(device)
    tok = agent_tokenizer(model_dir, chat_template, thinking)
    engine, _ = open_engine(model_dir, "hf", (dev,))
    out_dir = out_dir if out_dir is not None else Path("results/eval") / f"embedded-{Path(model_dir).resolve().name}"
    return evaluate_embedded(None, tok, loaded, out_dir=out_dir, model_name=str(model_dir), engine=engine,
                             samples=samples, seeds=seeds, chat_template=chat_template, thinking=thinking, **kw)
