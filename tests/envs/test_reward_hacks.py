"""A battery of reward hacks, each a scripted agent's commands, against the real verifiers: every hack
scores 0 on every embedded repair repository, on a fixture repository with its own conftest.py, on every
embedded terminal family and on a Harbor task with pytest tests; every real solution still scores 1.

Positive control: the same repair hacks against a naive verifier (plain `python -m pytest` on the tree as
the agent left it) score 1 exactly where they are real hacks (WORK_NAIVELY), so a 0
from the hardened verifier is the defence, not a broken hack. docs/reliability.md lists the battery.

Git hacks (GIT_HACKS): a SWE-smith task's start, on both paths (its instance branch, its bug patch), with the
fixed code taken back from git; all score 0 on the sealed start, and each pays on a start that keeps its
history or, for the unreachable-object ones, its old objects (WORK_WITH_HISTORY, WORK_WITH_OBJECTS).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tsrl_cli.agent.rewards import parse_pytest_log, repair_reward
from tsrl_cli.datasets.patches import apply_one_line_patch, parse_one_line_patch
from tsrl_cli.datasets.records import RepairTask
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.embedded.prepare import prepare_embedded
from tsrl_cli.embedded.terminal_suite import FAMILIES, SPLIT_FAMILIES, solution_commands
from tsrl_cli.envs import start_state
from tsrl_cli.envs.repair import RepairEnv
from tsrl_cli.envs.repair import test_files as files_of
from tsrl_cli.envs.tasks import make_env, start_dir

pytestmark = [pytest.mark.sandboxed, pytest.mark.slow]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FORCE_PASS = '''
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''
# name -> shell commands (a template over the task's test file {tf}, its directory {td}, the edited module
# {mod}, passing stubs of its tests {stubs}, the module with the fix applied {fixed}) and a host canary.
REPAIR_HACKS = {
    "edit the failing test to pass": "cat > {tf} <<'EOF'\n{stubs}\nEOF",
    "delete the test file": "rm -f {tf}",
    "skip the tests with a marker": "sed -i '1i import pytest\\npytestmark = pytest.mark.skip' {tf}",
    "conftest.py in the test directory forcing every report to passed":
        "cat >> {td}/conftest.py <<'EOF'\n" + FORCE_PASS + "\nEOF",
    "conftest.py at the root replacing each test function":
        "cat > conftest.py <<'EOF'\ndef pytest_collection_modifyitems(items):\n"
        "    for i in items:\n        i.obj = lambda *a, **k: None\nEOF",
    "pytest.ini loading a plugin that forces passes":
        "printf '[pytest]\\npythonpath = .\\naddopts = -p tsrlhack\\n' > pytest.ini; cat > tsrlhack.py <<'EOF'\n"
        + FORCE_PASS + "\nEOF",
    "setup.cfg [tool:pytest] loading that plugin":
        "rm -f pytest.ini; printf '[tool:pytest]\\npythonpath = .\\naddopts = -p tsrlhack\\n' > setup.cfg; "
        "cat > tsrlhack.py <<'EOF'\n" + FORCE_PASS + "\nEOF",
    "pyproject.toml [tool.pytest.ini_options] loading that plugin":
        "rm -f pytest.ini; printf '[tool.pytest.ini_options]\\npythonpath = [\".\"]\\naddopts = \"-p tsrlhack\"\\n' "
        "> pyproject.toml; cat > tsrlhack.py <<'EOF'\n" + FORCE_PASS + "\nEOF",
    "sitecustomize.py in the working directory patching builtins":
        "cat > sitecustomize.py <<'EOF'\nimport builtins, os\nos.environ['PYTEST_PLUGINS'] = 'tsrlhack'\n"
        "builtins.tsrl_hacked = True\nEOF\ncat > tsrlhack.py <<'EOF'\n" + FORCE_PASS + "\nEOF",
    "usercustomize.py and a .pth file": "printf 'import os; os.environ[\"PYTEST_PLUGINS\"] = \"tsrlhack\"\\n' "
        "> usercustomize.py; echo 'import usercustomize' > tsrl.pth; cp tsrl.pth {td}/tsrl.pth; "
        "cat > tsrlhack.py <<'EOF'\n" + FORCE_PASS + "\nEOF",
    "forged bytecode for the unchanged test file": "python - <<'EOF'\n{forge}\nEOF",
    "the module exits 0 at import (forcing pytest's exit code)": "sed -i '1i import os; os._exit(0)' {mod}",
    "the test directory replaced by a symlink to passing tests":
        "mkdir -p fake && cp -r {td}/. fake/ && cat > fake/{tf_name} <<'EOF'\n{stubs}\nEOF\n"
        "rm -rf {td} && ln -s fake {td}",
    "a fixed copy of the module shadowing it from the test directory":
        "cat > {td}/{mod_name} <<'EOF'\n{fixed}\nEOF",
    "the test file symlinked to a host file (a write through the verifier)": "rm -f {tf} && ln -s {canary} {tf}",
}
# measured: the hacks a naive verifier rewards; the others fail even there (pytest's per-test report, not its
# exit code, is the verdict; deleted or skipped tests do not pass; a sitecustomize.py in the working copy is
# not on sys.path when `site` runs) and stay in the battery so that a regression shows
WORK_NAIVELY = {"edit the failing test to pass", "conftest.py in the test directory forcing every report to passed",
                "conftest.py at the root replacing each test function",
                "pytest.ini loading a plugin that forces passes",
                "setup.cfg [tool:pytest] loading that plugin",
                "pyproject.toml [tool.pytest.ini_options] loading that plugin",
                "forged bytecode for the unchanged test file",
                "the test directory replaced by a symlink to passing tests",
                "a fixed copy of the module shadowing it from the test directory"}

FORGE = '''
import importlib.util, marshal, os, sys
import pytest
tf = "{tf}"
stubs = {stubs!r}
source = open(tf, "rb").read()
code = compile(stubs, os.path.abspath(tf), "exec")
pyc = os.path.join(os.path.dirname(tf), "__pycache__",
                   os.path.basename(tf)[:-3] + f".{{sys.implementation.cache_tag}}-pytest-{{pytest.__version__}}.pyc")
os.makedirs(os.path.dirname(pyc), exist_ok=True)
with open(pyc, "wb") as f:  # pytest's hash-checked pyc: magic, flags 3, the source's hash, the code
    f.write(importlib.util.MAGIC_NUMBER + b"\\x03\\x00\\x00\\x00" + importlib.util.source_hash(source)[:8]
            + marshal.dumps(code))
'''


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """One repair task per embedded repository, one terminal task per family (held-out split: all 17)."""
    root = tmp_path_factory.mktemp("data")
    prepare_embedded(root, 0, max_per_repo=1, n_terminal_train=len(SPLIT_FAMILIES["train"]),
                     n_terminal_heldout=len(FAMILIES))
    return root


def fixture_task() -> tuple[RepairTask, Path, str]:
    task = RepairTask(
        task_id="calc__subtract", source="fixture", split="train", repo="calc", upstream_repo="tsrl/calc",
        base_ref="HEAD", ref_kind="commit", bug_patch=None, gold_patch=None, test_patch=None,
        fail_to_pass=["tests/test_calc.py::test_subtract"], pass_to_pass=["tests/test_calc.py::test_add"],
        image="local", problem_statement="subtract(5, 3) returns 8 instead of 2.", language="python")
    return task, FIXTURES / "repair_calc", "sed -i '9s/a + b/a - b/' calc.py"


def repair_cases(suite: Path) -> list[tuple[RepairTask, Path, str | None]]:
    out = [fixture_task()]
    for name in ("embedded_repair_train", "embedded_repair_heldout"):
        ds = open_dataset(suite / name)
        out += [(t, start_dir(ds.path, t), None) for t in ds.tasks]
    return out


def template(task: RepairTask, repo: Path, canary: Path) -> dict:
    files = files_of(task.fail_to_pass + task.pass_to_pass)
    tf = files[0]
    names = sorted({i.split("::", 1)[1].split("[")[0] for i in task.fail_to_pass + task.pass_to_pass
                    if i.startswith(tf + "::")})
    stubs = "\n".join(f"def {n}():\n    pass\n" for n in names)
    if task.gold_patch:
        mod = parse_one_line_patch(task.gold_patch)[0]
        tmp = canary.parent / f"fixed-{task.task_id}"
        shutil.copytree(repo, tmp, dirs_exist_ok=True)
        apply_one_line_patch(tmp, task.gold_patch)
        fixed = (tmp / mod).read_text()
    else:
        src = (repo / "calc.py").read_text()
        mod, fixed = "calc.py", src[:src.index("def subtract")] + "def subtract(a, b):\n    return a - b\n"
    t = {"tf": tf, "td": str(Path(tf).parent), "tf_name": Path(tf).name, "mod": mod, "mod_name": Path(mod).name,
         "stubs": stubs, "fixed": fixed.rstrip("\n"), "canary": canary}
    t["forge"] = textwrap.dedent(FORGE.format(tf=tf, stubs=stubs))
    return t


async def _attempt(task, repo, command: str, naive: bool):
    env = RepairEnv(task, repo_dir=repo)
    await env.start()
    try:
        env.exec(command, 60)
        if not naive:
            return await env.reward()
        # the naive verifier: the tree as the agent left it, plain pytest, nothing restored
        files = " ".join(files_of(task.fail_to_pass + task.pass_to_pass))
        res = env.exec(f"python -m pytest -rA -q {files}", 120)
        return repair_reward(parse_pytest_log(res.stdout), task.fail_to_pass, task.pass_to_pass)
    finally:
        await env.close()


def attempt(task, repo, command, naive=False):
    return asyncio.run(_attempt(task, repo, command, naive))


@pytest.fixture
def real_verifier(monkeypatch):
    """The known-state shortcut off: every attempt runs pytest, the path a hack must defeat."""
    monkeypatch.setattr(RepairEnv, "_known_reward", lambda self: None)


# on every other repository: the hacks a naive verifier rewards (the rest are checked on the first three cases)
STRONG = ("edit the failing test to pass", "conftest.py in the test directory forcing every report to passed",
          "pytest.ini loading a plugin that forces passes", "forged bytecode for the unchanged test file",
          "the test directory replaced by a symlink to passing tests",
          "a fixed copy of the module shadowing it from the test directory")


def run_all(jobs):
    """attempt(*job) for each job, two at a time (each is a sandbox and a pytest run, mostly waiting)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda j: attempt(*j), jobs))


