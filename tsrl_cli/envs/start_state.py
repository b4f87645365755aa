"""A SWE-smith task's start state: how it is set up in the task's repository, and the check that its
FAIL_TO_PASS tests fail there (a task whose tests already pass would pay every trajectory without a fix).

Set up (`start_script`, bash run at the repository's root): the instance branch named instance_id
when the repository has it (SWE-smith's mirrors: "Bug Patch", then "Remove F2P Tests"). Else the
task's bug patch (SWE-smith's `patch` column: the diff that introduces the bug) is applied to the
clean checkout that SWE-smith's images ship, and the branch is built as SWE-smith's harness builds
it: branch instance_id, commit "Bug Patch", then the FAIL_TO_PASS test files removed in commit
"Remove F2P Tests". Neither branch nor bug patch, a patch that does not apply, or a failed checkout:
StartStateError naming the task (the runner's env_error).

Sealed (what the agent gets): that history holds the fixed code (`git diff HEAD~2`, `git log -p`,
`git checkout main -- .`, the reflog, unreachable objects), so the start's tree becomes the only commit
("Initial commit", no parent): every other ref, remote and reflog is deleted and the object store is
rebuilt with that commit's objects only. Author, committer and dates are fixed, so one tree gives one
commit id: the verifier's fresh container rebuilds the history (it needs the test files of the
commit before "Remove F2P Tests") and checks that its tree seals to the agent's start commit.

Check: the FAIL_TO_PASS tests run once at the start state with the test files back, as the
verifier runs them. A task where every one of them passes is refused (StartStateError), never
scored 0. The verdict is kept per task and image (docker: the image and the start commit; local:
the task's folder) for the life of the process, so a run pays one test run per task, not one per
trajectory; a run that changes an image under the same tag needs a new process.
"""

from __future__ import annotations

import atexit
import shlex
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from tsrl_cli.agent.rewards import parse_pytest_log, repair_reward
from tsrl_cli.envs.guarded import secure_tree, test_files
from tsrl_cli.errors import OperationFailed
from tsrl_cli.sandbox import open_sandbox

# SWE-smith's instance branches end with this commit, which deletes the FAIL_TO_PASS test files
SWESMITH_HIDE_TESTS = "Remove F2P Tests"
SWESMITH_BUG_COMMIT = "Bug Patch"
START_COMMIT = "Initial commit"  # the sealed start's only commit
# the bug patch inside a local task's copy while the start script runs (never in the agent's copy)
LOCAL_PATCH = ".git/tsrl-bug.diff"
_DATE = "2000-01-01T00:00:00+0000"  # fixed author and committer date: the rebuilt commits are identical
# what a repository holds besides refs and objects that names other commits or holds content of them
_GIT_LEFTOVERS = ("logs", "worktrees", "rr-cache", "lost-found", "shallow", "info/grafts", "sequencer",
                  "rebase-merge", "rebase-apply", "*_HEAD", "AUTO_MERGE", "BISECT_*")


class StartStateError(OperationFailed):
    """The task's start state cannot be set up, or its FAIL_TO_PASS tests already pass there."""


def _prelude(task) -> list[str]:
    """bash: fail, g (git without hooks or signing, as tsrl), the fixed identity and dates, b=the branch."""
    ident = " ".join(f"GIT_{who}_{what}={val}" for who in ("AUTHOR", "COMMITTER")
                     for what, val in (("NAME", "tsrl"), ("EMAIL", "tsrl@localhost"), ("DATE", _DATE)))
    return ['fail() { echo "TSRL_START_ERROR: $1" >&2; exit 3; }',
            'g() { git -c core.hooksPath=/dev/null -c commit.gpgsign=false -c user.name=tsrl '
            '-c user.email=tsrl@localhost "$@"; }',
            f"export {ident}",
            "git rev-parse --git-dir >/dev/null 2>&1 || fail 'the repository is not a git repository'",
            f"b={shlex.quote(task.base_ref)}"]


