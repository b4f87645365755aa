"""Import hygiene: `tsrl --help` does not import torch; core/ imports no CLI or UI code."""

import subprocess
import sys

import pytest


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from tsrl_cli.cli import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0\n"
        "r = CliRunner().invoke(app, ['verify', '--help'])\n"
        "assert r.exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    assert _run(code) == "[]"


def test_core_imports_only_torch():
    code = (
        "import sys\n"
        "import tsrl_cli.core.accumulator, tsrl_cli.core.losses, tsrl_cli.core.advantages\n"
        "print(sorted(m for m in ('typer', 'rich', 'transformers', 'tsrl_cli.cli', 'tsrl_cli.learner')\n"
        "             if m in sys.modules))"
    )
    assert _run(code) == "[]"


def test_console_script_help():
    import shutil

    exe = shutil.which("tsrl") or str(__import__("pathlib").Path(sys.executable).with_name("tsrl"))
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "verify" in out.stdout


@pytest.mark.slow
def test_round_engine_imports_no_cli_or_ui():
    code = (
        "import sys\n"
        "import tsrl_cli.rl.train, tsrl_cli.rl.bench, tsrl_cli.config\n"
        "print(sorted(m for m in ('typer', 'rich', 'tsrl_cli.cli') if m in sys.modules))"
    )
    assert _run(code) == "[]"


def test_train_and_bench_help_do_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from tsrl_cli.cli import app\n"
        "for args in (['train', '--help'], ['bench', 'speedup', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    assert _run(code) == "[]"