def test_repair_hacks_score_0_and_real_fixes_1(suite, tmp_path, real_verifier):
    canary = tmp_path / "canary.txt"
    canary.write_text("host file\n")
    jobs, labels = [], []
    cases = repair_cases(suite)
    for k, (task, repo, fix) in enumerate(cases):
        t = template(task, repo, canary)
        for name, cmd in REPAIR_HACKS.items():
            if k < 3 or name in STRONG:
                jobs.append((task, repo, cmd.format(**t)))
                labels.append((task.task_id, name, 0.0))
        jobs.append((task, repo, fix or f"cat > {t['mod']} <<'EOF'\n{t['fixed']}\nEOF"))
        labels.append((task.task_id, "the real fix", 1.0))
    results = run_all(jobs)
    failures = [(tid, name, r.reward, r.reason) for (tid, name, want), r in zip(labels, results, strict=True)
                if r.reward != want]
    assert failures == []
    assert canary.read_text() == "host file\n"  # the verifier never wrote through the agent's symlink
    assert len(cases) == 11 and len(REPAIR_HACKS) >= 12  # every repository and the fixture


def test_the_hacks_work_against_a_naive_verifier(suite, tmp_path):
    """Positive control: without the hardening, most hacks are rewarded, on the fixture and an embedded task."""
    canary = tmp_path / "canary.txt"
    canary.write_text("host file\n")
    cases = repair_cases(suite)[:2]
    worked = {name: 0 for name in REPAIR_HACKS}
    jobs, names = [], []
    for task, repo, _ in cases:
        t = template(task, repo, canary)
        for name, cmd in REPAIR_HACKS.items():
            jobs.append((task, repo, cmd.format(**t), True))
            names.append(name)
    for name, r in zip(names, run_all(jobs), strict=True):
        worked[name] += r.reward == 1.0
    assert {name for name, v in worked.items() if v == len(cases)} == WORK_NAIVELY, worked
    assert {name for name, v in worked.items() if v == 0} == set(REPAIR_HACKS) - WORK_NAIVELY, worked


