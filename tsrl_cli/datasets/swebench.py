"""SWE-bench Verified rows (`princeton-nlp/SWE-bench_Verified`, split test, 500 rows) -> RepairTask.

Classic columns: repo, instance_id, base_commit, patch (gold), test_patch, problem_statement,
hints_text, created_at, version, FAIL_TO_PASS and PASS_TO_PASS (JSON-encoded strings),
environment_setup_commit (+ difficulty in some copies). swebench 5.x rows also carry image,
eval_script, log_parser and eval_type: the dataset rows carry their own eval_script (swebench 5.x `run_evaluation`).
"""

from __future__ import annotations

from tsrl_cli.datasets.patches import looks_like_diff, patch_language
from tsrl_cli.datasets.records import FieldError, RepairTask, name_list, opt_str, req_str

HUB_ID = "princeton-nlp/SWE-bench_Verified"
HUB_SPLIT = "test"

_V5_FIELDS = ("eval_script", "log_parser", "eval_type")  # all or none (swebench/task/checks.py REQUIRED_KEYS)


def default_image(instance_id: str) -> str:
    """swebench's instance image name: `__` becomes `_1776_` (swebench/task/checks.py expected_image)."""
    return f"swebench/sweb.eval.x86_64.{instance_id.replace('__', '_1776_')}:latest"


def normalize(row: dict, split: str = "test") -> RepairTask:
    iid = req_str(row, "instance_id")
    repo = req_str(row, "repo")
    if repo.count("/") != 1:
        raise FieldError("repo", f"expected <owner>/<repo>, got {repo!r}")
    gold = req_str(row, "patch")
    if not looks_like_diff(gold):
        raise FieldError("patch", "not a unified diff")
    f2p = name_list(row, "FAIL_TO_PASS")
    if not f2p:
        raise FieldError("FAIL_TO_PASS", "empty: nothing shows the fix")
    v5 = {k: opt_str(row, k) for k in _V5_FIELDS}
    given = [k for k, v in v5.items() if v is not None]
    if given and len(given) != len(_V5_FIELDS):
        missing = next(k for k in _V5_FIELDS if v5[k] is None)
        raise FieldError(missing, f"missing while {', '.join(given)} is given (swebench 5.x needs all of {_V5_FIELDS})")
    meta = {k: row[k] for k in ("version", "environment_setup_commit", "created_at", "hints_text", "difficulty")
            if isinstance(row.get(k), str) and row[k]}
    image = opt_str(row, "image")
    if image is None:
        image = default_image(iid)
        meta["image_derived"] = True
    return RepairTask(
        task_id=iid, source="swebench-verified", split=split, repo=repo, upstream_repo=repo,
        base_ref=req_str(row, "base_commit"), ref_kind="commit", bug_patch=None, gold_patch=gold,
        test_patch=req_str(row, "test_patch"), fail_to_pass=f2p, pass_to_pass=name_list(row, "PASS_TO_PASS"),
        image=image, problem_statement=req_str(row, "problem_statement", empty_ok=True),
        language=opt_str(row, "language") or patch_language(gold), log_parser=v5["log_parser"],
        eval_script=v5["eval_script"], eval_type=v5["eval_type"], meta=meta,
    )
