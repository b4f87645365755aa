"""Repair environment: the agent edits a repository in a sandbox; the task's tests give the reward.

Start state: a copy of the repository at its start state (the bug already in place), from a
local directory (`repo_dir`, local executor) or from the task's image (docker executor).

Local executor. Reward (after submission or when a limit ends the trajectory): the working copy is
put in a state the agent cannot steer (`secure_tree`): the test directories (those of the
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

Docker executor (SWE-bench and SWE-smith images: the repository at /testbed, its environment in
conda env `testbed` where the image has one, else the image's own python3). `start()` sets up
the start state there: SWE-smith's instance branch (`ref_kind == "branch"`) is checked out;
SWE-bench's image HEAD is kept when it is base_commit or built on it (the harness's image setup
ends with `git commit --allow-empty -am SWE-bench`), else base_commit is checked out. A container
that cannot start or set that up raises (the runner records env_error). Every agent command runs in
/testbed after PRELUDE. The reward is computed the way both official harnesses grade, in a FRESH
container of the same image (nothing the agent did to the image's interpreter or tools is there):
the agent's final diff (`git add -A; git diff --cached --binary <start commit>`) minus every file
the local executor guards (test directories and files, GUARDED_NAMES, *.pth, bytecode) is applied
to the start state; the test files are checked out from the commit that has them (SWE-smith: the
branch's parent when its head is the "Remove F2P Tests" commit; SWE-bench: base_commit, as its eval
scripts do), the task's test_patch is applied, and the container's own `python3 -I -B -m pytest -rA`
runs the test files. A fix that needs one of the guarded files therefore scores 0 here while
SWE-bench's harness (which guards nothing) may resolve it. SWE-smith images are used as they are:
an instance branch the image lacks is an env_error (swesmith's harness fetches it from GitHub;
containers here have no network).

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
from tsrl_cli.sandbox import Limits, Mount, open_sandbox

INSTRUCTION = (
    "{problem}\n\nThe repository is in the current directory. Fix the bug in the source code so that the "
    "tests pass. Do not edit the tests. Reply with `submit` when you are done."
)


TESTBED = "/testbed"
# SWE-bench / SWE-smith images: the repository at /testbed, its environment in conda env `testbed`
PRELUDE = (f"cd {TESTBED} && if [ -f /opt/miniconda3/bin/activate ]; then "
           ". /opt/miniconda3/bin/activate testbed >/dev/null 2>&1; fi\n")
# SWE-smith's instance branches end with this commit, which deletes the FAIL_TO_PASS test files
SWESMITH_HIDE_TESTS = "Remove F2P Tests"
_IO = "/tmp/tsrl-io"  # where files for one command are copied into a container (docker `run(mounts=)`)
_SPLIT = "\0TSRL-DIFF\0"  # between the NUL-separated path list and the diff in final_diff's output

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


def split_diff(names: list[str], diff: str) -> dict[str, str]:
    """{path: its part of the diff} for a `git diff --no-renames` and its `--name-only` list, in order.

    Each file's part starts with a "diff --git " line (no hunk, context or base85 line can start so).
    ValueError when the parts and the names do not pair up.
    """
    parts, cur = [], []
    for line in diff.splitlines(keepends=True):
        if line.startswith("diff --git ") and cur:
            parts.append("".join(cur))
            cur = []
        cur.append(line)
    if cur:
        parts.append("".join(cur))
    if len(parts) != len(names):
        raise ValueError(f"{len(names)} changed paths but {len(parts)} file diffs")
    return dict(zip(names, parts, strict=True))


def unguarded_diff(names: list[str], diff: str, test_file_list: list[str]) -> tuple[str, list[str]]:
    """(the diff without the files the verifier guards, the guarded paths left out).

    Guarded as `secure_tree` guards them: the test files and their directories, GUARDED_NAMES and
    *.pth anywhere, bytecode and caches.
    """
    dirs = test_dirs(test_file_list)
    kept, dropped = [], []
    for path, part in split_diff(names, diff).items():
        cache = path.endswith(".pyc") or any(p in _SKIP_DIRS for p in path.split("/"))
        if cache or _guarded(path, dirs, test_file_list):
            dropped.append(path)
        else:
            kept.append(part)
    return "".join(kept), dropped


class RepairEnv(SandboxEnv):
    """One trajectory on one RepairTask. Use `await env.start()` first, `await env.close()` last."""

    def __init__(self, task, *, repo_dir: str | Path | None = None, executor: str = "local",
                 limits: Limits | None = None, allow_unisolated: bool = False, reward_mode: str = "binary",
                 verifier_timeout_s: float = 120.0, python: str | None = None):
        super().__init__(executor=executor, limits=limits, allow_unisolated=allow_unisolated)
        self.task, self.task_id, self.image = task, task.task_id, task.image
        self.repo_dir = self.start_path = Path(repo_dir) if repo_dir is not None else None
        if executor == "local" and (self.repo_dir is None or not self.repo_dir.is_dir()):
            raise UsageError(f"task {task.task_id}: the local executor needs the repository at its start state "
                             f"(got {repo_dir}); use --executor docker with the task's image {task.image!r}")
        if executor == "docker":
            if task.ref_kind not in ("branch", "commit"):
                raise UsageError(f"task {task.task_id}: its start state is a local folder ({task.ref_kind}), not a "
                                 f"branch or commit in an image's {TESTBED}; use --executor local")
            self.start_path = None  # the image holds the repository; /workdir stays empty
        self.reward_mode, self.verifier_timeout_s = reward_mode, verifier_timeout_s
        self.start_sha: str | None = None  # docker: the commit the agent started from (set by start())
        # the verifier's interpreter: this process's (local sandbox), the container's own (docker)
        self.python = python or (sys.executable if executor == "local" else "python3")
        self.instruction = INSTRUCTION.format(problem=task.problem_statement.strip())

    @property
    def docker(self) -> bool:
        return self.executor == "docker"

    def test_command(self) -> str:
        if self.task.test_command:
            return self.task.test_command
        files = test_files(self.task.fail_to_pass + self.task.pass_to_pass)
        # -I: isolated (no cwd, PYTHON* or user site on sys.path); -B: no bytecode written;
        # -p no:cacheprovider: the verifier writes nothing into the repository
        return (f"{shlex.quote(self.python)} -I -B -m pytest -rA -q -p no:cacheprovider "
                + " ".join(map(shlex.quote, files)))

    # -- start and commands --------------------------------------------------------------------------------

    async def start(self) -> None:
        await super().start()
        if self.docker:
            await asyncio.to_thread(self._checkout_start)

    def _checkout_start(self) -> None:
        """The start state in the image's repository, its commit kept in start_sha (what diffs are taken
        against, so commits the agent makes count too); RuntimeError (the runner's env_error) when it fails.

        SWE-smith: the instance branch is checked out. SWE-bench: the image's HEAD is kept when it is
        base_commit or built on it (the harness's images commit their setup changes on top of
        base_commit, and grade patches against that state); otherwise base_commit is checked out.
        Never forced: a checkout that would discard changes the image holds fails instead.
        """
        ref = shlex.quote(self.task.base_ref)
        keep = "" if self.task.ref_kind == "branch" else f"git merge-base --is-ancestor {ref} HEAD 2>/dev/null || "
        res = self.exec(f"{{ {keep}git checkout -q {ref}; }} && git rev-parse --verify HEAD", 120.0)
        sha = res.stdout.strip().splitlines()[-1:] if res.exit_code == 0 and not res.limit else []
        if not sha:
            raise RuntimeError(f"task {self.task_id}: cannot check out {self.task.base_ref} in {self.image}:{TESTBED} "
                               f"(exit {res.exit_code}): {(res.stderr or res.stdout).strip()[-300:]}")
        self.start_sha = sha[0]

    def exec(self, command: str, timeout_s: float, mounts=None):
        return super().exec(PRELUDE + command if self.docker else command, timeout_s, mounts)

    def _exec_with_files(self, command: str, files: dict[str, str], timeout_s: float, sandbox=None):
        """Run command (docker, after PRELUDE) with files {name: text} copied to _IO/<name> for it."""
        sb = sandbox or self.sandbox
        with tempfile.TemporaryDirectory(prefix="tsrl-io-") as tmp:
            for name, text in files.items():
                Path(tmp, name).write_text(text)
            return sb.run(PRELUDE + command, timeout_s, mounts=[Mount(tmp, _IO)])

    def oracle_command(self) -> str:
        """One bash command, run in the repository, that applies the task's gold patch (SWE-smith rows
        without a text gold patch: their bug patch, reversed). The same text is the oracle's model turn
        in training (rollout.agent oracle)."""
        t = self.task
        patch, reverse = (t.gold_patch, False) if t.gold_patch else (t.bug_patch, True)
        if not patch:
            raise UsageError(f"task {self.task_id} has neither a gold patch nor a bug patch to reverse")
        tag = "TSRL_PATCH_" + hashlib.sha256(patch.encode()).hexdigest()[:16]
        return f"git apply {'-R ' if reverse else ''}- <<'{tag}'\n{patch}\n{tag}"

    async def play_oracle(self) -> None:
        """Apply the gold patch where the agent works (oracle_command); RuntimeError when it does not apply."""
        t = self.task
        command = self.oracle_command()
        if not self.docker and t.gold_patch and await asyncio.to_thread(apply_one_line_patch, self.sandbox.workdir,
                                                                          t.gold_patch):
            return  # a one-line fix (the embedded tasks) is applied in place, without git
        res = await asyncio.to_thread(self.exec, command, 120.0)
        if res.exit_code != 0:
            raise RuntimeError(f"task {self.task_id}: the gold patch does not apply: {res.stderr.strip()[-300:]}")

    # -- the final diff (docker) ---------------------------------------------------------------------------

    def final_diff(self) -> tuple[list[str], str]:
        """(changed paths, the diff) of the repository against the start state, untracked files included."""
        ref = shlex.quote(self.start_sha or self.task.base_ref)
        cmd = (f"git add -A && git diff --cached --no-renames --name-only -z {ref} && printf '\\0TSRL-DIFF\\0' && "
               f"git diff --cached --no-renames --binary --no-color {ref}")
        res = self.exec(cmd, 300.0)
        if res.exit_code != 0 or res.limit:
            raise RuntimeError(f"the final diff failed (exit {res.exit_code}, limit {res.limit}): "
                               f"{res.stderr.strip()[-200:]}")
        if res.truncated:
            raise RuntimeError("the final diff is larger than the sandbox's output cap")
        names, _, diff = res.stdout.partition(_SPLIT)
        return [n for n in names.split("\0") if n], diff

    # -- reward --------------------------------------------------------------------------------------------

    def _restore_tests(self) -> None:
        if self.repo_dir is None or self.docker:
            return
        secure_tree(self.sandbox.workdir, self.repo_dir, test_files(self.task.fail_to_pass + self.task.pass_to_pass))

    def _known_reward(self) -> RewardResult | None:
        """The validated reward when the tree equals the task's start or gold state (see the module doc)."""
        if self.repo_dir is None or self.docker or self.reward_mode != "binary":
            return None
        if self.task.test_command or not self.task.source.startswith("embedded"):
            return None  # only the embedded suite ran both states through its tests when it was built
        return known_states(self.task, self.repo_dir).get(tree_digest(self.sandbox.workdir))

    def verify_script(self, agent_diff: bool) -> str:
        """The fresh container's script (after PRELUDE): the start state, the agent's unguarded diff, the test
        files from the commit that has them (SWE-smith: the branch's parent when its head hides them;
        SWE-bench: base_commit, as its eval scripts do), the test_patch, then the tests."""
        t, q = self.task, shlex.quote
        start = q(self.start_sha or t.base_ref)
        files = test_files(t.fail_to_pass + t.pass_to_pass)
        lines = ['fail() { echo "TSRL_VERIFY_SETUP: $1" >&2; exit 3; }',
                 (f'[ "$(git rev-parse HEAD)" = {start} ] || git checkout -q {start} '
                  "|| fail 'cannot check out the start state'")]
        if agent_diff:
            lines.append(f"git apply {_IO}/agent.diff || fail \"the agent's diff does not apply to the start state\"")
        if t.ref_kind == "branch":
            lines.append(f"tref={start}")
            lines.append(f'[ "$(git log -1 --format=%s {start})" = {q(SWESMITH_HIDE_TESTS)} ] && tref={start}~1')
        else:
            lines.append(f"tref={q(t.base_ref)}")
        for f in files:  # a file the commit lacks (one the test_patch adds) must not exist either
            lines.append(f'if git cat-file -e "$tref:"{q(f)} 2>/dev/null; then git checkout -q "$tref" -- {q(f)} '
                         f"|| fail {q('cannot restore ' + f)}; else rm -rf -- {q(f)}; fi")
        if t.test_patch:
            lines.append(f"git apply {_IO}/test.diff || fail \"the task's test_patch does not apply\"")
        lines.append(self.test_command())
        return "\n".join(lines) + "\n"

    def _container_reward(self) -> RewardResult:
        names, diff = self.final_diff()
        kept, dropped = unguarded_diff(names, diff, test_files(self.task.fail_to_pass + self.task.pass_to_pass))
        files = {"agent.diff": kept} if kept else {}
        if self.task.test_patch:
            files["test.diff"] = self.task.test_patch
        sb = open_sandbox(None, executor="docker", image=self.image, limits=self.limits)
        try:
            res = self._exec_with_files(self.verify_script(bool(kept)), files, self.verifier_timeout_s, sandbox=sb)
        finally:
            sb.close()
        if "TSRL_VERIFY_SETUP: " in res.stderr:
            return RewardResult(0.0, res.stderr.split("TSRL_VERIFY_SETUP: ", 1)[1].splitlines()[0],
                                {"guarded_paths_dropped": dropped})
        return self._score(res, {"guarded_paths_dropped": dropped} if dropped else {})

    def _score(self, res, extra: dict) -> RewardResult:
        if res.limit:
            return RewardResult(0.0, f"verifier stopped by the {res.limit} limit", {"exit_code": res.exit_code, **extra})
        status = parse_pytest_log(res.stdout)
        if not status:
            return RewardResult(0.0, f"no test results (exit code {res.exit_code}): {res.stderr.strip()[-200:]}", extra)
        r = repair_reward(status, self.task.fail_to_pass, self.task.pass_to_pass, self.reward_mode)
        r.details.update(extra)
        return r

    async def reward(self) -> RewardResult:
        if self.sandbox is None:
            return RewardResult(0.0, "the sandbox never started")
        try:
            if self.docker:
                return await asyncio.to_thread(self._container_reward)
            await asyncio.to_thread(self._restore_tests)
            known = await asyncio.to_thread(self._known_reward)
            if known is not None:
                return known
            res = await asyncio.to_thread(self.exec, self.test_command(), self.verifier_timeout_s)
        except Exception as e:  # noqa: BLE001 - the verifier's failure is a reward of 0, with its reason
            return RewardResult(0.0, f"verifier error: {type(e).__name__}: {e}")
        return self._score(res, {})
