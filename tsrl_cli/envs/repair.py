"""Repair environment: the agent edits a repository in a sandbox; the task's tests give the reward.

Start state: a copy of the repository at its start state (the bug already in place), from a
local directory (`repo_dir`, local executor) or from the task's image (docker executor). A
SWE-smith task (`ref_kind == "branch"`) gets it set up and checked by envs/start_state.py: its
instance branch, else its bug patch applied to the clean checkout, sealed as the repository's only
commit (no history, ref or object that holds the fix); then its FAIL_TO_PASS tests run once per task
and image, and a task where they already pass is refused (StartStateError, the runner's env_error).
`env.start_state` records the path taken ("branch", "bug_patch"; "commit" for SWE-bench, "start_dir"
for a folder that is the start state), the commit and the check.

Local executor. Reward (after submission or when a limit ends the trajectory): the working copy is
put in a state the agent cannot steer (`secure_tree`, envs/guarded.py): the test directories (those
of the FAIL_TO_PASS / PASS_TO_PASS files) are restored to the start state, agent-added files there
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

Docker executor (SWE-bench and SWE-smith images: the repository at /testbed, its environment in conda
env `testbed` where the image has one, else the image's own python3). `start()` sets up the start state
there: SWE-smith's as above; SWE-bench's image HEAD is kept when it is base_commit or built on it (the
harness's image setup ends with `git commit --allow-empty -am SWE-bench`), else base_commit is checked
out. A container that cannot start or set that up raises (the runner records env_error). Every agent
command runs in /testbed after PRELUDE. The reward is computed the way both official harnesses grade, in
a FRESH container of the same image (nothing the agent did to the image's interpreter or tools is
there): the start state is set up again (SWE-smith: with the history the agent's sealed copy lacks, its
tree sealing to the same commit), the agent's final diff (`git add -A; git diff --cached --binary <start
commit>`) minus every file the local executor guards (test directories and files, guarded.GUARDED_NAMES,
*.pth, bytecode) is applied to it; the test files are checked out from the commit that has them
(SWE-smith: the branch's parent when its head is the "Remove F2P Tests" commit; SWE-bench: base_commit,
as its eval scripts do), the task's test_patch is applied, and the container's own `python3 -I -B -m
pytest -rA` runs the test files. A fix that needs one of the guarded files therefore scores 0 here while
SWE-bench's harness (which guards nothing) may resolve it. Containers here have no network: swesmith's
harness fetches a missing instance branch from GitHub, tsrl applies the row's bug patch instead.

Known states (local executor, tasks that ship their start state and a one-file gold patch, as the
embedded suite does): a task's start state and its gold state were both run through the tests when
the suite was built (start: FAIL_TO_PASS fail; gold: everything passes). When the working tree after
the tests are restored is byte-identical to one of them, the reward is that validated result and
pytest is not run again (the tests are deterministic; any other state, e.g. one extra file, runs them).
"""

from __future__ import annotations

import asyncio
import hashlib
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from tsrl_cli.agent.loop import RewardResult
from tsrl_cli.agent.rewards import parse_pytest_log, repair_reward
from tsrl_cli.datasets.patches import apply_one_line_patch
from tsrl_cli.envs.base import SandboxEnv
from tsrl_cli.envs.guarded import (  # noqa: F401 - split_diff: the verifier's names, importable from here too
    SKIP_DIRS,
    secure_tree,
    split_diff,
    test_files,
    tree_digest,
    unguarded_diff,
)
from tsrl_cli.envs.start_state import (
    SWESMITH_HIDE_TESTS,
    fail_to_pass_passing,
    local_start,
    once,
    parse_start,
    refuse_if_passing,
    start_script,
)
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
_IO = "/tmp/tsrl-io"  # where files for one command are copied into a container (docker `run(mounts=)`)
_SPLIT = "\0TSRL-DIFF\0"  # between the NUL-separated path list and the diff in final_diff's output


_KNOWN: dict[tuple[str, str], dict[str, RewardResult]] = {}


def known_states(task, repo_dir: Path) -> dict[str, RewardResult]:
    """{tree digest: validated reward} for the start and gold states of a task (memoized per process)."""
    key = (task.task_id, str(repo_dir))
    if key not in _KNOWN:
        states = {tree_digest(repo_dir): RewardResult(0.0, "start state: FAIL_TO_PASS fail (validated at build)")}
        with tempfile.TemporaryDirectory(prefix="tsrl-gold-") as tmp:
            gold = Path(tmp) / "repo"
            shutil.copytree(repo_dir, gold, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_DIRS, "*.pyc"))
            if apply_one_line_patch(gold, task.gold_patch):
                states[tree_digest(gold)] = RewardResult(1.0, "gold state: all tests pass (validated at build)")
        _KNOWN[key] = states
    return _KNOWN[key]


