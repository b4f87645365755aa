"""Where every process of a run is, resolved once at its start, and what each worker entry point takes.

    Placement.of(cfg, bus_port)   the learner's devices (one per rank), the engine replicas' devices (none for
                                  remote servers), the teacher's device, the weight bus (rl/weightbus.py Bus)

The worker entry points (rl/*_main) each take one frozen args object built by rl/train.py Workers: the
run's config, this placement, and the worker's own inputs (directories, plans, queues).
"""

from __future__ import annotations

from dataclasses import dataclass

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import device_of, learner_devices, rollout_replicas
from tsrl_cli.rl.weightbus import Bus, bus_backend, bus_size


@dataclass(frozen=True)
class Placement:
    learner: tuple[str, ...]  # one torch device per learner rank (cpu:2: two "cpu")
    replicas: tuple[tuple[str, ...], ...]  # each engine replica's devices; () with remote servers
    teacher: str | None  # OPD's teacher device
    bus: Bus | None  # the weight bus (None: no bus, e.g. a test replaying rounds in one process)

    @classmethod
    def of(cls, cfg: TrainConfig, bus_host: str | None = None, bus_port: int | None = None) -> Placement:
        bus = None
        if bus_port is not None:
            bus = Bus(bus_host or cfg.rollout.weight_bus_host, bus_port, bus_size(cfg), bus_backend(cfg),
                      cfg.rollout.weight_bucket_mb << 20)
        replicas = tuple(rollout_replicas(cfg)) if cfg.rollout.engine != "openai" else ()
        return cls(learner_devices(cfg), replicas, device_of(cfg, "teacher") if cfg.objective == "opd" else None, bus)