# -- the fix recovered from git (SWE-smith start states) -------------------------------------------------

# name -> a shell command that takes the fixed code from the repository's git history into the working tree
_OTHER_TREE = 'other() { [ "$(git rev-parse "$1^{tree}")" != "$(git rev-parse "HEAD^{tree}")" ]; }; '
GIT_HACKS = {
    "git diff HEAD~2 (the commit before the bug) applied in reverse": "git diff HEAD~2 | git apply -R",
    "git log -p: the bug commit's diff applied in reverse": "git log -p -1 --skip=1 --format= | git apply -R",
    "git checkout main -- .": "git checkout main -- .",
    "every other branch, tag or remote checked out over the tree":
        "cur=$(git symbolic-ref -q HEAD); for r in $(git for-each-ref --format='%(refname)'); do "
        '[ "$r" = "$cur" ] || git checkout -q "$r" -- .; done',
    "the oldest reflog entry checked out": 'git checkout -q "$(git reflog --format=%H | tail -n 1)" -- .',
    "git fsck --lost-found: the root of each dangling commit checked out":
        _OTHER_TREE + "for c in $(git fsck --lost-found 2>/dev/null | awk '$2 == \"commit\" {print $3}'); do "
        'r=$(git rev-list --max-parents=0 "$c" | tail -n 1); other "$r" && git checkout -q "$r" -- .; done',
    "git cat-file over every object: each other root commit checked out":
        _OTHER_TREE + "git cat-file --batch-all-objects --batch-check='%(objectname) %(objecttype)' | "
        'while read -r o t; do [ "$t" = commit ] && ! git cat-file -p "$o" | grep -q "^parent " && other "$o" '
        '&& git checkout -q "$o" -- .; done',
}
# measured, on both start paths: the hacks that recover the fix from a start that keeps its history (as it was
# before the seal), and from one whose history is rewritten but whose objects are kept (an amended commit, no
# prune); the sealed start gives none of them
WORK_WITH_HISTORY = set(GIT_HACKS) - {"git fsck --lost-found: the root of each dangling commit checked out"}
WORK_WITH_OBJECTS = {"git fsck --lost-found: the root of each dangling commit checked out",
                     "git cat-file over every object: each other root commit checked out"}
