"""Every repository path, module and test that the docs name exists, so that a moved file fails here.

Scanned: README.md, docs/*.md, results/REPORT.md, results/reports/README.md and every README.md under
experiments/, recipes/ and tests/ (not the task fixtures). A reference is a code span (`...`) or a
markdown link target, and it is checked when it names

    a path under tsrl_cli/, tests/, experiments/, docs/, recipes/, .ci/, data/embedded_src/,
    data/embedded_policy/, results/reports/ (or results/LOG.md, results/REPORT.md)
                                  exists: a glob (`*`) matches at least one path, and every
                                  alternative of a brace list ({a,b}) exists
    path.py::name, path.py:name   the file defines `name` (a def, class or assignment at any depth)
    tsrl_cli.a.b[.name]           the module exists, and `name` is defined in it

Other paths (run outputs under results/<x>/, prepared data under data/<x>/) are what a command writes, not
files of the repository, and are not checked. NOT_REPOSITORY_PATHS lists the names that look like
repository paths but are not, each with its reason.
"""

import ast
import itertools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# names with a repository prefix that do not name a file of this repository, and why
NOT_REPOSITORY_PATHS = {
    "tests/test.sh": "a task folder's verifier (Harbor / Terminal-Bench task format), not this repository's tests/",
    "experiments/heldout/summarize.py": "results/reports/README.md names it as not in the repository",
}
CHECKED = re.compile(r"(?:tsrl_cli|tests|experiments|docs|recipes|\.ci|data/embedded_src|data/embedded_policy|"
                     r"results/reports)(?:/(?:\{[^\s{}`]*\}|[^\s`'\"()<>,;{}])*)?|results/(?:LOG|REPORT)\.md")
MODULE = re.compile(r"tsrl_cli(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def doc_files(repo: Path = REPO) -> list[Path]:
    files = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), repo / "results" / "REPORT.md",
             repo / "results" / "reports" / "README.md"]
    for top in ("experiments", "recipes", "tests"):
        files += [p for p in sorted((repo / top).rglob("README.md")) if "fixtures" not in p.parts]
    return [f for f in files if f.is_file()]


def references(text: str, doc: Path, repo: Path = REPO) -> list[str]:
    """The repository references of one doc: paths relative to the repository root, or tsrl_cli.dotted."""
    out = []
    for span in CODE_SPAN.findall(text):
        for token in span.split():
            token = token.strip(".,:;)(")
            if MODULE.fullmatch(token):
                out.append(token)
            elif m := CHECKED.match(token.removeprefix("./")):
                out.append(m[0].rstrip(".:"))
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (doc.parent / target).resolve()
        if path.is_relative_to(repo):
            out.append(path.relative_to(repo).as_posix())
    return out


def _expand_braces(path: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", path)
    if len(parts) == 1:
        return [path]
    fixed, choices = parts[::2], [p.split(",") for p in parts[1::2]]
    return ["".join(itertools.chain.from_iterable(zip(fixed, combo + ("",), strict=True)))
            for combo in itertools.product(*choices)]


def defines(path: Path, name: str) -> bool:
    """`name` is a function, class or assigned name somewhere in the Python file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def problem(ref: str, repo: Path = REPO) -> str | None:
    """Why the reference does not resolve, or None when it does."""
    if MODULE.fullmatch(ref):
        parts = ref.split(".")
        for n in range(len(parts), 0, -1):
            base = repo.joinpath(*parts[:n])
            module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if module.is_file():
                rest = parts[n:]
                if not rest:
                    return None
                if len(rest) == 1 and defines(module, rest[0]):
                    return None
                return f"{ref}: {module.relative_to(repo)} defines no {'.'.join(rest)}"
        return f"{ref}: no such module"
    path, sep, name = ref.partition("::") if "::" in ref else ref.partition(".py:")
    if sep == ".py:":
        path += ".py"
    if path in NOT_REPOSITORY_PATHS:
        return None
    matches = []
    for p in _expand_braces(path):  # every alternative of a brace list must exist
        found = list(repo.glob(p)) if "*" in p else [repo / p] if (repo / p).exists() else []
        if not found:
            return f"{ref}: no such path" + (f" ({p})" if p != path else "")
        matches += found
    if name:
        name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", name)
        if name and not any(m.suffix == ".py" and defines(m, name[0]) for m in matches):
            return f"{ref}: {path} defines no {name[0]}"
    return None


def problems(repo: Path = REPO) -> list[str]:
    out = []
    for doc in doc_files(repo):
        for ref in dict.fromkeys(references(doc.read_text(), doc, repo)):
            if (why := problem(ref, repo)) is not None:
                out.append(f"{doc.relative_to(repo)}: {why}")
    return out


def test_every_path_a_doc_names_exists():
    assert problems() == []


def test_the_scan_reads_many_references():
    refs = [r for doc in doc_files() for r in references(doc.read_text(), doc)]
    assert len(doc_files()) >= 12 and len(set(refs)) >= 100


def test_control_missing_paths_tests_and_modules_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tsrl_cli").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "tsrl_cli" / "__init__.py").write_text("")
    (tmp_path / "tsrl_cli" / "m.py").write_text("X = 1\n\ndef f():\n    pass\n")
    (tmp_path / "README.md").write_text(
        "See `tests/test_a.py::test_here`, `tsrl_cli.m.f`, `tsrl_cli/m.py:X` and [a](docs/none.md).\n"
        "Stale: `tests/test_gone.py`, `tests/test_a.py::test_moved`, `tsrl_cli.m.g`, `tsrl_cli.nothere`,"
        " `tests/test_{a,b}.py`, `experiments/*.yaml`.\n")
    found = problems(tmp_path)
    assert found == ["README.md: tests/test_gone.py: no such path",
                     "README.md: tests/test_a.py::test_moved: tests/test_a.py defines no test_moved",
                     "README.md: tsrl_cli.m.g: tsrl_cli/m.py defines no g",
                     "README.md: tsrl_cli.nothere: tsrl_cli/__init__.py defines no nothere",
                     "README.md: tests/test_{a,b}.py: no such path (tests/test_b.py)",
                     "README.md: experiments/*.yaml: no such path", "README.md: docs/none.md: no such path"], found