def start_commit_lines() -> list[str]:
    """bash: c=the sealed start commit of HEAD's tree (no parent, fixed identity and dates: one tree, one id)."""
    return [f"c=$(g commit-tree \"$(git rev-parse -q --verify 'HEAD^{{tree}}')\" -m {shlex.quote(START_COMMIT)} "
            "</dev/null) || fail 'cannot write the start commit'"]


def history_lines() -> list[str]:
    """bash: branch $b at $c, checked out, the only ref; no remote, no reflog, nothing else naming a commit."""
    leftovers = " ".join(f'"$gd"/{p}' for p in _GIT_LEFTOVERS)
    return ['gd=$(git rev-parse --absolute-git-dir) || fail "no git directory"',
            'for r in $(git remote); do git remote remove "$r" >/dev/null 2>&1 || fail "cannot remove remote $r"; done',
            "git for-each-ref --format='delete %(refname)' | grep -vxF \"delete refs/heads/$b\" | "
            "git update-ref --no-deref --stdin || fail 'cannot delete the other refs'",
            'git update-ref "refs/heads/$b" "$c" && git symbolic-ref HEAD "refs/heads/$b" '
            "|| fail 'cannot point the branch at the start commit'",
            # the index normally is that tree already; anything else staged would name objects dropped below
            "git diff-index --cached --quiet \"$c\" -- || git read-tree \"$c\" || fail 'cannot reset the index'",
            f"rm -rf {leftovers} || fail 'cannot delete the reflogs'"]


def prune_lines() -> list[str]:
    """bash: the object store rebuilt with $c's objects only (no unreachable object, pack, alternate or
    commit graph of the old history is left for `git fsck --lost-found` or `git cat-file` to find)."""
    new = '"$gd/objects.tsrl"'
    return [f"rm -rf {new} && mkdir -p {new}/pack {new}/info || fail 'cannot make the new object store'",
            f'echo "$c" | git pack-objects -q --revs {new}/pack/pack >/dev/null || fail "cannot pack the start commit"',
            f'rm -rf "$gd/objects" && mv {new} "$gd/objects" || fail "cannot replace the object store"']


def start_script(task, patch_file: str, *, seal: bool = True) -> str:
    """bash, run at the repository's root: the start state of a SWE-smith task (module doc), sealed unless
    seal=False (the history kept: what the verifier and the local setup need for the hidden test files). Its
    last stdout line is `TSRL_START <branch|bug_patch> <sealed start commit>`; on failure, exit 3 with
    `TSRL_START_ERROR: why` on stderr. patch_file: where the bug patch is, as the script sees it (read only
    when the branch is absent)."""
    q = shlex.quote
    lines = _prelude(task) + [
        'if git rev-parse -q --verify "refs/heads/$b^{commit}" >/dev/null || '
        'git rev-parse -q --verify "refs/remotes/origin/$b^{commit}" >/dev/null; then',
        '  g checkout -q "$b" || fail "cannot check out branch $b"',
        "  path=branch"]
    if task.bug_patch:
        lines += ["else",
                  '  g checkout -q -b "$b" || fail "cannot create branch $b at the clean checkout"',
                  f"  g apply --index {q(patch_file)} || fail 'the bug patch does not apply to the clean checkout'",
                  f"  g commit -q --no-verify -m {q(SWESMITH_BUG_COMMIT)} || fail 'cannot commit the bug patch'",
                  "  n=0"]
        for f in test_files(task.fail_to_pass):  # a test name that is no file (Go's) hides nothing
            lines.append(f"  if git ls-files --error-unmatch -- {q(f)} >/dev/null 2>&1; then g rm -q -- {q(f)} "
                         f"|| fail {q('cannot remove ' + f)}; n=$((n + 1)); fi")
        lines += [f'  [ "$n" = 0 ] || g commit -q --no-verify -m {q(SWESMITH_HIDE_TESTS)} '
                  "|| fail 'cannot commit the removal of the FAIL_TO_PASS tests'",
                  "  path=bug_patch"]
    else:
        lines += ["else",
                  '  fail "no start state: the repository has no branch $b and the task has no bug patch"']
    lines += ["fi", *start_commit_lines()]
    if seal:
        lines += history_lines() + prune_lines()
    lines.append('echo "TSRL_START $path $c"')
    return "\n".join(lines) + "\n"


