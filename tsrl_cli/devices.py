"""Device specs: where each process of a run (rollout, learner, teacher) is placed.

A spec is `cpu`, a CUDA index (`4`), a range (`4-7`), a list (`0,1`), a torch name (`cuda:1`) or,
for the learner, `cpu:N` (N CPU ranks). The learner runs one rank per device it is given: a group of
N ranks shards the model over them (rl/group.py). The rollout side and the teacher run on one
device each; a range there is refused with that message rather than silently using its first device.
"""

from __future__ import annotations

import re

import torch

from tsrl_cli.errors import UsageError


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
    """The single device of the rollout side or the teacher (engine replicas are not implemented)."""
    devs = parse_devices(spec, key)
    if len(devs) != 1:
        raise UsageError(f"{key}: {spec!r} names {len(devs)} devices, but the {key.rsplit('.', 1)[-1]} runs on one "
                         "device (rollout engine replicas are not implemented; the learner shards over a range); "
                         f"name one, e.g. {devs[0].removeprefix('cuda:')}")
    return devs[0]


def learner_devices(cfg) -> tuple[str, ...]:
    """The learner's devices, one per rank (`cpu:4`: four CPU ranks)."""
    return parse_devices(cfg.devices.learner, "devices.learner")


def device_of(cfg, side: str) -> str:
    """The torch device of one side (rollout | learner | teacher); the learner's first rank's for a group."""
    if side == "learner":
        return learner_devices(cfg)[0]
    spec = getattr(cfg.devices, side)
    if spec is None:  # the teacher defaults to the rollout device
        spec = cfg.devices.rollout
    return one_device(spec, f"devices.{side}")


def check_available(device: str, key: str) -> None:
    """Fail early (exit 2) when a CUDA device is named on a machine that has fewer."""
    if not device.startswith("cuda"):
        return

    idx = int(device.split(":")[1])
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if idx >= n:
        raise UsageError(f"{key}: {device} is not available here ({n} CUDA device(s)); use cpu or an index below {n}"
                         if n else f"{key}: {device} asked for, but this torch build sees no CUDA device; use cpu")
