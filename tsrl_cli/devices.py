"""Device specs: where each process of a run (rollout, learner, teacher) is placed.

A spec is `cpu`, a CUDA index (`4`), a range (`4-7`), a list (`0,1`), a torch name (`cuda:1`) or,
`cpu:N` (N CPU ranks or replicas). The learner runs one rank per device it is given: a group of
N ranks shards the model over them (rl/group.py). The rollout side runs one engine replica per device
(per `rollout.tensor_parallel` devices with vLLM). The teacher runs on one device; a range there is
refused with that message rather than silently using its first device.

`cuda:k` is logical: the k-th device this process can see, i.e. entry k of the inherited
CUDA_VISIBLE_DEVICES (an index, a GPU UUID or a MIG id; GPU k when it is unset), as torch and CUDA
number them. physical_device maps a logical device to that entry; where tsrl sets
CUDA_VISIBLE_DEVICES for an engine (engines/load.py) it writes the mapped entries, never the raw k.

torch is imported only inside cuda_count, the one function that asks the machine: config.py
imports this module and loads without torch (`tsrl --help` builds `tsrl verify`'s options from
config.LossConfig; predict and report read run configs).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from tsrl_cli.errors import UsageError

CVD = "CUDA_VISIBLE_DEVICES"


def parse_devices(spec: str | int, key: str) -> tuple[str, ...]:
    """'cpu' | 'cpu:4' | 'mps' | '3' | '4-7' | '0,2' | 'cuda:1' -> torch device names, in order (cpu:4: 4 x cpu)."""
    s = str(spec).strip().lower()
    if s in ("cpu", "mps"):
        return (s,)
    if m := re.fullmatch(r"cpu:(\d+)", s):
        n = int(m[1])
        if n < 1:
            raise UsageError(f"{key}: {spec!r} asks for no CPU rank; use cpu:1 or more")
        return ("cpu",) * n
    out: list[str] = []
    for part in s.split(","):
        part = part.strip()
        if re.fullmatch(r"cuda:\d+", part):
            out.append(part)
        elif re.fullmatch(r"\d+", part):
            out.append(f"cuda:{int(part)}")
        elif m := re.fullmatch(r"(\d+)-(\d+)", part):
            a, b = int(m[1]), int(m[2])
            if b < a:
                raise UsageError(f"{key}: range {part!r} runs backwards; write it low-high, e.g. 4-7")
            out += [f"cuda:{i}" for i in range(a, b + 1)]
        else:
            raise UsageError(f"{key}: {spec!r} is not a device list; use cpu, cpu:N (N CPU ranks, learner), a CUDA "
                             "index (4), a range (4-7), a list (0,1) or cuda:N")
    if len(set(out)) != len(out):
        raise UsageError(f"{key}: {spec!r} names a device twice")
    return tuple(out)


def one_device(spec: str | int, key: str) -> str:
    """The single device of the teacher (the learner shards over a range, the rollout side replicates)."""
    devs = parse_devices(spec, key)
    if len(devs) != 1:
        raise UsageError(f"{key}: {spec!r} names {len(devs)} devices, but the {key.rsplit('.', 1)[-1]} runs on one "
                         "device (the learner shards over a range, the rollout side runs a replica per device); "
                         f"name one, e.g. {devs[0].removeprefix('cuda:')}")
    return devs[0]


def learner_devices(cfg) -> tuple[str, ...]:
    """The learner's devices, one per rank (`cpu:4`: four CPU ranks)."""
    return parse_devices(cfg.devices.learner, "devices.learner")


def rollout_replicas(cfg) -> list[tuple[str, ...]]:
    """The rollout engine replicas, each as its devices: one device each, or `rollout.tensor_parallel`
    consecutive devices per vLLM replica (`0-3` with 2: [(cuda:0, cuda:1), (cuda:2, cuda:3)])."""
    devs = parse_devices(cfg.devices.rollout, "devices.rollout")
    tp = cfg.rollout.tensor_parallel
    if len(devs) % tp:
        raise UsageError(f"devices.rollout: {cfg.devices.rollout!r} names {len(devs)} device(s), not a multiple of "
                         f"rollout.tensor_parallel {tp}; name {tp} devices per replica")
    return [devs[i:i + tp] for i in range(0, len(devs), tp)]