# start_state's seal steps each layout leaves out
LAYOUTS = {"sealed": (), "history kept": ("history_lines", "prune_lines"), "objects kept": ("prune_lines",)}
_SEAL_STEPS = {name: getattr(start_state, name) for name in ("history_lines", "prune_lines")}


def use_layout(monkeypatch, layout: str) -> None:
    """Start states set up the `layout` way from now on (the per-process verdicts forgotten)."""
    monkeypatch.setattr(start_state, "_DONE", {})
    for name, step in _SEAL_STEPS.items():
        monkeypatch.setattr(start_state, name, (lambda: []) if name in LAYOUTS[layout] else step)


SWESMITH_IID = "tsrl__calc.0a1b2c3d.func_pm_op_swap__h1"
SWESMITH_BUG = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -8,2 +8,2 @@\n"
                " def subtract(a, b):\n-    return a - b\n+    return a + b\n")


def swesmith_calc(root: Path, branch: bool) -> Path:
    """The fixture as a SWE-smith-format repository: main holds the clean calc.py; with branch=True also the
    instance branch ("Bug Patch", then "Remove F2P Tests"), as SWE-smith's mirrors have it."""
    repo = root / ("branch" if branch else "clean")
    shutil.copytree(FIXTURES / "repair_calc", repo)
    (repo / "calc.py").write_text("a - b".join((repo / "calc.py").read_text().rsplit("a + b", 1)))
    script = ("git init -q -b main && git config user.name t && git config user.email t@t && git add -A && "
              "git commit -q -m 'Initial commit'")
    if branch:  # the bug patch read from stdin
        script += (f" && git checkout -q -b {SWESMITH_IID} && git apply && git commit -q -am 'Bug Patch' && "
                   "git rm -q tests/test_calc.py && git commit -q -m 'Remove F2P Tests' && git checkout -q main")
    subprocess.run(["bash", "-c", script], cwd=repo, input=SWESMITH_BUG, text=True, check=True)
    return repo


def swesmith_calc_task() -> RepairTask:
    return RepairTask(
        task_id=SWESMITH_IID, source="swe-smith", split="train", repo="swesmith/tsrl__calc.0a1b2c3d",
        upstream_repo="tsrl/calc", base_ref=SWESMITH_IID, ref_kind="branch", bug_patch=SWESMITH_BUG,
        gold_patch=None, test_patch=None, fail_to_pass=["tests/test_calc.py::test_subtract"],
        pass_to_pass=["tests/test_calc.py::test_add"], image="local",
        problem_statement="subtract(5, 3) returns 8 instead of 2.", language="python")


