"""The `tsrl` command: a thin shell (parse, call one library function, render, exit code).

Importing this module must not import torch: `tsrl --help` stays fast (tests/test_imports.py).
Exit codes: 0 ok, 1 the operation failed (e.g. gradients differ), 2 bad input or usage.
"""

from __future__ import annotations

import os
import sys

import typer

from tsrl_cli import __version__
from tsrl_cli.cli.bench import bench_app
from tsrl_cli.cli.data import data_app, prepare_data
from tsrl_cli.cli.doctor import DOCTOR_EPILOG, doctor
from tsrl_cli.cli.env import env_app
from tsrl_cli.cli.eval import eval_app
from tsrl_cli.cli.plan import PLAN_EPILOG, plan
from tsrl_cli.cli.policy import policy_app
from tsrl_cli.cli.predict import calibrate, predict
from tsrl_cli.cli.report import report
from tsrl_cli.cli.serve import SERVE_EPILOG, serve
from tsrl_cli.cli.sweep import SWEEP_EPILOG, sweep
from tsrl_cli.cli.train import TRAIN_EPILOG, train
from tsrl_cli.cli.verify import verify

app = typer.Typer(
    name="tsrl",
    help="Exact gradient streaming for agentic RL of LLMs (ThunderSyncRL reproduction).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
app.command(
    "verify",
    epilog=(
        "Examples:  tsrl verify --dtype float64  ·  tsrl verify --objective opd --loss-agg seq-mean-token-mean"
        "  ·  tsrl verify --model ./my_model --rollouts round.jsonl --json"
    ),
)(verify)
app.command(
    "prepare-data",
    epilog=(
        "Examples:  tsrl prepare-data swebench-verified  ·  tsrl prepare-data swe-smith --language python"
        "  ·  tsrl prepare-data seta-env --from ./SETA-Env --json"
    ),
)(prepare_data)
app.command(
    "predict",
    epilog="Examples:  tsrl predict --trace results/spread/stream/seed42  ·  tsrl predict --trace trace.csv "
           "--step-s 0.5 --json"
           "  ·  tsrl predict --trace run/events.jsonl --learners 2 --spread 2",
)(predict)
app.command(
    "calibrate",
    epilog="Examples:  tsrl calibrate results/spread_balanced --out results/calibration  ·  "
           "tsrl predict --trace results/x/sync/seed42 --calibration results/calibration/calibration.json",
)(calibrate)
app.command(
    "report",
    epilog="Examples:  tsrl report  ·  tsrl report results --out results/report --spread-key "
           "rollout.tool_latency_sigma --json",
)(report)
app.add_typer(data_app, name="data")
app.add_typer(env_app, name="env")
app.add_typer(policy_app, name="policy")
app.command("train", epilog=TRAIN_EPILOG)(train)
app.add_typer(bench_app, name="bench")
app.command("sweep", epilog=SWEEP_EPILOG)(sweep)
app.add_typer(eval_app, name="eval")
app.command("doctor", epilog=DOCTOR_EPILOG)(doctor)
app.command("plan", epilog=PLAN_EPILOG)(plan)
app.command("serve", epilog=SERVE_EPILOG)(serve)


def _version(value: bool):
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    """Exact gradient streaming for agentic RL of LLMs (ThunderSyncRL reproduction)."""


def main() -> None:
    """Entry point: known errors become one line on stderr and exit code 2."""
    from tsrl_cli.errors import UsageError
    from tsrl_cli.processes import thread_env

    thread_env()  # one OpenMP thread per process, set before any command imports torch

    try:
        app(standalone_mode=True)
    except UsageError as e:  # raised outside a command body (commands handle their own)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # one line unless debugging
        if os.environ.get("TSRL_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e} (set TSRL_DEBUG=1 for the full traceback)", file=sys.stderr)
        sys.exit(1)