def device_of(cfg, side: str) -> str:
    """The torch device of one side (rollout | learner | teacher); the first rank's or replica's of several."""
    if side == "learner":
        return learner_devices(cfg)[0]
    if side == "rollout" or cfg.devices.teacher is None:  # the teacher defaults to the rollout side's first device
        return parse_devices(cfg.devices.rollout, "devices.rollout")[0]
    return one_device(cfg.devices.teacher, "devices.teacher")


def visible_devices(env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The entries of CUDA_VISIBLE_DEVICES (in `env`, default this process's environment) as CUDA enumerates
    them: None when it is unset (every GPU, GPU k as cuda:k). Indices are normalised ("02" -> "2"); UUIDs
    (GPU-...) and MIG ids (MIG-...) are kept as written. As the CUDA runtime reads the list (torch.cuda mirrors
    it in _parse_visible_devices): it ends at the first entry it cannot read or of another kind than the first
    ("-1", "", a UUID after indices), and an entry listed twice makes the whole list empty."""
    raw = (os.environ if env is None else env).get(CVD)
    if raw is None:
        return None
    out: list[str] = []
    for entry in (e.strip() for e in raw.split(",")):
        kind = _cvd_kind(entry)
        if kind is None or (out and kind != _cvd_kind(out[0])):
            break
        entry = str(int(entry)) if kind == "index" else entry
        if entry in out:
            return ()
        out.append(entry)
    return tuple(out)


def _cvd_kind(entry: str) -> str | None:
    """index, GPU- (a UUID), MIG- (a MIG id), or None: an entry CUDA cannot read."""
    return "index" if entry.isascii() and entry.isdigit() else entry[:4] if entry[:4] in ("GPU-", "MIG-") else None


def physical_device(device: str, key: str, env: Mapping[str, str] | None = None) -> str:
    """The physical identity of a logical device: cuda:k -> entry k of CUDA_VISIBLE_DEVICES (visible_devices of
    `env`), or "k" when it is unset; cpu and mps are themselves. A k beyond the visible list is a UsageError
    naming `key` and the list."""
    if not device.startswith("cuda:"):
        return device
    k, visible = int(device.split(":", 1)[1]), visible_devices(env)
    if visible is None:
        return str(k)
    if k >= len(visible):
        listed = f"lists {len(visible)} ({','.join(visible)})" if visible else "lists no usable GPU"
        raise UsageError(f"{key}: {device} is entry {k} of CUDA_VISIBLE_DEVICES (counted from 0), which {listed}; "
                         + (f"name an index below {len(visible)}, or " if visible else "")
                         + "run where CUDA_VISIBLE_DEVICES lists more GPUs")
    return visible[k]


def cuda_count() -> int:
    """CUDA devices this process can use, counted through NVML where torch can (torch.cuda.device_count
    before CUDA is initialised): the count does not initialise CUDA, so the vllm engine can still set
    CUDA_VISIBLE_DEVICES afterwards (engines/load.py). 0 on a torch build without CUDA."""
    import torch

    return torch.cuda.device_count()


def check_available(device: str, key: str) -> None:
    """Fail early (exit 2) when a CUDA device is named on a machine that has fewer."""
    if not device.startswith("cuda"):
        return

    idx = int(device.split(":")[1])
    n = cuda_count()
    if idx >= n:
        raise UsageError(f"{key}: {device} is not available here ({n} CUDA device(s)); use cpu or an index below {n}"
                         if n else f"{key}: {device} asked for, but this torch build sees no CUDA device; use cpu")


def engine_device(spec: str | int | None, key: str = "--device") -> str:
    """The one device of an evaluation's or a probe's engine: `spec` checked and available, or, when None,
    the first GPU where there is one, else cpu."""
    if spec is None:
        return "cuda:0" if cuda_count() > 0 else "cpu"
    dev = one_device(spec, key)
    check_available(dev, key)
    return dev
