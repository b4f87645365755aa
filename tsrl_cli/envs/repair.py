"""Repair environment: the agent edits a repository in a sandbox; the task's tests give the reward.

Start state: a copy of the repository at its start state (the bug already in place), from a
local directory (`repo_dir`, local executor) or from the task's image (docker executor).
Reward (after submission or when a limit ends the trajectory): the working copy is put in a state
the agent cannot steer (`secure_tree`, local executor): the test directories (those of the
FAIL_TO_PASS / PASS_TO_PASS files) are restored to the start state, agent-added files there
removed; every file that configures pytest or Python from inside the tree (conftest.py, pytest.ini,
tox.ini, setup.cfg, pyproject.toml, sitecustomize.py, usercustomize.py, *.pth) is the start state's
or gone; bytecode caches are deleted; symlinks on those paths are replaced, never followed (the
verifier runs on the host). Then `python -I -B -m pytest -p no:cacheprovider` runs in the same
sandbox with the verifier's own timeout: isolated mode puts neither the working directory nor
PYTHON* variables nor a user site on sys.path, so nothing the agent left there is imported at
start. pytest's -rA summary is parsed; binary or pass-ratio reward. A crashing or hanging
verifier gives reward 0 with the reason, never an exception. Known limit: the code under test runs
inside the verifier's process, so code the agent wrote into the source files themselves can still
reach pytest's internals (as in SWE-bench's harness); docs/reliability.md lists what is covered.

Known states (local executor, tasks that ship their start state and a one-file gold patch, as the
embedded suite does): a task's start state and its gold state were both run through the tests when
the suite was built (start: FAIL_TO_PASS fail; gold: everything passes). When the working tree after
the tests are restored is byte-identical to one of them, the reward is that validated result and
pytest is not run again (the tests are deterministic; any other state, e.g. one extra file, runs them).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from tsrl_cli.agent.loop import RewardResult
from tsrl_cli.agent.rewards import parse_pytest_log, repair_reward
from tsrl_cli.datasets.patches import apply_one_line_patch
from tsrl_cli.envs.base import SandboxEnv
from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox import Limits

INSTRUCTION = (
    "{problem}\n\nThe repository is in the current directory. Fix the bug in the source code so that the "
    "tests pass. Do not edit the tests. Reply with `submit` when you are done."
)


# files that configure pytest or Python from inside the tree: only the start state's count
GUARDED_NAMES = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
                 "usercustomize.py")


def test_files(test_ids: list[str]) -> list[str]:
    """Files named by pytest ids ("tests/test_x.py::test_y" -> "tests/test_x.py"), in order, unique."""
    seen: dict[str, None] = {}
    for t in test_ids:
        seen.setdefault(t.split("::", 1)[0], None)
    return list(seen)


_SKIP_DIRS = {"__pycache__", ".pytest_cache"}


def test_dirs(files: list[str]) -> list[str]:
    """The directories holding the test files ("" for a test file at the root: only the file is guarded)."""
    return sorted({os.path.dirname(f) for f in files} - {""})


def _guarded(rel: str, dirs: list[str], files: list[str]) -> bool:
    name = os.path.basename(rel)
    return (name in GUARDED_NAMES or name.endswith(".pth") or rel in files
            or any(rel.startswith(d + "/") for d in dirs))


def _remove(p: Path) -> None:
    """Remove p whatever it is, without following a symlink."""
    if p.is_symlink() or not p.is_dir():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p)


def _place(root: Path, rel: str, src: Path) -> None:
    """Copy src to root/rel through real directories only: a symlink or file in the way is removed first."""
    cur = root
    for part in Path(rel).parts[:-1]:
        cur = cur / part
        if cur.is_symlink() or (cur.exists() and not cur.is_dir()):
            _remove(cur)
        if not cur.exists():
            cur.mkdir()
    dst = root / rel
    if os.path.lexists(dst):
        _remove(dst)
    shutil.copyfile(src, dst, follow_symlinks=False)


def secure_tree(workdir: Path, start: Path, files: list[str]) -> None:
    """Make the working copy's test files, pytest configuration and interpreter hooks the start state's.

    files: the test files (relative paths). Guarded: those files, everything under their directories,
    and every GUARDED_NAMES / *.pth file anywhere. A guarded path the start state lacks is removed; one
    it has is copied back. Bytecode caches go (a forged .pyc of an unchanged test would run instead of
    it). No symlink is followed: this runs on the host, on a tree the agent wrote.
    """
    dirs = test_dirs(files)
    keep = set()
    for dirpath, dirnames, filenames in os.walk(start):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), start)
            if _guarded(rel, dirs, files) and not os.path.islink(os.path.join(dirpath, name)):
                keep.add(rel)
    for dirpath, dirnames, filenames in os.walk(workdir):  # does not descend into symlinked directories
        here = Path(dirpath)
        for d in list(dirnames):
            p, rel = here / d, os.path.relpath(here / d, workdir)
            if d in _SKIP_DIRS or (p.is_symlink() and (_guarded(rel, dirs, files) or rel in dirs)):
                _remove(p)
                dirnames.remove(d)
        for name in filenames:
            p, rel = here / name, os.path.relpath(here / name, workdir)
            if name.endswith(".pyc") or (_guarded(rel, dirs, files) and rel not in keep):
                _remove(p)
    for rel in sorted(keep):
        _place(workdir, rel, start / rel)


def tree_digest(root: Path) -> str:
    """sha256 over (relative path, content) of every file under root, caches skipped; links by target."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            p = Path(dirpath) / name
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


