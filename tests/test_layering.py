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
                   ("trackers.py", "torch"): "torch.utils.tensorboard imports the optional tensorboard package",
                   ("devices.py", "torch"):
                       "config.py parses device specs: predict and report load configs without torch"}


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
        out += [f"{rel}: imports {x} (core imports only torch)"
                for x in libs - set(sys.stdlib_module_names) - {"torch"}]
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
    # the runner appends one fsynced record line at a time; RunLog a durable row (the trajectory journal)
    ("fsync", "os", {"files.py", "evals/runner.py", "rl/runlog.py"}),
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


# The run directory's file names (docs/run-directory.md), and the results tree's sweep.json: every
# reader and writer takes them from rundir.py, so the contract has one home. Left out, each with one
# home of its own: a checkpoint's contents (optimizer.pt: learner_worker.py; adapter/: policy.py),
# tensorboard/ and wandb/ (trackers.py; the names are also packages') and builds/ (train.py's docker
# builds; tbench names its own folders so too). The round-<k> prefix needs "checkpoints" beside it.
RUN_FILES = {"config.yaml", "metrics.jsonl", "events.jsonl", "rollouts.jsonl", "checkpoints", "state.json", "DONE",
             "eval_round0.json", "processes.json", "sweep.json", "journal"}


def run_file_literals(tree) -> list[tuple[int, str, str]]:
    """(line, string, run file) for each string constant naming a run file as a path: the whole
    string, or a part between slashes ("checkpoints/round-1", f"{root}/DONE"), plain or .gz. A name
    among words is a message to a person ("no events.jsonl in the run") and opens nothing, so plain
    and f-string messages may name files; docstrings are prose too. Comments are not in the tree."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return sorted((n.lineno, n.value, name) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                  for name in {part.removesuffix(".gz") for part in n.value.split("/")} & RUN_FILES)


def test_run_file_check_flags_a_literal():
    snippet = ('"""Reads metrics.jsonl."""\n'
               'def f(d):\n    """DONE is written last."""\n'
               '    a = d / "metrics.jsonl"  # events.jsonl in a comment\n'
               '    b = f"{d}/checkpoints/round-{1}"\n    c = d / "events.jsonl.gz"\n'
               '    raise ValueError(f"{d}: no DONE, and no config.yaml in it")\n')
    assert run_file_literals(ast.parse(snippet)) == [(4, "metrics.jsonl", "metrics.jsonl"),
                                                     (5, "/checkpoints/round-", "checkpoints"),
                                                     (6, "events.jsonl.gz", "events.jsonl")]


def test_run_file_names_live_in_rundir():
    bad = []
    for p in modules().values():
        rel = str(p.relative_to(ROOT))
        if rel != "rundir.py":
            bad += [f"{rel}:{line}: {s!r} names {name}; take it from tsrl_cli.rundir"
                    for line, s, name in run_file_literals(ast.parse(p.read_text()))]
    assert bad == []
    # positive control: the home itself is seen naming every one of them
    assert {name for _, _, name in run_file_literals(ast.parse((ROOT / "rundir.py").read_text()))} == RUN_FILES


# ---- engine classes are constructed only by the engine opener ----------------------------------------------
OPENER = "engines/load.py"
# classes of engines/ with a generate() that are not engines, with the reason
NOT_ENGINES = {"PolicyEngine": "the protocol itself", "TurnBatcher": "batches requests for an engine it is given",
               "ContinuousBatcher": "admits requests into the running batch of an engine it is given",
               "_Guarded": "tsrl serve's locked view of the engine it was given"}


def engine_classes() -> set[str]:
    """Every class of tsrl_cli/engines/ that defines generate(), less NOT_ENGINES: the PolicyEngine
    implementations (hf, vllm, the openai client, the scripted one)."""
    out = set()
    for p in (ROOT / "engines").glob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ClassDef) and any(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                   and b.name == "generate" for b in n.body):
                out.add(n.name)
    return out - set(NOT_ENGINES)


def engine_constructions(tree, classes: set[str]) -> list[tuple[int, str]]:
    """(line, class) of every call of an engine class, by name or as an attribute (module.HFEngine(...))."""
    return sorted((n.lineno, name) for n in ast.walk(tree) if isinstance(n, ast.Call)
                  for name in [n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)]
                  if name in classes)


def test_engine_construction_check_flags_one():
    snippet = ("import tsrl_cli.engines.vllm as v\nfrom tsrl_cli.engines.hf import HFEngine\n"
               "def f(m):\n    e = HFEngine(m, pad_id=0)\n    return v.VLLMEngine('dir'), type(e).__name__\n")
    assert engine_constructions(ast.parse(snippet), engine_classes()) == [(4, "HFEngine"), (5, "VLLMEngine")]


def test_engine_classes_are_constructed_only_in_the_opener():
    classes = engine_classes()
    assert {"HFEngine", "VLLMEngine", "OpenAIEngine", "ScriptedEngine"} <= classes  # the finder sees them all
    bad = []
    for p in modules().values():
        rel = str(p.relative_to(ROOT))
        if rel != OPENER:
            bad += [f"{rel}:{line}: constructs {name}; open it through {OPENER}"
                    for line, name in engine_constructions(ast.parse(p.read_text()), classes)]
    assert bad == []
    # positive control: the opener itself is seen constructing the engines it opens
    opened = {name for _, name in engine_constructions(ast.parse((ROOT / OPENER).read_text()), classes)}
    assert opened == {"HFEngine", "VLLMEngine", "OpenAIEngine"}


# ---- a batcher is made by make_batcher only ---------------------------------------------------------------
BATCHER_HOME = "engines/batching.py"
BATCHERS = {"TurnBatcher", "ContinuousBatcher"}


def test_batchers_are_made_only_by_make_batcher():
    """Train's engine and replicas, tsrl serve and evaluations all get their batcher from make_batcher, so
    rollout.batching means the same everywhere."""
    bad = []
    for p in modules().values():
        rel = str(p.relative_to(ROOT))
        tree = ast.parse(p.read_text())
        if rel == BATCHER_HOME:  # there: inside make_batcher only
            tree = ast.Module([n for n in tree.body if getattr(n, "name", None) != "make_batcher"], [])
        bad += [f"{rel}:{line}: constructs {name}; use {BATCHER_HOME} make_batcher"
                for line, name in engine_constructions(tree, BATCHERS)]
    assert bad == []
    # positive control: make_batcher itself is seen constructing both
    home = ast.parse((ROOT / BATCHER_HOME).read_text())
    factory = next(n for n in home.body if getattr(n, "name", None) == "make_batcher")
    assert {name for _, name in engine_constructions(factory, BATCHERS)} == BATCHERS


# ---- the dtype names are listed in config.py only ----------------------------------------------------------
DTYPE_NAMES = {"float16", "float32", "float64", "bfloat16"}


def dtype_name_lists(tree) -> list[tuple[int, list[str]]]:
    """(line, names) of every tuple, list, set or dict-keys literal naming two or more dtypes."""
    out = []
    for n in ast.walk(tree):
        elts = n.elts if isinstance(n, (ast.Tuple, ast.List, ast.Set)) else n.keys if isinstance(n, ast.Dict) else []
        names = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in DTYPE_NAMES]
        if len(names) >= 2:
            out.append((n.lineno, names))
    return out


def test_dtype_list_check_flags_one():
    snippet = ('A = ("float32", "bfloat16")\nB = {"float64": 1e-10, "float32": 1e-4}\nC = ("float32", "auto")\n'
               'D = [*A, "auto"]\nE = {x: 1 for x in ("float64",)}\n')
    assert dtype_name_lists(ast.parse(snippet)) == [(1, ["float32", "bfloat16"]), (2, ["float64", "float32"])]


def test_dtype_names_are_listed_in_config_only():
    from tsrl_cli.config import BUFFER_DTYPES, DTYPES

    bad = []
    for p in modules().values():
        rel = str(p.relative_to(ROOT))
        if rel != "config.py":
            bad += [f"{rel}:{line}: lists dtype names {names}; derive them from config.DTYPES"
                    for line, names in dtype_name_lists(ast.parse(p.read_text()))]
    assert bad == []
    # positive control: the home is seen listing them
    found = [names for _, names in dtype_name_lists(ast.parse((ROOT / "config.py").read_text()))]
    assert list(DTYPES) in found and list(BUFFER_DTYPES) in found


# ---- one name per thing: public functions of engines/, evals/, rl/ have distinct names -------------------
# names shared on purpose, with the reason
SHARED_NAMES = {"label": "evals/swebench.py and evals/tbench.py: each eval's label string for its own results"}


def public_functions(mods: dict[str, pathlib.Path], packages: tuple[str, ...]) -> dict[str, list[str]]:
    """name -> modules defining a public top-level function of that name, within `packages`."""
    out = collections.defaultdict(list)
    for m, p in mods.items():
        if m.startswith(packages):
            for n in ast.parse(p.read_text()).body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_"):
                    out[n.name].append(m)
    return out


def test_duplicate_name_finder_finds_one(tmp_path):
    (tmp_path / "a.py").write_text("def load_engine(cfg):\n    return 1, 2\ndef _x():\n    pass\n")
    (tmp_path / "b.py").write_text("def load_engine(model):\n    return 3\ndef _x():\n    pass\n")
    found = public_functions({"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}, ("p.",))
    assert {k: v for k, v in found.items() if len(v) > 1} == {"load_engine": ["p.a", "p.b"]}


def test_one_name_per_function_in_engines_evals_rl():
    found = public_functions(modules(), ("tsrl_cli.engines", "tsrl_cli.evals", "tsrl_cli.rl"))
    shared = {k: v for k, v in found.items() if len(v) > 1}
    assert set(shared) <= set(SHARED_NAMES), {k: v for k, v in shared.items() if k not in SHARED_NAMES}
    assert "open_engine" in found and len(found["label"]) == 2  # positive control: the finder sees these


# ---- one Docker client opener: sandbox/docker_client.py (the ping, the timeout, one error for "no daemon") ----
DOCKER_CLIENT_HOME = "sandbox/docker_client.py"
DOCKER_CONSTRUCTORS = {"from_env", "DockerClient", "APIClient"}  # the Docker SDK's ways to make a client


def docker_client_constructions(tree) -> list[int]:
    """Lines that make a Docker SDK client: `docker.from_env(...)`, `docker.DockerClient(...)`,
    `docker.APIClient(...)` (through any module path), or those names imported from docker."""
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in DOCKER_CONSTRUCTORS]
    lines += [n.lineno for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("docker")
              and any(a.name in DOCKER_CONSTRUCTORS for a in n.names)]
    return sorted(lines)


def test_docker_client_check_flags_a_construction():
    snippet = ('import docker\n"""docker.from_env() in a docstring opens nothing."""\n'
               'a = docker.from_env(timeout=5)  # docker.from_env in a comment\n'
               'b = docker.DockerClient(base_url="unix:///x")\nfrom docker import APIClient\n'
               'c = docker.client.from_env()\nd = docker.errors.ImageNotFound\n')
    assert docker_client_constructions(ast.parse(snippet)) == [3, 4, 5, 6]


def test_docker_client_is_made_only_in_its_home():
    bad = {str(p.relative_to(ROOT)): found for p in modules().values()
           if (found := docker_client_constructions(ast.parse(p.read_text())))
           and str(p.relative_to(ROOT)) != DOCKER_CLIENT_HOME}
    assert bad == {}, f"{bad}: open Docker through tsrl_cli.sandbox.docker_client.docker_client(timeout_s, what)"
    # positive control: the home itself is seen making one
    assert docker_client_constructions(ast.parse((ROOT / DOCKER_CLIENT_HOME).read_text()))


# ---- rooms stay small: a module size cap with a named list of exceptions that only shrinks -------------------
SIZE_CAP = 500  # lines; a module past it is carved into rooms (one concept each) before it grows further
OVER_CAP = {  # module -> why it is still one room; the test fails when one of them drops under the cap
    "config.py": "every section of the run's config beside its own checks, documented field by field",
    "embedded/repair_suite.py": "the embedded repair tasks' source text: data, not logic",
}


def oversized(sizes: dict[str, int], cap: int = SIZE_CAP, allowed: dict | None = None) -> tuple[list, list]:
    """(modules over the cap and not allowed, allowed modules no longer over it: strike them from the list)."""
    allowed = OVER_CAP if allowed is None else allowed
    return (sorted(m for m, n in sizes.items() if n > cap and m not in allowed),
            sorted(m for m in allowed if sizes.get(m, 0) <= cap))


def test_size_check_flags_a_big_module_and_a_stale_exception():
    assert oversized({"a.py": 501, "b.py": 500, "c.py": 10}, allowed={"c.py": "why"}) == (["a.py"], ["c.py"])


def test_modules_stay_under_the_size_cap():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    assert oversized(sizes) == ([], [])


# ---- every worker entry point of rl/ takes one frozen args object -------------------------------------------
def entry_points(tree) -> list[tuple[str, list[str]]]:
    """(name, [annotation of each parameter]) of every top-level function named *_main."""
    return [(n.name, [ast.unparse(a.annotation) if a.annotation else "" for a in n.args.args + n.args.kwonlyargs])
            for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_main")]


def bad_entry_points(tree) -> list[str]:
    return [f"{name}({', '.join(ann)})" for name, ann in entry_points(tree)
            if len(ann) != 1 or not ann[0].endswith("Args")]


def test_entry_point_check_flags_positional_arguments():
    snippet = "def a_main(args: AArgs): ...\ndef b_main(cfg, init_dir, plans): ...\ndef helper(x, y): ...\n"
    assert bad_entry_points(ast.parse(snippet)) == ["b_main(, , )"]


def test_rl_worker_entry_points_take_one_args_object():
    found, bad = [], []
    for p in (ROOT / "rl").glob("*.py"):
        tree = ast.parse(p.read_text())
        found += [name for name, _ in entry_points(tree)]
        bad += [f"rl/{p.name}: {b}" for b in bad_entry_points(tree)]
    assert bad == []
    assert {"rollout_main", "learner_main", "teacher_main", "replica_main"} <= set(found)  # the checker sees them
