"""SWE-smith rows (`SWE-bench/SWE-smith`, split train) -> RepairTask.

Columns (the `SWE-bench/SWE-smith` dataset card): instance_id, repo (the mirror
`swesmith/<owner>__<repo>.<commit8>`), patch (introduces the bug), FAIL_TO_PASS and
PASS_TO_PASS (real lists), image_name, problem_statement (can be empty); older rows also
carry created_at and base_commit. The start state is the branch named instance_id in the
mirror inside the image; the gold fix is `patch` reversed.
"""

from __future__ import annotations

import re

from tsrl_cli.datasets.patches import looks_like_diff, patch_language, reverse_patch
from tsrl_cli.datasets.records import FieldError, RepairTask, name_list, opt_str, req_str

HUB_ID = "SWE-bench/SWE-smith"
HUB_SPLIT = "train"

# mirror repo name: swesmith/<owner>__<repo>.<commit8>
_MIRROR = re.compile(r"^(?:[^/]+/)?(?P<owner>[^/]+?)__(?P<name>[^/]+)\.(?P<commit>[0-9a-f]{7,40})$")


def upstream_repo(repo: str) -> str:
    """`swesmith/pandas-dev__pandas.95280573` -> `pandas-dev/pandas`; other names are kept as they are."""
    m = _MIRROR.match(repo)
    return f"{m['owner']}/{m['name']}" if m else repo


def default_image(repo: str) -> str | None:
    """The image swesmith 0.0.9's profiles derive, for rows without image_name (namespace `swebench`)."""
    m = _MIRROR.match(repo)
    return f"swebench/swesmith.x86_64.{m['owner']}_1776_{m['name']}.{m['commit']}" if m else None


def normalize(row: dict, split: str = "train") -> RepairTask:
    iid = req_str(row, "instance_id")
    repo = req_str(row, "repo")
    patch = req_str(row, "patch")
    if not looks_like_diff(patch):
        raise FieldError("patch", "not a unified diff")
    f2p = name_list(row, "FAIL_TO_PASS")
    if not f2p:
        raise FieldError("FAIL_TO_PASS", "empty: no test shows the bug, so there is no reward signal")
    meta = {k: row[k] for k in ("created_at", "base_commit") if isinstance(row.get(k), str) and row[k]}
    image = opt_str(row, "image_name")
    if image is None:
        image = default_image(repo)
        if image is None:
            raise FieldError("image_name", f"missing, and repo {repo!r} is not a SWE-smith mirror name to "
                                           "derive it from")
        meta["image_derived"] = True
    try:
        gold = reverse_patch(patch)
    except ValueError:
        gold = None  # binary hunks: the evaluator reverse-applies bug_patch (git apply -R) instead
        meta["gold_patch"] = "git apply -R bug_patch"
    return RepairTask(
        task_id=iid, source="swe-smith", split=split, repo=repo, upstream_repo=upstream_repo(repo),
        base_ref=iid, ref_kind="branch", bug_patch=patch, gold_patch=gold, test_patch=None,
        fail_to_pass=f2p, pass_to_pass=name_list(row, "PASS_TO_PASS"), image=image,
        problem_statement=req_str(row, "problem_statement", empty_ok=True),
        language=opt_str(row, "language") or patch_language(patch), meta=meta,
    )
