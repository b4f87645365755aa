"""experiments/node8/: the paper's node as experiment files. They load with the strict loader, follow the
paper's protocol, and `tsrl doctor` on a machine without the GPUs says which are missing (exit 1)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import load_config
from tsrl_cli.devices import device_of, learner_devices, rollout_replicas
from tsrl_cli.doctor import GPU, machine_facts, plan_checks

NODE8 = Path(__file__).resolve().parents[2] / "experiments" / "node8"
FILES = ["grpo_full.yaml", "grpo_lora.yaml", "opd_full.yaml", "opd_lora.yaml"]


def test_the_four_files_are_there():
    assert sorted(p.name for p in NODE8.glob("*.yaml")) == sorted(FILES)


@pytest.mark.parametrize("name", FILES)
def test_loads_with_the_paper_protocol(name):
    cfg = load_config(NODE8 / name)  # strict: an unknown key or a bad value raises
    assert cfg.rollout.group_size == 8 and cfg.rounds == 40 and cfg.schedule == "stream"
    assert learner_devices(cfg) == ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    assert device_of(cfg, "rollout") == "cuda:0"
    # every GPU of the node works: 4 learner ranks, the rest engine replicas (and OPD's teacher)
    replicas = [d for r in rollout_replicas(cfg) for d in r]
    assert replicas == (["cuda:0", "cuda:2", "cuda:3"] if name.startswith("opd") else [f"cuda:{i}" for i in range(4)])
    assert cfg.model.dtype == "bfloat16" and cfg.model.policy == "data/models/Qwen3-8B"
    assert cfg.learner.max_microbatch_tokens == 32768
    opd, lora = name.startswith("opd"), "lora" in name
    assert cfg.objective == ("opd" if opd else "grpo")
    assert cfg.data.train == (("seta_env",) if opd else ("swe_smith",))
    if opd:
        assert device_of(cfg, "teacher") == "cuda:1" and cfg.model.teacher == "data/models/Qwen3-32B"
    assert cfg.lora.rank == (16 if lora else 0)
    assert cfg.loss.buffer_device == ("device" if lora else "cpu")
    # every row rolls out with vLLM (LoRA rows: vLLM's LoRA support) and the model's own chat template
    assert cfg.rollout.engine == "vllm" and cfg.model.chat_template == "auto"
    assert "  thinking: " in (NODE8 / name).read_text()  # stated, not left to the default


@pytest.mark.parametrize("name", FILES)
def test_header_says_how_to_check_and_run(name):
    head = (NODE8 / name).read_text().split("\nname:")[0]
    assert all(line.startswith("#") for line in head.splitlines())
    for needed in (f"tsrl doctor experiments/node8/{name}", "--seeds 42,43,44", "rounds 1-4 warm-up",
                   "group size 8", "40 rounds", "weight bus", "tsrl prepare-data"):
        assert needed in head, needed


@pytest.mark.parametrize("name", FILES)
def test_doctor_on_this_machine_names_the_missing_gpus(name, tmp_path, monkeypatch):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the node's 8 GPUs")
    monkeypatch.chdir(tmp_path)  # no prepared datasets here
    res = CliRunner().invoke(app, ["doctor", str(NODE8 / name), "--json"])
    assert res.exit_code == 1, res.output  # missing, not crashed (a crash exits 1 with an exception and no JSON)
    doc = json.loads(res.stdout)
    learner = {c["what"]: c for c in doc["checks"]}["devices.learner 4-7"]
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert not learner["ok"] and all(f"cuda:{i}" in learner["detail"] for i in range(max(4, n), 8))


@pytest.mark.parametrize("name", FILES)
def test_on_a_node_of_8_only_data_models_and_packages_remain(name, tmp_path, monkeypatch):
    """Positive control: with 8 GPUs, NCCL, the gpu extra's torch and vLLM, peft and Docker, the devices and
    packages all pass."""
    monkeypatch.chdir(tmp_path)
    facts = machine_facts()
    node = dataclasses.replace(
        facts, gpus=tuple(GPU(i, "NVIDIA H200", 141 * 2**30) for i in range(8)), nccl=True, docker_daemon=True,
        versions=facts.versions | {"torch": "2.14.0", "vllm": "0.33.0", "peft": "0.13.0", "docker": "7.1.0"},
        vllm_dist="vllm")  # the gpu extra installed: its torch and vLLM pins hold
    missing = {c.what.split()[0] for c in plan_checks(load_config(NODE8 / name), node) if not c.ok}
    assert missing == ({"model.policy", "model.teacher", "data.train"} if name.startswith("opd")
                       else {"model.policy", "data.train"})
