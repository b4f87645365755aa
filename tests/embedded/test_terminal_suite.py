"""The embedded terminal suite: Harbor task folders that are valid, deterministic and read by tsrl's loader."""

import math
import shutil
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tsrl_cli.datasets import harbor
from tsrl_cli.embedded import terminal_suite as ts
from tsrl_cli.files import tree_sha256

N_TRAIN = 2 * len(ts.SPLIT_FAMILIES["train"])  # two instances of every training family
N_HELDOUT = len(ts.FAMILIES)  # one of every family, held-out-only ones included


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    messages = []
    dirs = ts.build_terminal_suite(out, seed=0, n_train=N_TRAIN, n_heldout=N_HELDOUT, progress=messages.append)
    return out, dirs, messages


def _family(task_dir: Path) -> str:
    return tomllib.loads((task_dir / "task.toml").read_text())["metadata"]["family"]


def test_counts_and_families(suite):
    out, dirs, messages = suite
    assert [len(dirs["train"]), len(dirs["heldout"])] == [N_TRAIN, N_HELDOUT]
    assert all(p.parent == out / "terminal" / split for split, ps in dirs.items() for p in ps)
    train = Counter(_family(p) for p in dirs["train"])
    heldout = Counter(_family(p) for p in dirs["heldout"])
    assert len(train) >= 8 and set(train.values()) == {2}
    assert set(heldout) == set(ts.FAMILIES) and set(heldout.values()) == {1}
    assert len(ts.HELDOUT_ONLY) >= 2 and not set(ts.HELDOUT_ONLY) & set(train)
    n = N_TRAIN + N_HELDOUT
    assert messages[-1] == f"terminal: validated {n}/{n} tasks (0 before, 1 after solve.sh)"


def test_default_counts_are_unique():
    # generation only (no files): the default sizes give distinct ids and instructions in each split
    for split, n in (("train", 120), ("heldout", 30)):
        specs = ts.generate_specs(0, split, n)
        assert len({i for i, _, _ in specs}) == len({s.instruction for _, _, s in specs}) == n


def test_every_family_gives_0_then_1(suite):
    # the build already refused any task that does not; this checks one per family again, visibly
    _, dirs, _ = suite
    firsts = {}
    for p in dirs["heldout"]:  # every family appears here
        firsts.setdefault(_family(p), p)
    with ThreadPoolExecutor(4) as pool:
        rewards = dict(zip(firsts, pool.map(ts.validate_task, firsts.values()), strict=True))
    assert rewards == dict.fromkeys(ts.FAMILIES, (0.0, 1.0))


# plausible wrong answers a policy might give: the verifier must refuse them
WRONG = {
    "count_matches": "wc -l < {src} > {out}",
    "sort_lines": "cat {src} > {out}",
    "head_lines": "tail -n 2 {src} > {out}",
    "uppercase": "cat {src} > {out}",
    "count_words": "wc -w {src} > {out}",  # "12 file.txt", not the number alone
}


@pytest.mark.parametrize("family", sorted(WRONG))
def test_wrong_answers_score_0(suite, family):
    _, dirs, _ = suite
    p = next(p for p in dirs["train"] if _family(p) == family)
    [solve] = ts.solution_commands(p)
    src = next(w for w in solve.split() if w.endswith(".txt"))
    out = solve.split()[-1]
    assert ts.reward_after(p, WRONG[family].format(src=src, out=out)) == 0.0
    assert ts.reward_after(p, solve) == 1.0