_KNOWN: dict[tuple[str, str], dict[str, RewardResult]] = {}


def known_states(task, repo_dir: Path) -> dict[str, RewardResult]:
    """{tree digest: validated reward} for the start and gold states of a task (memoized per process)."""
    key = (task.task_id, str(repo_dir))
    if key not in _KNOWN:
        states = {tree_digest(repo_dir): RewardResult(0.0, "start state: FAIL_TO_PASS fail (validated at build)")}
        with tempfile.TemporaryDirectory(prefix="tsrl-gold-") as tmp:
            gold = Path(tmp) / "repo"
            shutil.copytree(repo_dir, gold, symlinks=True, ignore=shutil.ignore_patterns(*_SKIP_DIRS, "*.pyc"))
            if apply_one_line_patch(gold, task.gold_patch):
                states[tree_digest(gold)] = RewardResult(1.0, "gold state: all tests pass (validated at build)")
        _KNOWN[key] = states
    return _KNOWN[key]


class RepairEnv(SandboxEnv):
    """One trajectory on one RepairTask. Use `await env.start()` first, `await env.close()` last."""

    def __init__(self, task, *, repo_dir: str | Path | None = None, executor: str = "local",
                 limits: Limits | None = None, allow_unisolated: bool = False, reward_mode: str = "binary",
                 verifier_timeout_s: float = 120.0, python: str = sys.executable):
        super().__init__(executor=executor, limits=limits, allow_unisolated=allow_unisolated)
        self.task, self.task_id, self.image = task, task.task_id, task.image
        self.repo_dir = self.start_path = Path(repo_dir) if repo_dir is not None else None
        if executor == "local" and (self.repo_dir is None or not self.repo_dir.is_dir()):
            raise UsageError(f"task {task.task_id}: the local executor needs the repository at its start state "
                             f"(got {repo_dir}); use --executor docker with the task's image {task.image!r}")
        self.reward_mode, self.verifier_timeout_s, self.python = reward_mode, verifier_timeout_s, python
        self.instruction = INSTRUCTION.format(problem=task.problem_statement.strip())

    def test_command(self) -> str:
        if self.task.test_command:
            return self.task.test_command
        files = test_files(self.task.fail_to_pass + self.task.pass_to_pass)
        # -I: isolated (no cwd, PYTHON* or user site on sys.path); -B: no bytecode written;
        # -p no:cacheprovider: the verifier writes nothing into the repository
        return (f"{shlex.quote(self.python)} -I -B -m pytest -rA -q -p no:cacheprovider "
                + " ".join(map(shlex.quote, files)))

    def _restore_tests(self) -> None:
        if self.repo_dir is None or self.sandbox.executor != "local":
            return  # docker: the image's tests (and the task's test_patch) are the reference
        secure_tree(self.sandbox.workdir, self.repo_dir, test_files(self.task.fail_to_pass + self.task.pass_to_pass))

    def _known_reward(self) -> RewardResult | None:
        """The validated reward when the tree equals the task's start or gold state (see the module doc)."""
        if self.repo_dir is None or self.sandbox.executor != "local" or self.reward_mode != "binary":
            return None
        if self.task.test_command or not self.task.source.startswith("embedded"):
            return None  # only the embedded suite ran both states through its tests when it was built
        return known_states(self.task, self.repo_dir).get(tree_digest(self.sandbox.workdir))

    async def reward(self) -> RewardResult:
        if self.sandbox is None:
            return RewardResult(0.0, "the sandbox never started")
        try:
            await asyncio.to_thread(self._restore_tests)
            known = await asyncio.to_thread(self._known_reward)
            if known is not None:
                return known
            res = await asyncio.to_thread(self.exec, self.test_command(), self.verifier_timeout_s)
        except Exception as e:  # noqa: BLE001 - the verifier's failure is a reward of 0, with its reason
            return RewardResult(0.0, f"verifier error: {type(e).__name__}: {e}")
        if res.limit:
            return RewardResult(0.0, f"verifier stopped by the {res.limit} limit", {"exit_code": res.exit_code})
        status = parse_pytest_log(res.stdout)
        if not status:
            return RewardResult(0.0, f"no test results (exit code {res.exit_code}): {res.stderr.strip()[-200:]}")
        return repair_reward(status, self.task.fail_to_pass, self.task.pass_to_pass, self.reward_mode)
