"""`tsrl --help` loads neither matplotlib nor the report code; the event model is pure python; the report is
pandas, no torch."""

import subprocess
import sys


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_cli_help_does_not_load_report_or_matplotlib():
    """yaml may load: `tsrl verify`'s loss options are generated from config.LossConfig (tsrl_cli.config, with
    yaml, costs about 75 ms of the 0.5 s `tsrl --help`)."""
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom tsrl_cli.cli import app\n"
            "for a in (['--help'], ['report', '--help'], ['predict', '--help']):\n"
            "    assert CliRunner().invoke(app, a).exit_code == 0\n"
            "print(sorted(m for m in ('matplotlib', 'pandas', 'torch', 'tsrl_cli.report.build', 'tsrl_cli.predict')\n"
            "             if m in sys.modules))")
    assert _run(code) == "[]"


def test_predict_imports_no_torch_or_numpy():
    code = ("import sys\nimport tsrl_cli.predict\n"
            "print(sorted(m for m in ('torch', 'numpy', 'matplotlib', 'typer', 'rich') if m in sys.modules))")
    assert _run(code) == "[]"


def test_report_imports_pandas_but_no_torch():
    """The report reads configs through tsrl_cli.config and devices, which load torch only to check a CUDA
    device; matplotlib loads only to draw."""
    code = ("import sys\nimport tsrl_cli.report.build\n"
            "print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'typer', 'rich') if m in sys.modules))")
    assert _run(code) == "['pandas']"
