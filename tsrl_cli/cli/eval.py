"""`tsrl eval embedded|swebench|tbench`: evaluate a policy directory (any `save_pretrained` dir with its
tokenizer, e.g. a `tsrl train` checkpoint) with the training agent loop.

Results go to results/eval/<name>/ (records.jsonl, summary.json); a re-run resumes. Exit codes: 0 done,
1 an external harness failed, 2 bad input or a missing prerequisite (Docker, swebench, harbor, data).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tsrl_cli.cli._errors import cli_errors
from tsrl_cli.cli._options import (
    ChatTemplateOpt,
    DeviceOpt,
    JsonOpt,
    OutOpt,
    SeedsOpt,
    TempOpt,
    ThinkingOpt,
    announce_device,
)
from tsrl_cli.cli._options import split_list as _split

eval_app = typer.Typer(
    name="eval", help="Evaluate a policy: embedded held-out tasks, SWE-bench, Terminal-Bench.",
    no_args_is_help=True, add_completion=False, context_settings={"help_option_names": ["-h", "--help"]},
)

@eval_app.command(
    "embedded",
    epilog="Examples:  tsrl eval embedded  ·  tsrl eval embedded --model results/run/ckpt --limit 20 --json  ·  "
           "tsrl eval embedded --samples 4 --temperature 1 --seed 0 --seed 1",
)
def embedded(
    *,
    model: Annotated[str, typer.Option(help="Policy directory: model + its tokenizer (save_pretrained), "
                                            "e.g. a tsrl train checkpoint.")] = "data/embedded_policy/student",
    datasets: Annotated[list[str] | None, typer.Option("--datasets",
                                                       help="Prepared datasets, comma-separated or repeated. "
                                                            "Default: embedded_repair_heldout,"
                                                            "embedded_terminal_heldout.")] = None,
    samples: Annotated[int, typer.Option(help="Trajectories per task (and seed).")] = 1,
    temperature: TempOpt = 0.0,
    seed: SeedsOpt = None,
    max_turns: Annotated[int | None, typer.Option(help="Agent turns per trajectory (default 8, "
                                                       "the training limit).")] = None,
    limit: Annotated[int | None, typer.Option(help="First N tasks of each dataset (default: all).")] = None,
    out: OutOpt = None,
    concurrency: Annotated[int, typer.Option(help="Agent sessions at once (their model turns are batched).")] = 16,
    chat_template: ChatTemplateOpt = "auto",
    thinking: ThinkingOpt = False,
    device: DeviceOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the held-out embedded tasks in the local sandbox and print the resolved rate with its 95 % interval.

    Labelled "embedded held-out (local sandbox, tiny model)": never a SWE-bench or Terminal-Bench score.
    """
    from dataclasses import replace

    from tsrl_cli.console import progress_printer

    with cli_errors():
        from tsrl_cli.agent.loop import AgentLimits
        from tsrl_cli.evals.embedded import DEFAULT_DATASETS, run_embedded_eval

        limits = AgentLimits() if max_turns is None else replace(AgentLimits(), max_turns=max_turns)
        res = run_embedded_eval(model, _split(datasets) or DEFAULT_DATASETS, out_dir=out, samples=samples,
                                seeds=tuple(seed or (0,)), temperature=temperature, limits=limits, limit=limit,
                                concurrency=concurrency, device=announce_device(device), chat_template=chat_template,
                                thinking=thinking, progress=progress_printer(not json_out))
    _emit(res, json_out)