def seal_script(task) -> str:
    """bash: after start_script(seal=False) and reveal_tests_script, the test files hidden again and the start
    sealed; last stdout line `TSRL_START sealed <start commit>` (parse_start), errors as start_script's."""
    return "\n".join(_prelude(task) + hide_tests_lines(task) + start_commit_lines() + history_lines()
                     + prune_lines() + ['echo "TSRL_START sealed $c"']) + "\n"


def parse_start(task, res, where: str) -> dict:
    """{"path", "sha"} from start_script's result; StartStateError (one line, the task named) when it failed."""
    last = res.stdout.strip().splitlines()[-1:] if res.exit_code == 0 and not res.limit else []
    parts = last[0].split() if last else []
    if len(parts) == 3 and parts[0] == "TSRL_START":
        return {"path": parts[1], "sha": parts[2]}
    before, mark, after = (res.stderr or "").partition("TSRL_START_ERROR: ")
    why = (after.splitlines()[0] if mark
           else f"exit {res.exit_code}, limit {res.limit}: {one_line(before or res.stdout)}")
    detail = one_line(before) if mark else ""
    raise StartStateError(f"task {task.task_id}: cannot set up its start state in {where}: {why}"
                          + (f" ({detail})" if detail else ""))


def one_line(text: str, n: int = 300) -> str:
    """The last n characters of text's non-empty lines, joined with "; "."""
    return "; ".join(x.strip() for x in text.splitlines() if x.strip())[-n:]


def reveal_tests_script(task) -> str:
    """bash: the task's test files back from the commit before "Remove F2P Tests" (the start state as the
    verifier sees it); nothing when the head is not that commit."""
    q = shlex.quote
    files = test_files(task.fail_to_pass + task.pass_to_pass)
    return (f'[ "$(git log -1 --format=%s)" = {q(SWESMITH_HIDE_TESTS)} ] || exit 0\n'
            + "".join(f'if git cat-file -e HEAD~1:{q(f)} 2>/dev/null; then git checkout -q HEAD~1 -- {q(f)} || exit 3; '
                      "fi\n" for f in files))


def hide_tests_lines(task) -> list[str]:
    """bash: reveal_tests_script undone (each file it brought back as HEAD has it, or gone)."""
    q = shlex.quote
    out = [f'if [ "$(git log -1 --format=%s)" = {q(SWESMITH_HIDE_TESTS)} ]; then']
    for f in test_files(task.fail_to_pass + task.pass_to_pass):
        out.append(f"  if git cat-file -e HEAD:{q(f)} 2>/dev/null; then git checkout -q HEAD -- {q(f)}; "
                   f"else g rm -q -f --ignore-unmatch -- {q(f)} >/dev/null; fi || fail {q('cannot hide ' + f)}")
    return [*out, "fi"]


def fail_to_pass_passing(task, res) -> tuple[int, str]:
    """(how many FAIL_TO_PASS tests pass, the check's one-line result) from a test run at the start state."""
    if res.limit:
        return 0, f"stopped by the {res.limit} limit"
    status = parse_pytest_log(res.stdout)
    if not status:
        return 0, f"no test results (exit code {res.exit_code})"
    r = repair_reward(status, task.fail_to_pass, [], "binary")
    return r.details["fail_to_pass_passed"], r.reason.split(",")[0]


