"""`tsrl prepare-data embedded`: build the shipped task suite and prepare it like any other source.

Four prepared datasets, evaluation sets first so the training sets are checked against them:
  data/embedded_repair_heldout    repair tasks from held-out repositories (graphs, money)
  data/embedded_terminal_heldout  terminal tasks with unseen names, files and three unseen families
  data/embedded_repair_train      repair tasks from the other eight repositories
  data/embedded_terminal_train    terminal tasks
The suites are built into a staging folder next to the outputs (validated: every repair task
fails its FAIL_TO_PASS tests and its gold patch fixes it; every terminal task scores 0 before and
1 after its reference solution), then go through the same prepare path as the public sources.
Deterministic for a seed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from tsrl_cli.datasets.prepare import PrepareOptions, prepare
from tsrl_cli.embedded.policy.build import POLICY_DIR, TRAIN_SETS, PolicyBuildConfig, build_key, build_policy
from tsrl_cli.embedded.repair_suite import build_repair_suite
from tsrl_cli.embedded.terminal_suite import build_terminal_suite


def prepare_embedded(out_root: str | Path = "data", seed: int = 0, progress: Callable[[str], None] = lambda m: None,
                     *, repos: list[str] | None = None, max_per_repo: int = 40, n_terminal_train: int = 120,
                     n_terminal_heldout: int = 30, policy=None, build_policy: bool = False,
                     rebuild_policy: bool = False, policy_out: str | Path | None = None) -> dict:
    """Build and prepare the embedded suite; returns {dataset name: prepare() result, "policy": ..., "seconds": ...}.

    With build_policy, the default student and teacher (policy/build.py, `policy` a PolicyBuildConfig)
    are then trained on the prepared training sets, unless data/embedded_policy already holds a build
    of the same training data and config (its build key), which is kept (rebuild_policy forces it).
    policy_out: where the policy goes (default data_root/embedded_policy, what `tsrl train` loads).
    """
    t0 = time.perf_counter()
    root = Path(out_root)
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".embedded-stage-", dir=root))
    try:
        progress("building repair tasks (each candidate bug is validated by running its tests)")
        repair = build_repair_suite(stage, seed, progress, repos=repos, max_per_repo=max_per_repo)
        for split, tasks in repair.items():
            with open(stage / f"repair_{split}.jsonl", "w") as f:
                f.writelines(json.dumps(asdict(t)) + "\n" for t in tasks)
        progress("building terminal tasks (each is checked: reward 0 before, 1 after its solution)")
        build_terminal_suite(stage, seed, n_train=n_terminal_train, n_heldout=n_terminal_heldout, progress=progress)
        results = {}
        plan = [
            ("embedded_repair_heldout", "embedded-repair-heldout", stage / "repair_heldout.jsonl", None),
            ("embedded_terminal_heldout", "embedded-terminal-heldout", stage / "terminal" / "heldout", None),
            ("embedded_repair_train", "embedded-repair-train", stage / "repair_train.jsonl",
             (str(root / "embedded_repair_heldout"),)),
            ("embedded_terminal_train", "embedded-terminal-train", stage / "terminal" / "train",
             (str(root / "embedded_terminal_heldout"),)),
        ]
        for name, source, origin, eval_sets in plan:
            progress(f"preparing {name}")
            results[name] = prepare(PrepareOptions(source=source, origin=str(origin), out=str(root / name),
                                                   eval_sets=eval_sets, on_error="fail"), progress)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if build_policy:
        results["policy"] = _policy(root, seed, policy, rebuild_policy, progress, policy_out)
    return {**results, "seconds": round(time.perf_counter() - t0, 1)}


def _policy(root: Path, seed: int, cfg, rebuild: bool, progress, out_dir=None) -> dict:
    cfg = replace(cfg or PolicyBuildConfig(), seed=seed)
    key = build_key(root, cfg)
    out = Path(out_dir) if out_dir is not None else root / POLICY_DIR
    try:
        old = json.loads((out / "build.json").read_text())
    except (OSError, ValueError):
        old = {}
    if not rebuild and old.get("key") == key and (out / "student").is_dir() and (out / "teacher").is_dir():
        progress(f"{out}: student and teacher already built from these training sets ({', '.join(TRAIN_SETS)}) "
                 "and this config; kept (--rebuild-policy to train again)")
        return {**old, "unchanged": True, "out": str(out)}
    progress("building the default policy: demonstrations, tokenizer, SFT (student, then teacher)")
    return {**build_policy(root, cfg, progress, out_dir=out), "unchanged": False, "out": str(out)}
