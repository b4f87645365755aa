"""A small SWE-bench-format instance set built here from the embedded repair repositories, with its
images, so the official swebench harness can grade it on a machine without a registry
(`tsrl prepare-data swebench-local`; docs/evaluation.md).

Each instance is a bug of the embedded suite (tsrl_cli/embedded/repair_suite.py) in a held-out
repository, shaped the way SWE-bench shapes a pull request:

  repo at base_commit   one commit: the bug in place and the FAIL_TO_PASS test functions taken out
                        of their test file (the agent never sees the tests that grade it). Commits
                        are deterministic (fixed author, committer, dates and file modes; no user or
                        system git config), so base_commit depends only on the content.
  patch                 the gold fix (`git diff`); test_patch puts the FAIL_TO_PASS tests back.
  image                 FROM the local base image (python3 3.11, pytest 7, git), the repository
                        copied to /testbed, stop signal SIGKILL:
                        `tsrl-local/sweb.eval.x86_64.<id, __ as _1776_>:<hash 12>`,
                        the hash over the base image, the Dockerfile and base_commit, so a rebuild
                        with the same content finds the image and skips.
  eval_script           as in SWE-bench/SWE-bench_Verified's 5.x rows: cd /testbed, restore the test
                        files at base_commit, apply test_patch, `pytest -rA` on them between the
                        harness's markers, restore again. log_parser parse_log_pytest, eval_type
                        pass_and_fail, swebench's CONTAINER_WORKDIR /testbed and CONTAINER_USER root.

Build folder (<out>_src/ next to the prepared dataset): instances/<id>/{repo/, Dockerfile, build.log},
rows.jsonl (what `prepare` reads), build.json (tags and build times) and controls/, predictions a
working grader must score as stated: gold.jsonl (every instance resolved), empty.jsonl (none),
break_p2p.jsonl (none: each fixes its bug and brings in another bug of the same repository, one that
fails some PASS_TO_PASS tests and none of the FAIL_TO_PASS tests).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tsrl_cli.datasets.patches import apply_one_line_patch
from tsrl_cli.datasets.prepare import PrepareOptions, prepare
from tsrl_cli.embedded import repair_suite
from tsrl_cli.embedded.repair_suite import HELDOUT_REPOS, SRC_DIR, build_repair_suite
from tsrl_cli.errors import UsageError
from tsrl_cli.files import write_json_atomic, write_jsonl_atomic
from tsrl_cli.sandbox.docker_client import docker_client, image_exists
from tsrl_cli.sandbox.images import build_image, ensure_base_image

RECIPE = "1"  # bump when the repository, image or row recipe changes: the image tags change with it
DATE = "2026-01-01T00:00:00+00:00"  # author and committer date of every base commit, and created_at
GIT_ENV = {
    "GIT_AUTHOR_NAME": "tsrl", "GIT_AUTHOR_EMAIL": "tsrl@localhost", "GIT_AUTHOR_DATE": DATE,
    "GIT_COMMITTER_NAME": "tsrl", "GIT_COMMITTER_EMAIL": "tsrl@localhost", "GIT_COMMITTER_DATE": DATE,
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C",
}
HEREDOC = "EOF_114329324912"  # the delimiter SWE-bench's eval scripts use for test_patch
NAMESPACE = "tsrl-local"
VERSION = "1.0"
MAX_FAIL_TO_PASS = 5  # small bugs only: a problem statement about one behaviour


def git(repo: Path, *args: str) -> str:
    """git in repo with GIT_ENV (no user config, fixed identity and dates); stdout; CalledProcessError."""
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL).stdout


def commit_all(repo: Path, message: str) -> str:
    """Commit every file under repo (a new repository on branch main if there is none); its sha.

    Modes are normalized (0644 files, 0755 folders): the tree, hence the sha, depends on content only.
    """
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    if not (repo / ".git").is_dir():
        git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--no-gpg-sign", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def diff_of(repo: Path, files: dict[str, str]) -> str:
    """The `git diff` that turns HEAD into HEAD with `files` ({path: text}) written; the tree is reset."""
    for rel, text in files.items():
        (repo / rel).write_text(text)
    try:
        return git(repo, "diff", "--no-color", "--no-ext-diff", "HEAD", "--", *files)
    finally:
        git(repo, "checkout", "-q", "--", *files)


def remove_tests(source: str, names: list[str]) -> str:
    """The test file without the top-level test functions `names` (decorators included); ValueError when
    one is not a top-level function of the file."""
    tree = ast.parse(source)
    spans = {n.name: (min([n.lineno] + [d.lineno for d in n.decorator_list]), n.end_lineno) for n in tree.body
             if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    lines = source.splitlines(keepends=True)
    drop = set()
    for name in names:
        if name not in spans:
            raise ValueError(f"{name} is not a top-level test function")
        drop.update(range(spans[name][0] - 1, spans[name][1]))
    kept = "".join(ln for i, ln in enumerate(lines) if i not in drop)
    return re.sub(r"\n{4,}", "\n\n\n", kept).rstrip("\n") + "\n"  # two blank lines between what is left


def image_tag(instance_id: str, base_image: str, dockerfile: str, base_commit: str) -> str:
    key = hashlib.sha256(json.dumps([RECIPE, base_image, dockerfile, base_commit]).encode()).hexdigest()[:12]
    return f"{NAMESPACE}/sweb.eval.x86_64.{instance_id.lower().replace('__', '_1776_')}:{key}"


def dockerfile(base_image: str) -> str:
    # STOPSIGNAL: the harness keeps its container alive with `tail -f /dev/null` as PID 1, which ignores
    # SIGTERM, so its `docker stop --time=15` would wait out the 15 s on every instance
    return f"FROM {base_image}\nCOPY repo/ /testbed/\nWORKDIR /testbed\nSTOPSIGNAL SIGKILL\n"


def eval_script(base_commit: str, test_files: list[str], test_patch: str) -> str:
    """SWE-bench's eval script shape (5.x rows), for a repository whose environment is the image's python3."""
    files = " ".join(test_files)
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed",
        "git config --global --add safe.directory /testbed", "cd /testbed", "git status",
        f"git -c core.fileMode=false diff {base_commit}",
        f"git checkout {base_commit} {files}",
        f"git apply -v - <<'{HEREDOC}'\n{test_patch}\n{HEREDOC}",
        ": '>>>>> Start Test Output'",
        f"pytest -rA -p no:cacheprovider {files}",  # no .pytest_cache left in the repository
        ": '>>>>> End Test Output'",
        f"git checkout {base_commit} {files}",
    ]) + "\n"


def _simple_tests(ids: list[str]) -> bool:
    return all(i.count("::") == 1 and "[" not in i for i in ids)


def pick(tasks: list, n: int) -> list[tuple]:
    """n (task, partner) pairs, round robin over repositories in suite order.

    A task qualifies with 1..MAX_FAIL_TO_PASS FAIL_TO_PASS tests, all top-level test functions, some
    PASS_TO_PASS tests, and a partner: another task of its repository on another line whose
    FAIL_TO_PASS tests are all PASS_TO_PASS tests of this one (break_p2p's second bug).
    """
    by_repo: dict[str, list] = {}
    for t in tasks:
        by_repo.setdefault(t.repo, []).append(t)
    queues = []
    for repo in sorted(by_repo):
        q = []
        for a in by_repo[repo]:
            if not (1 <= len(a.fail_to_pass) <= MAX_FAIL_TO_PASS and a.pass_to_pass and _simple_tests(a.fail_to_pass)):
                continue
            partners = [b for b in by_repo[repo] if b is not a
                        and (b.meta["file"], b.meta["line"]) != (a.meta["file"], a.meta["line"])
                        and set(b.fail_to_pass) <= set(a.pass_to_pass)]
            if partners:
                q.append((a, partners[0]))
        queues.append(q)
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out[:n]


def _instance(a, b, iid: str, root: Path, base_image: str) -> tuple[dict, str]:
    """Write root/<iid>/{repo, Dockerfile} for task a (partner b); (the row, the break_p2p patch)."""
    src = SRC_DIR / a.repo.split("/", 1)[1]
    inst = root / iid
    if inst.exists():
        shutil.rmtree(inst)
    repo = inst / "repo"
    shutil.copytree(src, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc"))
    bug_file = a.meta["file"]
    clean_src = (src / bug_file).read_text()
    if not apply_one_line_patch(repo, a.bug_patch):
        raise RuntimeError(f"{a.task_id}: its bug patch does not apply to {src}")
    by_file: dict[str, list[str]] = {}
    for t in a.fail_to_pass:
        f, name = t.split("::")
        by_file.setdefault(f, []).append(name)
    full_tests = {f: (repo / f).read_text() for f in by_file}
    for f, names in by_file.items():
        (repo / f).write_text(remove_tests(full_tests[f], names))
    base_commit = commit_all(repo, f"{a.repo}: base of {iid}")

    gold = diff_of(repo, {bug_file: clean_src})
    test_patch = diff_of(repo, full_tests)
    with tempfile.TemporaryDirectory(prefix="tsrl-p2p-") as tmp:  # clean source with b's bug only
        (Path(tmp) / b.meta["file"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / b.meta["file"], Path(tmp) / b.meta["file"])
        if not apply_one_line_patch(tmp, b.bug_patch):
            raise RuntimeError(f"{b.task_id}: its bug patch does not apply to {src}")
        other = {b.meta["file"]: (Path(tmp) / b.meta["file"]).read_text()}
    if b.meta["file"] != bug_file:
        other[bug_file] = clean_src
    break_p2p = diff_of(repo, other)

    df = dockerfile(base_image)
    (inst / "Dockerfile").write_text(df)
    test_files = sorted({t.split("::")[0] for t in a.fail_to_pass + a.pass_to_pass})
    row = {
        "repo": a.repo, "instance_id": iid, "base_commit": base_commit, "patch": gold, "test_patch": test_patch,
        "problem_statement": a.problem_statement, "hints_text": "", "created_at": DATE, "version": VERSION,
        "FAIL_TO_PASS": json.dumps(a.fail_to_pass), "PASS_TO_PASS": json.dumps(a.pass_to_pass),
        "environment_setup_commit": base_commit, "difficulty": "<15 min fix",
        "image": image_tag(iid, base_image, df, base_commit),
        "eval_script": eval_script(base_commit, test_files, test_patch),
        "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail",
    }
    return row, break_p2p


def build_key(seed: int, n_instances: int, repos: tuple[str, ...], base_image: str) -> str:
    """sha256 over everything a build depends on: settings, base image, this recipe and the suite's code,
    and the source repositories' files (caches left out)."""
    h = hashlib.sha256(json.dumps([RECIPE, seed, n_instances, list(repos), base_image]).encode())
    for code in (Path(__file__), Path(repair_suite.__file__)):
        h.update(code.read_bytes())
    for name in repos:
        root = SRC_DIR / name
        for f in sorted(p for p in root.rglob("*") if p.is_file()
                        and not {"__pycache__", ".pytest_cache"} & set(p.parts) and p.suffix != ".pyc"):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _reusable(build_dir: Path, key: str) -> dict | None:
    """build.json's content when build_dir holds a complete build with this key and its images exist."""
    try:
        info = json.loads((build_dir / "build.json").read_text())
    except (OSError, ValueError):
        return None
    paths = [info.get("rows", ""), *info.get("controls", {}).values()]
    if info.get("key") != key or not all(Path(p).is_file() for p in paths):
        return None
    client = docker_client(60, "the local SWE-bench-format set")
    try:
        return info if all(image_exists(client, tag) for tag in info["images"].values()) else None
    finally:
        client.close()


def build_swebench_set(build_dir: str | Path, seed: int = 0, progress: Callable[[str], None] = lambda m: None, *,
                       n_instances: int = 3, repos: tuple[str, ...] = HELDOUT_REPOS) -> dict:
    """Build the instances, their images and the control predictions under build_dir (see the module doc).

    Returns build.json's content: rows file, controls, {instance_id: image}, base image, build seconds;
    "unchanged": True when build_dir already held this build (same build_key) and its images exist.
    """
    t0 = time.perf_counter()
    base_image = ensure_base_image(progress)  # first: no Docker, nothing built
    build_dir = Path(build_dir).resolve()
    key = build_key(seed, n_instances, repos, base_image)
    old = _reusable(build_dir, key)
    if old is not None:
        progress(f"{build_dir}: already built from the same sources, images present; kept")
        return {**old, "unchanged": True}
    (build_dir / "instances").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tsrl-suite-") as stage:
        progress(f"finding bugs in {', '.join(repos)} (each is validated by running the repository's tests)")
        suite = build_repair_suite(Path(stage), seed, progress, repos=list(repos), heldout=repos, max_per_repo=4)
    pairs = pick(suite["heldout"], n_instances)
    if len(pairs) < n_instances:
        raise RuntimeError(f"only {len(pairs)} of {n_instances} bugs in {', '.join(repos)} qualify (seed {seed})")
    rows, breaks, counts = [], [], {}
    for a, b in pairs:
        name = a.repo.split("/", 1)[1]
        counts[name] = counts.get(name, 0) + 1
        iid = f"embedded__{name}-{counts[name]}"
        row, brk = _instance(a, b, iid, build_dir / "instances", base_image)
        rows.append(row)
        breaks.append({"instance_id": iid, "patch": brk, "fails": b.fail_to_pass, "bug": b.task_id})
    t_repos = time.perf_counter() - t0
    seconds = {}
    for r in rows:
        t1 = time.perf_counter()
        build_image(build_dir / "instances" / r["instance_id"], tag=r["image"], what=f"instance {r['instance_id']}",
                    log_path=build_dir / "instances" / r["instance_id"] / "build.log", progress=progress)
        seconds[r["instance_id"]] = round(time.perf_counter() - t1, 2)
    write_jsonl_atomic(build_dir / "rows.jsonl", rows)
    controls = {
        "gold": [{"instance_id": r["instance_id"], "model_name_or_path": "control-gold", "model_patch": r["patch"]}
                 for r in rows],
        "empty": [{"instance_id": r["instance_id"], "model_name_or_path": "control-empty", "model_patch": ""}
                  for r in rows],
        "break_p2p": [{"instance_id": b["instance_id"], "model_name_or_path": "control-break-p2p",
                       "model_patch": b["patch"]} for b in breaks],
    }
    (build_dir / "controls").mkdir(exist_ok=True)
    for name, preds in controls.items():
        write_jsonl_atomic(build_dir / "controls" / f"{name}.jsonl", preds)
    info = {
        "rows": str(build_dir / "rows.jsonl"), "base_image": base_image, "seed": seed, "recipe": RECIPE, "key": key,
        "images": {r["instance_id"]: r["image"] for r in rows},
        "controls": {name: str(build_dir / "controls" / f"{name}.jsonl") for name in controls},
        "break_p2p_fails": {b["instance_id"]: b["fails"] for b in breaks},
        "seconds": {"repositories": round(t_repos, 2), "images": seconds, "total": round(time.perf_counter() - t0, 2)},
    }
    write_json_atomic(build_dir / "build.json", info, sort_keys=True)  # last: a build without it is redone
    return {**info, "unchanged": False}


def build_dir_for(out: str | Path) -> Path:
    """Where the build of the prepared dataset `out` lives: a sibling folder named <out>_src."""
    out = Path(out)
    return out.parent / f"{out.name}_src"


def prepare_swebench_local(out: str | Path = "data/swebench_local", seed: int = 0,
                           progress: Callable[[str], None] = lambda m: None, *, n_instances: int = 3) -> dict:
    """Build the set (images included) and prepare its rows like any SWE-bench set: {"build": ..., "prepare": ...}."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder")
    info = build_swebench_set(build_dir_for(out), seed, progress, n_instances=n_instances)
    res = prepare(PrepareOptions(source="swebench-verified", origin=info["rows"], out=str(out), on_error="fail"),
                  progress)
    return {"build": info, "prepare": res}