def refuse_if_passing(task, info: dict) -> None:
    """StartStateError when every FAIL_TO_PASS test passes at the start state (info: start_state's record)."""
    n = len(task.fail_to_pass)
    if n and info.get("fail_to_pass_passing") == n:
        raise StartStateError(f"task {task.task_id}: FAIL_TO_PASS already pass at the start state ({n}/{n} on "
                              f"{info['path']} {info['sha'][:12]} in {info['where']}): refused, it would pay "
                              "without a fix")


# -- once per key, for the life of the process ---------------------------------------------------------

_LOCK = threading.Lock()
_KEY_LOCKS: dict[tuple, threading.Lock] = {}
_DONE: dict[tuple, object] = {}


def once(key: tuple, compute):
    """compute() the first time key is asked for, its value after that; concurrent callers of one key wait
    for the first. A StartStateError is kept too (the task is refused the same way every time); any other
    exception is not (a daemon's hiccup is tried again)."""
    with _LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _DONE:
            try:
                _DONE[key] = compute()
            except StartStateError as e:
                _DONE[key] = e
        value = _DONE[key]
    if isinstance(value, StartStateError):
        raise StartStateError(str(value))
    return value


# -- the local executor: set up once per task, in a sandbox ---------------------------------------------

@dataclass(frozen=True)
class LocalStart:
    start_dir: Path  # the agent's start state, sealed: every trajectory's sandbox is a copy of it
    tests_dir: Path  # its files with the FAIL_TO_PASS test files back (no .git): what the verifier restores from
    info: dict  # path, sha, where, fail_to_pass_passing, check


def local_start(task, repo_dir: Path, *, test_command: str, limits, allow_unisolated: bool,
                timeout_s: float) -> LocalStart:
    """The start state of a branch task from a local git repository (a clean checkout, with or without the
    instance branch), set up and checked in a sandbox once per task and folder; StartStateError as above."""
    def build() -> LocalStart:
        root = Path(tempfile.mkdtemp(prefix="tsrl-start-"))
        atexit.register(shutil.rmtree, root, True)
        try:
            info = _set_up_local(task, repo_dir, root, test_command, limits, allow_unisolated, timeout_s)
            refuse_if_passing(task, info)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return LocalStart(root / "start", root / "tests", info)

    return once(("local", task.task_id, str(repo_dir)), build)


def _set_up_local(task, repo_dir: Path, root: Path, test_command: str, limits, allow_unisolated: bool,
                  timeout_s: float) -> dict:
    """In a sandbox on a copy of repo_dir: the start state with its history, the test files back (copied to
    root/tests, without .git), the start sealed (copied to root/start), then the tests run there with the test
    files put back as the verifier puts them. Returns the start state's record."""
    with open_sandbox(repo_dir, executor="local", limits=limits, allow_unisolated=allow_unisolated) as sb:
        patch = sb.workdir / LOCAL_PATCH
        try:
            if task.bug_patch and patch.parent.is_dir():
                patch.write_text(task.bug_patch)
                patch.chmod(0o644)  # readable by the sandbox's own uid
            res = sb.run(start_script(task, LOCAL_PATCH, seal=False), 120.0)
        finally:
            patch.unlink(missing_ok=True)
        info = {**parse_start(task, res, str(repo_dir)), "where": str(repo_dir)}
        shown = sb.run(reveal_tests_script(task), 120.0)
        if shown.exit_code != 0:
            raise StartStateError(f"task {task.task_id}: cannot restore its test files from the commit before "
                                  f"{SWESMITH_HIDE_TESTS!r}: {shown.stderr.strip()[-200:]}")
        top = str(sb.workdir)
        shutil.copytree(sb.workdir, root / "tests", symlinks=True, ignore=lambda d, _: [".git"] if d == top else [])
        parse_start(task, sb.run(seal_script(task), 300.0), str(repo_dir))
        shutil.copytree(sb.workdir, root / "start", symlinks=True)
        secure_tree(sb.workdir, root / "tests", test_files(task.fail_to_pass + task.pass_to_pass))
        info["fail_to_pass_passing"], info["check"] = fail_to_pass_passing(task, sb.run(test_command, timeout_s))
    return info
