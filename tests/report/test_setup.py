"""The report's setup label and device-hours come from each run's own config.yaml."""

import json
import statistics

import pytest
from report_helpers import build, markdown_cells, read_csv
from synthetic_runs import make_run, make_tree

from tsrl_cli.report.load import run_setup


def cfg(rollout="cpu", learner="cpu", teacher=None, objective="grpo", **extra):
    return {"objective": objective, "model": {"policy": "builtin:toy"}, "data": {"train": ["builtin:echo", "x"]},
            "devices": {"rollout": rollout, "learner": learner, "teacher": teacher}, **extra}


@pytest.mark.parametrize("config,kind,n", [
    (cfg(), "cpu", 2),  # one process each side, one OpenMP thread each
    (cfg(learner="cpu:4"), "cpu", 5),  # four learner ranks
    (cfg(objective="opd"), "cpu", 3),  # the teacher is a third process
    (cfg(rollout=0, learner="1-3"), "cuda", 4),
    (cfg(rollout=0, learner=0), "cuda", 1),  # one GPU shared by both sides is one device held
    (cfg(rollout=0, learner=1, objective="opd"), "cuda", 2),  # the teacher defaults to the rollout's GPU
    (cfg(rollout=0, learner=1, teacher=2, objective="opd"), "cuda", 3),
    (cfg(rollout="0,1", learner="cuda:2"), "cuda", 3),  # two engine replicas
    (cfg(rollout="cpu", learner=3), "cuda", 1),  # a cpu rollout beside a GPU learner: the GPU-hours
    ({**cfg(rollout=0, learner="cpu"), "rollout": {"engine": "openai"}}, "cpu", 1),  # remote rollouts: not its devices
    ({"model": {"policy": "m"}}, None, None),  # no devices key: no device-hours, never a guess
    (cfg(rollout="gpu"), None, None),
])
def test_devices_held(config, kind, n):
    s = run_setup(config)
    assert (s.device_kind, s.devices) == (kind, n)


def test_label_names_devices_model_and_tasks():
    assert run_setup(cfg(rollout=0, learner="1-3")).label == \
        "4 cuda devices (rollout 0, learner 1-3); model builtin:toy; tasks builtin:echo, x"
    assert run_setup({}).label == ("devices unknown (no devices in config.yaml); model unknown model; "
                                   "tasks unknown tasks")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Three setups in one tree: experiment g on GPUs (rollout 0, learner 1-2; 2 seeds, sync and stream),
    b on cpu with two learner ranks (1 seed), n whose config.yaml names no devices (stream only)."""
    root = tmp_path_factory.mktemp("mixed") / "r"
    make_tree(root, experiments=(("g", 0.5),), seeds=(1, 2), rounds=7, rollout="0", learner="1-2",
              model="Qwen/Qwen3-1.7B")
    make_tree(root, experiments=(("b", 0.5),), seeds=(1,), rounds=7, learner="cpu:2", model="other")
    make_run(root / "n" / "stream" / "seed1", "n", "stream", 1, 0.5, rounds=7)
    cfg_path = root / "n" / "stream" / "seed1" / "config.yaml"
    cfg_path.write_text(cfg_path.read_text().split("devices:")[0])
    out = root.parent / "out"
    return root, out, build(root, out)


def test_gpu_runs_count_gpu_hours_from_their_devices(mixed):
    """g's runs held 3 GPUs for their wall time: device-seconds = 3 x wall_s, not the metrics' core_s
    (2 processes x wall_s)."""
    root, out, _ = mixed
    rows = {r["schedule"]: r for r in read_csv(out / "tables" / "device_hours_to_target.csv") if r["experiment"] == "g"}
    assert list(rows) == ["sync", "stream"]
    for sched, r in rows.items():
        assert (r["device_kind"], r["devices"], r["reached"]) == ("cuda", "3", "2")
        target = float(r["target_reward"])
        walls = []
        for seed in (1, 2):  # the first round whose 5-round rolling reward reaches the target, by hand
            metrics = root / "g" / sched / f"seed{seed}" / "metrics.jsonl"
            ms = [json.loads(x) for x in metrics.read_text().splitlines()]
            hit = next(m for i, m in enumerate(ms) if i >= 4 and statistics.fmean(
                x["reward_mean"] for x in ms[i - 4:i + 1]) >= target - 1e-12)
            walls.append(hit["wall_s"])
        assert float(r["device_s_mean"]) == pytest.approx(3 * statistics.fmean(walls), rel=1e-12)
        assert float(r["device_s_mean"]) != pytest.approx(statistics.fmean(2 * w for w in walls))


def test_each_setup_is_listed_and_each_row_names_its_devices(mixed):
    _, out, _ = mixed
    md = (out / "REPORT.md").read_text()
    assert "ours (3 setups, listed above)" in md
    assert "  - 4 run(s): 3 cuda devices (rollout 0, learner 1-2); model Qwen/Qwen3-1.7B; tasks builtin:echo" in md
    assert "  - 2 run(s): 3 cpu devices (rollout cpu, learner cpu:2); model other; tasks builtin:echo" in md
    assert "  - 1 run(s): devices unknown (no devices in config.yaml); model builtin:toy; tasks builtin:echo" in md
    budget = {(r["experiment"], r["schedule"]): r for r in read_csv(out / "tables" / "reward_at_budget.csv")}
    assert (budget["b", "sync"]["device_kind"], budget["b", "sync"]["devices"]) == ("cpu", "3")
    assert "budget device-hours (cpu, cuda)" in markdown_cells((out / "tables" / "reward_at_budget.md").read_text())[0]


def test_runs_without_devices_get_no_device_hours(mixed):
    _, out, doc = mixed
    assert "n/stream/seed1: no devices in config.yaml, so no device-hours" in doc["notes"]
    (row,) = [r for r in read_csv(out / "tables" / "device_hours_to_target.csv") if r["experiment"] == "n"]
    assert (row["device_kind"], row["device_s_mean"], row["reached"]) == ("", "", "1")  # reached, but no device-s
