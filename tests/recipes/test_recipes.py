"""The research scripts in recipes/ still import and parse their arguments against today's package
(they are run by hand; this keeps them from rotting silently)."""

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys

import pytest

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "recipes" / "embedded_policy"
SCRIPTS = sorted(RECIPES.rglob("*.py"))


def missing_imports(source: str) -> list[str]:
    """`from tsrl_cli.X import name` lines (anywhere, also inside main()) whose name does not exist."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tsrl_cli"):
            try:
                mod = importlib.import_module(node.module)
            except ImportError:
                out.append(node.module)
                continue
            out += [f"{node.module}.{a.name}" for a in node.names if not hasattr(mod, a.name)
                    and not is_module(f"{node.module}.{a.name}")]
    return out


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # the parent is a module, not a package
        return False


def test_there_are_recipes():
    assert {p.name for p in SCRIPTS} >= {"copy_drill.py", "copy_pilot.py", "copy_policy.py", "fresh_instances.py",
                                         "probe_sample.py", "summarize.py"}


def test_import_check_catches_a_missing_name():
    assert missing_imports("def main():\n    from tsrl_cli.policy import load_model, load_policy\n"
                           "    from tsrl_cli.embedded.sft import x\n") == ["tsrl_cli.policy.load_model",
                                                                         "tsrl_cli.embedded.sft"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_what_it_uses(script):
    assert missing_imports(script.read_text()) == []


@pytest.mark.parametrize("script", [p for p in SCRIPTS if p.name != "summarize.py"], ids=lambda p: p.name)
@pytest.mark.slow
def test_script_help(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