def test_without_isolation_validation_falls_back_to_subprocesses(suite, monkeypatch):
    from tsrl_cli import sandbox

    def no_isolation(*a, **k):
        raise sandbox.IsolationError("neither bwrap nor unshare")

    monkeypatch.setattr(sandbox, "open_sandbox", no_isolation)
    _, dirs, _ = suite
    for p in dirs["train"][:: len(dirs["train"]) // 4]:
        assert ts.validate_task(p) == (0.0, 1.0), p.name


def test_broken_tasks_are_caught(suite, tmp_path):
    _, dirs, _ = suite
    p = shutil.copytree(dirs["train"][0], tmp_path / "t")
    (p / "solution" / "solve.sh").write_text("true\n")
    assert ts.validate_task(p) == (0.0, 0.0)
    (p / "tests" / "test.sh").write_text("true\n")  # writes no reward at all
    before, _ = ts.validate_task(p)
    assert math.isnan(before)  # neither 0 nor 1, so the build refuses it


def test_layout(suite):
    _, dirs, _ = suite
    for p in dirs["train"] + dirs["heldout"]:
        cfg = tomllib.loads((p / "task.toml").read_text())
        assert cfg["version"] == "1.0"
        assert cfg["metadata"]["difficulty"] in ("easy", "medium") and cfg["metadata"]["category"]
        assert "bash" in cfg["metadata"]["tags"]
        assert cfg["verifier"]["timeout_sec"] > 0 and cfg["agent"]["timeout_sec"] > 0
        assert cfg["environment"]["build_timeout_sec"] > 0 and "docker_image" not in cfg["environment"]
        assert (p / "instruction.md").read_text().strip()
        assert "WORKDIR /app" in (p / "environment" / "Dockerfile").read_text()
        test_sh = (p / "tests" / "test.sh").read_text()
        assert "mkdir -p /logs/verifier" in test_sh and "/logs/verifier/reward.txt" in test_sh
        for script in ("tests/test.sh", "solution/solve.sh"):
            assert (p / script).stat().st_mode & 0o111, script
        # the agent gets non-executable starting files (chmod_x relies on it)
        assert not any(f.stat().st_mode & 0o111 for f in (p / "environment").rglob("*") if f.is_file())


def test_harbor_loader_reads_every_task(suite):
    out, dirs, _ = suite
    for split in ("train", "heldout"):
        root = out / "terminal" / split
        found = harbor.find_task_dirs(root)
        assert found == sorted(dirs[split])
        for d in found:
            task = harbor.read_task_dir(d, source="embedded-terminal", split=split, rel=d.name)
            assert task.format == "harbor" and task.task_id == d.name
            assert task.instruction == (d / "instruction.md").read_text()
            assert (task.environment_dir, task.test_script, task.solution_script) == (
                "environment", "tests/test.sh", "solution/solve.sh")
            assert task.docker_image is None and task.reward_mode == "reward_file"
            assert (task.agent_timeout_s, task.verifier_timeout_s, task.build_timeout_s) == (120.0, 30.0, 300.0)
            assert task.meta["family"] == _family(d) and task.meta["split"] == split


def test_deterministic_and_prefix_stable(suite, tmp_path):
    _, dirs, _ = suite
    # a smaller build with the same seed reproduces the first tasks of each split byte for byte
    small = ts.build_terminal_suite(tmp_path / "a", seed=0, n_train=4, n_heldout=3)
    for split, ps in small.items():
        assert [p.name for p in ps] == [p.name for p in dirs[split][:len(ps)]]
        assert [tree_sha256(p) for p in ps] == [tree_sha256(p) for p in dirs[split][:len(ps)]]
    other = ts.build_terminal_suite(tmp_path / "b", seed=1, n_train=4, n_heldout=0)
    assert [tree_sha256(p) for p in other["train"]] != [tree_sha256(p) for p in small["train"]]
    # a rebuild replaces the previous suite instead of mixing with it
    again = ts.build_terminal_suite(tmp_path / "a", seed=0, n_train=2, n_heldout=1)
    assert sorted(p.name for p in (tmp_path / "a" / "terminal" / "train").iterdir()) == [p.name for p in again["train"]]


def test_heldout_shares_no_names_or_contents_with_train(suite):
    _, dirs, _ = suite
    assert not set(ts.POOLS["train"]) & set(ts.POOLS["heldout"])
    assert not set(ts.EXTS["train"]) & set(ts.EXTS["heldout"])

    def words(p: Path) -> set[str]:
        text = (p / "instruction.md").read_text() + "".join(
            f"{f.relative_to(p).as_posix()} {f.read_text()}" for f in (p / "environment").rglob("*")
            if f.is_file() and f.name != "Dockerfile")
        return set(text.replace(".", " ").replace("/", " ").replace(",", " ").replace("`", " ").split())

    for p in dirs["heldout"]:
        assert not words(p) & set(ts.POOLS["train"] + ts.EXTS["train"]), p.name
