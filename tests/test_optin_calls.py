"""Code that the main suite cannot run still matches the package: a renamed function or a changed
signature fails here, not months later on the one machine that has vLLM, harbor or a GPU.

Checked, statically: the opt-in tests (files marked vllm, harbor or gpu) and the measurement scripts under
experiments/ (gpu_checks.sh runs them on a lent GPU). For each, every `from tsrl_cli... import name` must
import, and every call of such a name, or of `module.name` for an imported tsrl_cli module, must bind to the
callee's signature (`inspect.Signature.bind`: positional count, keyword names, keyword-only parameters).
Calls with `*args` or `**kwargs` are bound on what is spelled out. Method calls on objects are not
resolved: the check covers the package's module-level functions and classes.

A second check collects the opt-in tests (`pytest --collect-only -m "vllm or harbor or gpu"`), so that
an import error at module level in one of them fails the main suite too.
"""

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPT_IN_MARKS = ("vllm", "harbor", "gpu")


def opt_in_files(repo: Path = REPO) -> list[Path]:
    tests = [p for p in sorted((repo / "tests").rglob("test_*.py")) if "fixtures" not in p.parts
             and any(f"mark.{m}" in p.read_text() for m in OPT_IN_MARKS)]
    return tests + sorted((repo / "experiments").rglob("*.py"))


def _imported(tree: ast.AST) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """({local name: 'module:attr'}, {local alias: module}, problems) for every tsrl_cli import in the file."""
    names, modules, problems = {}, {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tsrl_cli" \
                and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}:{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "tsrl_cli" and a.asname:
                    modules[a.asname] = a.name
    return names, modules, problems


def _resolve(target: str):
    """The object `module:attr` names (an attribute of the module, or a submodule)."""
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    if hasattr(mod, attr):
        return getattr(mod, attr)
    return importlib.import_module(f"{module}.{attr}")


def _binds(obj, call: ast.Call) -> str | None:
    """Why the call's spelled-out arguments do not fit obj's signature, or None."""
    if inspect.ismodule(obj):
        return None
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    double = any(k.arg is None for k in call.keywords)
    args = [object()] * sum(not isinstance(a, ast.Starred) for a in call.args)
    kwargs = {k.arg: object() for k in call.keywords if k.arg is not None}
    try:
        if starred or double:  # bind what is spelled out, leaving the rest to the unpacked arguments
            sig.bind_partial(*args, **kwargs)
        else:
            sig.bind(*args, **kwargs)
    except TypeError as e:
        if (starred or double) and "missing" in str(e):
            return None
        return str(e)
    return None


def call_problems(path: Path, source: str | None = None) -> list[str]:
    source = path.read_text() if source is None else source
    tree = ast.parse(source)
    names, modules, problems = _imported(tree)
    objs = {}
    for local, target in names.items():
        try:
            objs[local] = _resolve(target)
        except (ImportError, AttributeError) as e:
            problems.append(f"{path.name}: `{target.replace(':', ' import ')}` fails ({type(e).__name__}: {e})")
    for alias, module in modules.items():
        try:
            objs[alias] = importlib.import_module(module)
        except ImportError as e:
            problems.append(f"{path.name}: `import {module}` fails ({e})")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, obj, name = node.func, None, None
        if isinstance(func, ast.Name) and func.id in objs:
            obj, name = objs[func.id], func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in objs \
                and inspect.ismodule(objs[func.value.id]):
            mod = objs[func.value.id]
            if not hasattr(mod, func.attr):
                problems.append(f"{path.name}:{node.lineno}: {mod.__name__} has no {func.attr}")
                continue
            obj, name = getattr(mod, func.attr), f"{func.value.id}.{func.attr}"
        if obj is not None and (why := _binds(obj, node)) is not None:
            problems.append(f"{path.name}:{node.lineno}: {name}(...) does not fit its signature: {why}")
    return problems


def test_opt_in_code_calls_the_package_as_it_is():
    files = opt_in_files()
    assert len(files) >= 8, files  # the vllm and harbor tests, and the GPU measurement scripts
    assert [p for f in files for p in call_problems(f)] == []


def test_control_a_stale_call_and_a_renamed_import_are_caught(tmp_path):
    snippet = ("import torch\n"
               "from tsrl_cli.policy import load_policy\n"
               "from tsrl_cli.policy import no_such_function\n"
               "import tsrl_cli.devices as dv\n"
               "def helper(model_dir):\n"
               "    load_policy(model_dir, dtype=torch.float32)\n"      # fine: dtype by keyword
               "    load_policy(model_dir, torch.float32)\n"            # dtype is keyword-only
               "    load_policy(model_dir, colour='red')\n"             # no such parameter
               "    dv.no_such_helper('cpu')\n")
    found = call_problems(tmp_path / "test_x.py", snippet)
    assert len(found) == 4, found
    assert found[0].startswith("test_x.py: `tsrl_cli.policy import no_such_function` fails")
    assert found[1].startswith("test_x.py:7: load_policy(...) does not fit its signature")
    assert found[2].startswith("test_x.py:8: load_policy(...)") and "colour" in found[2]
    assert found[3] == "test_x.py:9: tsrl_cli.devices has no no_such_helper"


@pytest.mark.slow
def test_opt_in_tests_collect():
    """Their module-level imports work here, vLLM or not (the tests import vllm inside themselves)."""
    tests = [str(p.relative_to(REPO)) for p in opt_in_files() if p.relative_to(REPO).parts[0] == "tests"]
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-m", " or ".join(OPT_IN_MARKS), *tests]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    collected = [line for line in r.stdout.splitlines() if "::" in line]
    assert len(collected) >= 4, r.stdout[-1000:]