def setup_failure(res) -> str:
    """The reason verify_script's setup gave up (its TSRL_VERIFY_SETUP line)."""
    return res.stderr.split("TSRL_VERIFY_SETUP: ", 1)[1].splitlines()[0]


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
        # how the start state was reached (module doc), set by start(); the local verifier's test files
        self.start_state: dict = {"path": "start_dir" if executor == "local" else task.ref_kind}
        self.tests_dir = self.repo_dir
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

    @property
    def swesmith(self) -> bool:
        """A SWE-smith task: its start state is set up and checked by envs/start_state.py."""
        return self.task.ref_kind == "branch"

    async def start(self) -> None:
        if self.swesmith and not self.docker:  # set up and checked once per task; each sandbox copies it
            prep = await asyncio.to_thread(
                local_start, self.task, self.repo_dir, test_command=self.test_command(), limits=self.limits,
                allow_unisolated=self.allow_unisolated, timeout_s=self.verifier_timeout_s)
            self.start_path, self.tests_dir, self.start_state = prep.start_dir, prep.tests_dir, dict(prep.info)
        await super().start()
        if self.docker:
            try:
                await asyncio.to_thread(self._checkout_start)
                if self.swesmith:
                    await asyncio.to_thread(self._check_start)
            except BaseException:  # a task that cannot start leaves no container behind, whoever called
                await self.close()
                self.sandbox = None
                raise

    def _checkout_start(self) -> None:
        """The start state in the image's repository, its commit kept in start_sha (what diffs are taken
        against, so commits the agent makes count too); RuntimeError (the runner's env_error) when it fails.

        SWE-smith: start_script (the instance branch, else the bug patch applied and committed).
        SWE-bench: the image's HEAD is kept when it is base_commit or built on it (the harness's images
        commit their setup changes on top of base_commit, and grade patches against that state);
        otherwise base_commit is checked out. Never forced: a checkout that would discard changes the
        image holds fails instead.
        """
        where = f"{self.image}:{TESTBED}"
        if self.swesmith:
            res = self._exec_with_files(start_script(self.task, f"{_IO}/bug.diff"), self._start_files(), 120.0)
            self.start_state = {**parse_start(self.task, res, where), "where": where}
            self.start_sha = self.start_state["sha"]
            return
        ref = shlex.quote(self.task.base_ref)
        res = self.exec(f"{{ git merge-base --is-ancestor {ref} HEAD 2>/dev/null || git checkout -q {ref}; }} && "
                        "git rev-parse --verify HEAD", 120.0)
        sha = res.stdout.strip().splitlines()[-1:] if res.exit_code == 0 and not res.limit else []
        if not sha:
            raise RuntimeError(f"task {self.task_id}: cannot check out {self.task.base_ref} in {where} "
                               f"(exit {res.exit_code}): {(res.stderr or res.stdout).strip()[-300:]}")
        self.start_sha = sha[0]
        self.start_state = {"path": "commit", "sha": self.start_sha, "where": where}

    def _start_files(self) -> dict[str, str]:
        """What start_script reads under _IO: the bug patch, when the task has one."""
        return {"bug.diff": self.task.bug_patch} if self.task.bug_patch else {}

    def _check_start(self) -> None:
        """Docker: the FAIL_TO_PASS tests at the start state, in a fresh container as the verifier runs them
        (once per task, image and start commit); StartStateError when they all pass already."""
        def run() -> tuple[int, str]:
            res = self._fresh_verify(None)
            if "TSRL_VERIFY_SETUP: " in res.stderr:
                return 0, f"verifier setup failed: {setup_failure(res)}"
            return fail_to_pass_passing(self.task, res)

        key = ("image", self.task_id, self.image, self.start_sha)
        self.start_state["fail_to_pass_passing"], self.start_state["check"] = once(key, run)
        refuse_if_passing(self.task, self.start_state)

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
        secure_tree(self.sandbox.workdir, self.tests_dir, test_files(self.task.fail_to_pass + self.task.pass_to_pass))

    def _known_reward(self) -> RewardResult | None:
        """The validated reward when the tree equals the task's start or gold state (see the module doc)."""
        if self.repo_dir is None or self.docker or self.reward_mode != "binary":
            return None
        if self.task.test_command or not self.task.source.startswith("embedded"):
            return None  # only the embedded suite ran both states through its tests when it was built
        return known_states(self.task, self.repo_dir).get(tree_digest(self.sandbox.workdir))

    def verify_script(self, agent_diff: bool) -> str:
        """The fresh container's script (after PRELUDE): the start state (SWE-smith: set up again with its
        history, which the agent's sealed copy lacks, and its tree checked to seal to the agent's start commit),
        the agent's unguarded diff, the test files from the commit that has them (SWE-smith: the branch's parent
        when its head hides them; SWE-bench: base_commit, as its eval scripts do), the test_patch, the tests."""
        t, q = self.task, shlex.quote
        start = q(self.start_sha or t.base_ref)
        files = test_files(t.fail_to_pass + t.pass_to_pass)
        lines = ['fail() { echo "TSRL_VERIFY_SETUP: $1" >&2; exit 3; }']
        if self.swesmith:
            again = start_script(t, f"{_IO}/bug.diff", seal=False)
            lines += [f"s=$( ( {again}) ) || fail 'cannot set up the start state again'",
                      f'[ "${{s##* }}" = {start} ] || fail "the start set up again seals to ${{s##* }}, not {start}"',
                      f'tref=HEAD; [ "$(git log -1 --format=%s)" = {q(SWESMITH_HIDE_TESTS)} ] && tref=HEAD~1']
        else:
            lines += [f'[ "$(git rev-parse HEAD)" = {start} ] || git checkout -q {start} '
                      "|| fail 'cannot check out the start state'", f"tref={q(t.base_ref)}"]
        if agent_diff:
            lines.append(f"git apply {_IO}/agent.diff || fail \"the agent's diff does not apply to the start state\"")
        for f in files:  # a file the commit lacks (one the test_patch adds) must not exist either
            lines.append(f'if git cat-file -e "$tref:"{q(f)} 2>/dev/null; then git checkout -q "$tref" -- {q(f)} '
                         f"|| fail {q('cannot restore ' + f)}; else rm -rf -- {q(f)}; fi")
        if t.test_patch:
            lines.append(f"git apply {_IO}/test.diff || fail \"the task's test_patch does not apply\"")
        lines.append(self.test_command())
        return "\n".join(lines) + "\n"

    def _fresh_verify(self, agent_diff: str | None):
        """verify_script in a fresh container of the image -> its ExecResult (agent_diff None: the start state)."""
        files = {**self._start_files(), **({"agent.diff": agent_diff} if agent_diff else {})}
        if self.task.test_patch:
            files["test.diff"] = self.task.test_patch
        sb = open_sandbox(None, executor="docker", image=self.image, limits=self.limits)
        try:
            return self._exec_with_files(self.verify_script(bool(agent_diff)), files, self.verifier_timeout_s,
                                         sandbox=sb)
        finally:
            sb.close()

    def _container_reward(self) -> RewardResult:
        names, diff = self.final_diff()
        kept, dropped = unguarded_diff(names, diff, test_files(self.task.fail_to_pass + self.task.pass_to_pass))
        res = self._fresh_verify(kept)
        if "TSRL_VERIFY_SETUP: " in res.stderr:
            return RewardResult(0.0, setup_failure(res), {"guarded_paths_dropped": dropped, **self._start_detail()})
        return self._score(res, {"guarded_paths_dropped": dropped} if dropped else {})

    def _score(self, res, extra: dict) -> RewardResult:
        extra = {**extra, **self._start_detail()}
        if res.limit:
            return RewardResult(0.0, f"verifier stopped by the {res.limit} limit", {"exit_code": res.exit_code,
                                                                                    **extra})
        status = parse_pytest_log(res.stdout)
        if not status:
            return RewardResult(0.0, f"no test results (exit code {res.exit_code}): {res.stderr.strip()[-200:]}", extra)
        r = repair_reward(status, self.task.fail_to_pass, self.task.pass_to_pass, self.reward_mode)
        r.details.update(extra)
        return r

    def _start_detail(self) -> dict:
        """The start state's path in the reward's details (SWE-smith tasks: "branch" or "bug_patch")."""
        return {"start_state": self.start_state["path"]} if self.swesmith else {}

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