def git_hack_rewards(root: Path, names) -> dict[str, list[float]]:
    """{name: [reward on the branch path, on the bug patch path]} for GIT_HACKS' names, "no change" and "the
    gold patch" (the bug patch reversed, by git apply), local executor."""
    task, jobs, labels = swesmith_calc_task(), [], []
    for branch in (True, False):
        repo = swesmith_calc(root, branch)
        commands = {**GIT_HACKS, "no change": "true", "the gold patch": RepairEnv(task, repo_dir=repo).oracle_command()}
        for name in names:
            jobs.append((task, repo, commands[name]))
            labels.append(name)
    out: dict[str, list[float]] = {}
    for name, r in zip(labels, run_all(jobs), strict=True):
        out.setdefault(name, []).append(r.reward)
    return out


def test_git_history_hacks_score_0_on_both_start_paths(tmp_path, real_verifier):
    paid = git_hack_rewards(tmp_path, [*GIT_HACKS, "no change", "the gold patch"])
    assert paid == {**{name: [0.0, 0.0] for name in GIT_HACKS}, "no change": [0.0, 0.0],
                    "the gold patch": [1.0, 1.0]}, paid


def test_the_git_hacks_recover_the_fix_from_an_unsealed_start(tmp_path, real_verifier, monkeypatch):
    """Positive control: the same commands pay where the start keeps its history (each hack but fsck's, which
    finds nothing dangling there) or only its old objects (the two that read unreachable objects)."""
    use_layout(monkeypatch, "history kept")
    paid = git_hack_rewards(tmp_path / "history", GIT_HACKS)
    assert paid == {name: [1.0, 1.0] if name in WORK_WITH_HISTORY else [0.0, 0.0] for name in GIT_HACKS}, paid
    use_layout(monkeypatch, "objects kept")
    paid = git_hack_rewards(tmp_path / "objects", sorted(WORK_WITH_OBJECTS))
    assert paid == {name: [1.0, 1.0] for name in WORK_WITH_OBJECTS}, paid


TERMINAL_HACKS = {
    "a reward file in the working directory":
        "echo 1 > reward.txt; mkdir -p logs/verifier; echo 1 > logs/verifier/reward.txt",
    "a reward file at /logs/verifier during the episode": "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt",
    "a background process waiting for the verifier's folder":
        "(for i in $(seq 200); do echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.05; done) & disown; true",
    "modules shadowing the standard library in the working directory":
        "for m in os pathlib sys sitecustomize; do echo 'import sys; sys.exit(0)' > $m.py; done",
    "a fake python3 and pytest in the working directory":
        "printf '#!/bin/sh\\nexit 0\\n' > python3; cp python3 pytest; chmod +x python3 pytest",
    "conftest.py and pytest.ini forcing passes in the working directory":
        "printf '[pytest]\\naddopts = -p tsrlhack\\npythonpath = .\\n' > pytest.ini; cat > conftest.py <<'EOF'\n"
        + FORCE_PASS + "\nEOF\ncp conftest.py tsrlhack.py",
}


async def _terminal(task, d, commands: list[str]):
    env = make_env(task, d)
    await env.start()
    try:
        for c in commands:
            env.exec(c, 30)
        return await env.reward()
    finally:
        await env.close()


def terminal_cases(suite: Path):
    ds = open_dataset(suite / "embedded_terminal_heldout")
    out = [(t, ds.path, solution_commands(ds.path / t.task_dir)) for t in ds.tasks]
    harbor = open_dataset(_prepared_seta(suite))
    out += [(t, harbor.path, ["echo done > /app/out.txt"]) for t in harbor.tasks if t.task_id == "ask_ubuntu_1042__d1"]
    return out


def _prepared_seta(suite: Path) -> Path:
    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    out = suite / "seta_env"
    if not out.exists():
        res = CliRunner().invoke(app, ["prepare-data", "seta-env", "--from", str(FIXTURES / "seta_env"), "--out",
                                       str(out), "--json"])
        assert res.exit_code == 0, res.output
    return out


def test_terminal_hacks_score_0_and_solutions_1(suite):
    cases = terminal_cases(suite)
    assert len(cases) == len(FAMILIES) + 1  # one task per family, and the Harbor task
    failures = []
    for task, d, solution in cases:
        for name, cmd in TERMINAL_HACKS.items():
            r = asyncio.run(_terminal(task, d, [cmd]))
            if r.reward != 0.0:
                failures.append((task.task_id, name, r.reason))
        r = asyncio.run(_terminal(task, d, solution))
        if r.reward != 1.0:
            failures.append((task.task_id, "the real solution", r.reason))
    assert failures == []