@eval_app.command(
    "swebench",
    epilog="Examples:  tsrl eval swebench --model ./ckpt --instances django__django-11099  ·  "
           "tsrl eval swebench --model Qwen/Qwen3-8B --workers 8  ·  tsrl eval swebench --grade-only preds.jsonl  ·  "
           "tsrl eval swebench --dataset data/swebench_local --agent oracle",
)
def swebench(
    *,
    model: Annotated[str | None, typer.Option(help="Policy directory or hub id (required with --agent policy, "
                                                   "unless --grade-only).")] = None,
    agent: Annotated[str, typer.Option(help="policy (the model), oracle (applies each gold patch) or nop (changes "
                                            "nothing): the last two are controls that need no model.")] = "policy",
    engine: Annotated[str, typer.Option(help="vllm (GPU) or hf (transformers).")] = "vllm",
    dataset: Annotated[str, typer.Option(help="Prepared SWE-bench set (tsrl prepare-data swebench-verified, "
                                              "or swebench-local).")] = "data/swebench_verified",
    instances: Annotated[list[str] | None, typer.Option(help="Instance ids, comma-separated or repeated "
                                                             "(default: all).")] = None,
    workers: Annotated[int, typer.Option(help="Containers at once, for the rollouts and for the harness.")] = 4,
    temperature: TempOpt = 0.0,
    max_turns: Annotated[int | None, typer.Option(help="Agent turns per instance (default 50).")] = None,
    grade_only: Annotated[str | None, typer.Option(help="Grade an existing predictions file (.jsonl/.json) instead of "
                                                        "running the agent.")] = None,
    harness_dataset: Annotated[str | None, typer.Option(help="What the harness grades against: "
                                                             "a hub id or a .jsonl/.parquet of swebench 5.x rows. "
                                                             "Default: the rows of --dataset.")] = None,
    no_grade: Annotated[bool, typer.Option("--no-grade", help="Only run the agent and write "
                                                              "predictions.jsonl (no score).")] = False,
    timeout_s: Annotated[int, typer.Option(help="Harness time limit per instance's tests, in seconds.")] = 1800,
    chat_template: ChatTemplateOpt = "auto",
    thinking: ThinkingOpt = False,
    device: DeviceOpt = None,
    out: OutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the agent in each SWE-bench instance's image, write predictions.jsonl, grade with the official harness.

    Needs a Docker daemon (else exit 2 before any model loads) and `pip install -e '.[swebench]'`.
    """
    from tsrl_cli.console import progress_printer
    from tsrl_cli.evals.swebench import run_swebench

    with cli_errors():
        plays = agent == "policy" and grade_only is None  # else no engine is opened
        res = run_swebench(model, engine=engine, dataset=dataset, instances=_split(instances), workers=workers,
                           temperature=temperature, max_turns=max_turns, out_dir=out, grade_only=grade_only,
                           harness_dataset=harness_dataset, no_grade=no_grade, timeout_s=timeout_s, agent=agent,
                           device=announce_device(device) if plays else None, chat_template=chat_template,
                           thinking=thinking, progress=progress_printer(not json_out))
    _emit(res, json_out)


@eval_app.command(
    "tbench",
    epilog="Examples:  tsrl eval tbench --dataset embedded_terminal_heldout --executor local "
           "--model data/embedded_policy/student  ·  "
           "tsrl eval tbench --dataset terminal_bench --model ./ckpt --engine vllm  ·  "
           "tsrl eval tbench --dataset terminal_bench --via-harbor --endpoint http://127.0.0.1:8000/v1",
)
def tbench(
    *,
    dataset: Annotated[str, typer.Option(help="Prepared terminal-task set (tsrl prepare-data terminal-bench "
                                              "--from DIR).")],
    model: Annotated[str | None, typer.Option(help="Policy directory or hub id (not used with --via-harbor).")] = None,
    engine: Annotated[str, typer.Option(help="hf (transformers) or vllm.")] = "hf",
    executor: Annotated[str, typer.Option(help="docker (each task's image; real Terminal-Bench) or local (sandbox copy "
                                               "of environment/).")] = "docker",
    samples: Annotated[int, typer.Option(help="Trajectories per task (and seed).")] = 1,
    temperature: TempOpt = 0.0,
    seed: SeedsOpt = None,
    max_turns: Annotated[int | None, typer.Option(help="Agent turns per task (default 8 with local, "
                                                       "50 with docker).")] = None,
    limit: Annotated[int | None, typer.Option(help="First N tasks (default: all).")] = None,
    instances: Annotated[list[str] | None, typer.Option(help="Task ids, comma-separated or repeated "
                                                             "(default: all).")] = None,
    workers: Annotated[int, typer.Option(help="Agent sessions (or harbor trials) at once.")] = 16,
    via_harbor: Annotated[bool, typer.Option("--via-harbor", help="Delegate to the `harbor` CLI "
                                                                  "(own Python >= 3.12 env) with the policy behind an "
                                                                  "OpenAI-compatible endpoint.")] = False,
    endpoint: Annotated[str, typer.Option(help="--via-harbor: the OpenAI-compatible base URL serving the policy.")] = "http://127.0.0.1:8000/v1",
    served_model_name: Annotated[str, typer.Option(help="--via-harbor: the model name the server serves (vllm serve "
                                                        "--served-model-name).")] = "tsrl-policy",
    harbor_agent: Annotated[str, typer.Option(help="--via-harbor: harbor's agent.")] = "terminus-2",
    harbor_env: Annotated[str, typer.Option(help="--via-harbor: harbor's environment (docker, daytona, "
                                                 "modal, e2b, ...).")] = "docker",
    harbor_in_docker: Annotated[bool, typer.Option("--harbor-in-docker",
                                                   help="--via-harbor: run harbor in a Debian trixie image built "
                                                        "here (Python 3.13, pinned harbor), against this machine's "
                                                        "Docker daemon; for machines whose Python is older than "
                                                        "3.12.")] = False,
    agent: Annotated[str, typer.Option(help="policy (the model), oracle (each task's solution/solve.sh) or nop (no "
                                            "action): Harbor's controls.")] = "policy",
    base_image: Annotated[list[str] | None, typer.Option(help="FROM=LOCAL: build Dockerfiles whose "
                                                              "FROM is FROM from the local image LOCAL (repeatable; "
                                                              "printed and recorded in config.json).")] = None,
    chat_template: ChatTemplateOpt = "auto",
    thinking: ThinkingOpt = False,
    device: DeviceOpt = None,
    out: OutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Run Harbor-format terminal tasks in their environment and score them with their tests/test.sh.

    With --executor local the label says "local sandbox (not Terminal-Bench)"; with docker, no daemon means exit 2.
    """
    from tsrl_cli.console import progress_printer

    with cli_errors():
        if via_harbor:
            from tsrl_cli.evals.tbench import run_via_harbor

            res = run_via_harbor(dataset=dataset, served_model=served_model_name, endpoint=endpoint, agent=harbor_agent,
                                 env=harbor_env, workers=workers, limit=limit, instances=_split(instances), out_dir=out,
                                 in_docker=harbor_in_docker, progress=progress_printer(not json_out))
        else:
            from tsrl_cli.config import parse_base_images
            from tsrl_cli.evals.tbench import run_tbench

            res = run_tbench(model, dataset=dataset, executor=executor, engine=engine, samples=samples,
                             seeds=tuple(seed or (0,)), temperature=temperature, max_turns=max_turns, limit=limit,
                             instances=_split(instances), out_dir=out, workers=workers,
                             progress=progress_printer(not json_out), agent=agent,
                             base_images=parse_base_images(base_image or []),
                             device=announce_device(device) if agent == "policy" else None,
                             chat_template=chat_template, thinking=thinking)
    if via_harbor:
        if json_out:
            typer.echo(json.dumps(res))
        else:
            from tsrl_cli.console import console

            scores = "; ".join(f"{k}: mean {v['mean']} over {v['trials']} trial(s), {v['errors']} error(s)"
                               for k, v in (res["harbor_scores"] or {}).items())
            console.print(f"{res['label']}: harbor exited {res['exit_code']}; {scores or 'no result.json'}; results in "
                          f"{res['jobs_dir']} ({res['note']})", highlight=False, soft_wrap=True)
        raise typer.Exit(0 if res["exit_code"] == 0 else 1)
    _emit(res, json_out)


def _emit(res: dict, json_out: bool) -> None:
    if json_out:
        typer.echo(json.dumps(res, default=str))
        return
    from tsrl_cli.console import console

    _render(console, res)


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _render(console, res: dict) -> None:
    from rich.table import Table

    cfg = res.get("config", {})
    graded = res.get("graded", True)
    if not graded:
        console.print(f"[bold]{res['label']}[/bold]: not graded (--no-grade); no score", highlight=False,
                      soft_wrap=True)
    else:  # narrow enough for 80 columns: seed and error columns only when they say something
        parts = res["datasets"].values()
        seeds = any("per_seed" in d for d in parts)
        errors = any(d["errors"] or d["ungraded"] for d in parts)
        t = Table(title=res["label"], title_justify="left")
        t.add_column("dataset", no_wrap=True)
        cols = (["seed"] if seeds else []) + ["resolved", "rate", "95 % CI", "turns"] + (["errors"] if errors else [])
        for col in cols:
            t.add_column(col, justify="right", no_wrap=True)

        def row(name, seed, d):
            cells = [name] + ([seed] if seeds else []) + [
                f"{d['resolved']}/{d['n']}", _pct(d["success"]), f"{_pct(d['ci95_low'])[:-2]}–{_pct(d['ci95_high'])}",
                "–" if d["mean_turns"] is None else f"{d['mean_turns']:.1f}"]
            t.add_row(*cells, *([f"{d['errors']} (+{d['ungraded']} ungraded)" if d["ungraded"] else str(d["errors"])]
                               if errors else []))

        for name, d in res["datasets"].items():
            row(name, "all", d)
            for s_, ds in d.get("per_seed", {}).items():
                row("", s_, ds)
        console.print(t)
        console.print("95 % CI: Wilson score interval over n graded trajectories", style="dim", highlight=False)
    if cfg:
        console.print(f"model {cfg.get('model')} · engine {cfg.get('engine')} · T={cfg.get('temperature')} · "
                      f"max turns {cfg.get('limits', {}).get('max_turns')} · executor {cfg.get('executor')}",
                      highlight=False, soft_wrap=True)
    if res.get("predictions"):
        console.print(f"predictions: {res['predictions']}", highlight=False, soft_wrap=True)
    if res.get("out"):
        console.print(f"records and summary: {res['out']}", highlight=False, soft_wrap=True)
