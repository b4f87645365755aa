"""The package's structure, checked from its source: no import cycle, imports at module level, the layers,
and one home per concept (one policy loader, one log-prob function, one atomic writer, one error helper).

Every rule has a positive control: the checker is run on a small snippet that breaks the rule.
"""

import ast
import collections
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tsrl_cli"
# may be imported inside functions: optional or heavy packages that only some commands need
LAZY_OK = {"vllm", "peft", "docker", "matplotlib", "swebench", "datasets", "huggingface_hub", "tensorboard", "wandb"}
# (file, module) imported inside a function on purpose, with the reason
LAZY_EXCEPTIONS = {("processes.py", "torch"): "OpenMP reads OMP_NUM_THREADS when torch loads: thread_env() first",
                   ("trackers.py", "torch"): "torch.utils.tensorboard imports the optional tensorboard package"}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        out[".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")] = p
    return out


def imports(tree) -> list[tuple[str, bool, int]]:
    """(module, at module level?, line) of every import in a parsed file."""
    out, in_func = [], set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_func |= {id(n) for n in ast.walk(fn) if n is not fn}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) not in in_func, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, id(node) not in in_func, node.lineno))
            out += [(f"{node.module}.{a.name}", id(node) not in in_func, node.lineno) for a in node.names]
    return out


def graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges = collections.defaultdict(set)
    for m, p in mods.items():
        for name, _, _ in imports(ast.parse(p.read_text())):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m:
                edges[m].add(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def package_of(m: str) -> str:
    parts = m.split(".")
    return ".".join(parts[:2])


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules_or_packages():
    edges = graph(modules())
    assert cycles(edges) == []
    pkg = collections.defaultdict(set)
    for a, bs in edges.items():
        pkg[package_of(a)] |= {package_of(b) for b in bs if package_of(b) != package_of(a)}
    assert cycles(pkg) == []


def lazy_imports(rel: str, tree) -> list[str]:
    return [f"{rel}:{line} imports {name} inside a function" for name, top, line in imports(tree)
            if not top and name.split(".")[0] not in LAZY_OK
            and (rel.split("/")[-1], name.split(".")[0]) not in LAZY_EXCEPTIONS]


def test_lazy_import_check_flags_one():
    assert lazy_imports("x.py", ast.parse("def f():\n    import json\n    import vllm\n")) == \
        ["x.py:2 imports json inside a function"]


def test_imports_are_at_module_level_outside_cli():
    bad = []
    for p in modules().values():
        rel = str(p.relative_to(ROOT))
        if not rel.startswith("cli/"):
            bad += lazy_imports(rel, ast.parse(p.read_text()))
    assert bad == []


def third_party(tree) -> set[str]:
    return {name.split(".")[0] for name, _, _ in imports(tree)} - {"tsrl_cli"}


def internal(tree) -> set[str]:
    return {name for name, _, _ in imports(tree) if name.startswith("tsrl_cli")}


# lower layers import no higher one
LOW = ("errors.py", "files.py", "devices.py", "console.py", "tokenizer.py", "rollouts.py", "config.py", "policy.py",
       "processes.py", "core/")
HIGH = ("tsrl_cli.rl", "tsrl_cli.evals", "tsrl_cli.embedded", "tsrl_cli.envs", "tsrl_cli.agent", "tsrl_cli.engines",
        "tsrl_cli.sandbox", "tsrl_cli.datasets", "tsrl_cli.report", "tsrl_cli.sweep", "tsrl_cli.verify",
        "tsrl_cli.predict")


def layer_problems(rel: str, tree) -> list[str]:
    names, libs = internal(tree), third_party(tree)
    out = [f"{rel}: imports {x} (nothing in the package imports the recipes or experiments)"
           for x in libs & {"recipes", "experiments"}]
    if rel.startswith("core/"):
        out += [f"{rel}: imports {n} (core is pure math: torch and core/ only)" for n in names
                if not n.startswith("tsrl_cli.core")]
        out += [f"{rel}: imports {x} (core imports only torch)" for x in libs - set(sys.stdlib_module_names) - {"torch"}]
    if rel == "config.py":
        out += [f"{rel}: imports {n} (config imports no rl, and no torch through policy)" for n in names
                if n.startswith(("tsrl_cli.rl", "tsrl_cli.policy"))]
        out += [f"{rel}: imports {x} (config is importable without torch)" for x in libs & {"torch", "transformers"}]
    if not rel.startswith("cli/") and rel != "__main__.py":
        out += [f"{rel}: imports {n} (only cli/ imports cli/)" for n in names if n.startswith("tsrl_cli.cli")]
    if rel.startswith(LOW):
        out += [f"{rel}: imports {n} (a lower layer imports no higher one)" for n in names if n.startswith(HIGH)]
    if not rel.startswith("cli/") and rel != "console.py":
        out += [f"{rel}: imports {x} (UI belongs to cli/ and console.py)" for x in libs & {"typer", "rich"}]
    return out


def test_layer_check_flags_a_violation():
    assert layer_problems("core/x.py", ast.parse("import numpy\nfrom tsrl_cli.rl import learner\n"))
    assert layer_problems("config.py", ast.parse("from tsrl_cli.rl.learner import Objective\n"))
    assert layer_problems("rl/x.py", ast.parse("import rich\n"))
    assert layer_problems("evals/x.py", ast.parse("from tsrl_cli.cli import app\n"))
    assert layer_problems("policy.py", ast.parse("from tsrl_cli.rl.train import train\n"))
    assert not layer_problems("rl/x.py", ast.parse("import torch\nfrom tsrl_cli.core import losses\n"))


def test_layers():
    bad = []
    for p in modules().values():
        bad += layer_problems(str(p.relative_to(ROOT)), ast.parse(p.read_text()))
    assert bad == []


def homes(attr: str, qualifier: str | None = None) -> set[str]:
    """Files (relative to tsrl_cli/) that call `.attr(...)` (on `qualifier.` when given)."""
    out = set()
    for p in modules().values():
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr:
                q = n.func.value
                if qualifier is None or (isinstance(q, ast.Name) and q.id == qualifier):
                    out.add(str(p.relative_to(ROOT)))
    return out


@pytest.mark.parametrize("attr,qualifier,allowed", [
    ("from_pretrained", None, {"policy.py"}),  # one function loads a policy (and its tokenizer)
    ("log_softmax", "torch", {"core/losses.py", "engines/hf.py"}),  # token log-probs; the sampler's distribution
    ("replace", "os", {"files.py"}),  # atomic writes
    ("rename", None, {"files.py"}),
    ("mkstemp", "tempfile", {"files.py"}),
    ("fsync", "os", {"files.py", "evals/runner.py"}),  # the runner appends one fsynced record line at a time
])
def test_one_home(attr, qualifier, allowed):
    assert homes(attr, qualifier) <= allowed, homes(attr, qualifier) - allowed
    assert homes(attr, qualifier) & allowed  # positive control: the home itself is found


def test_home_finder_sees_a_second_home(tmp_path, monkeypatch):
    (tmp_path / "tsrl_cli").mkdir()
    (tmp_path / "tsrl_cli" / "a.py").write_text("import os\nos.replace('x', 'y')\n")
    (tmp_path / "tsrl_cli" / "b.py").write_text("import os\nos.replace('x', 'y')\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "tsrl_cli")
    assert homes("replace", "os") == {"a.py", "b.py"}


def test_one_error_to_exit_helper():
    """Only cli/_errors.py turns UsageError into exit 2 (cli/__init__.main catches what escapes a command)."""
    found = set()
    for p in modules().values():
        rel = str(p.relative_to(ROOT))
        if not rel.startswith("cli/"):
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ExceptHandler) and isinstance(n.type, ast.Name) and n.type.id == "UsageError":
                found.add(rel)
            if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "Exit" and n.args \
                    and isinstance(n.args[0], ast.Constant) and n.args[0].value == 2:
                found.add(rel)
    assert found == {"cli/_errors.py", "cli/__init__.py"}
