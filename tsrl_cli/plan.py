"""`tsrl plan EXPERIMENT.yaml`: each process's peak memory, its device's capacity, and whether it fits, from the
models' config.json alone (no weights, no GPU). The arithmetic is in docs/distributed.md, "The memory plan".

    plan_experiment(cfg, capacity_gib=None, host_gib=None) -> {"processes": [...], "fits": bool}

  learner-r  measured (memtrace): one forward and backward of the largest micro-batch with the run's learner.*
             settings, and AdamW's step over this rank's tensors; added by arithmetic: AdamW's two moments in the
             optimizer's dtype, one process's float32 masters, the streaming buffers on the device (1 + 2k sets of
             this rank's trained elements) and a KL term's frozen reference.
  engine-i   vllm: vLLM's own accounting. It takes rollout.vllm_memory_fraction of the device; the weights, its
             profile forward and the key/value cache of one max_model_len sequence must fit in that. hf: measured,
             the prefill of rollout.max_batch full-length requests (their key/value cache and logits).
  teacher    measured: a turn scored from scratch over a full-length prefix, plus the caches the scorer keeps.
  host       pinned streaming buffers of ranks on GPUs (loss.buffer_device cpu) and rank 0's copy of the policy.

Processes on one device share it: each process `fits` when all of that device's processes together fit.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import device_of, learner_devices, rollout_replicas
from tsrl_cli.errors import UsageError
from tsrl_cli.memtrace import LearnerShape, inference, learner_pass, optimizer_step
from tsrl_cli.policy import TORCH_DTYPES, model_config
from tsrl_cli.rl.masters import master_dtype
from tsrl_cli.rl.teacher_worker import CACHE_BYTES

GiB = 1 << 30
DEFAULT_DEVICE_GIB = 80.0  # a CUDA device this machine does not have is taken to be this large (--capacity-gib)
# vLLM's profile run: a forward over max_num_batched_tokens, logits for max_num_seqs; tsrl sets neither, so vLLM's
# defaults for the LLM class on a GPU of 70 GiB or more apply (vllm/engine/arg_utils.py; not checked against 0.33)
VLLM_PROFILE_TOKENS = 16384
VLLM_PROFILE_SEQS = 1024


@dataclass
class Process:
    name: str  # learner-0, engine-1, rollout (the engine in the rollout process), teacher, host
    device: str  # cuda:N or cpu
    peak_bytes: int
    how: str  # measured how, in a few words
    parts: dict = field(default_factory=dict)  # what the peak is made of, bytes
    counts: dict = field(default_factory=dict)  # the shapes behind it (rows, sets, sequences ...)
    capacity_bytes: int = 0
    capacity: str = ""  # where the capacity comes from
    device_bytes: int = 0  # every process on this device together
    fits: bool = False


# ---------------------------------------------------------------------------- inputs


def _config(cfg: TrainConfig, side: str):
    """The architecture of the policy or the teacher: model.<side>_config, else the model folder's own config.json."""
    spec = getattr(cfg.model, f"{side}_config") or getattr(cfg.model, side)
    if spec.startswith("builtin:"):
        raise UsageError(f"model.{side} {spec}: tsrl plan reads a config.json; set model.{side}_config=DIR "
                         "(a folder holding the model's config.json)")
    return model_config(spec)


def _trajectory_tokens(cfg: TrainConfig, config) -> int:
    """The longest row any process sees: rollout.max_trajectory_tokens, within the model's positions."""
    max_pos = getattr(config, "max_position_embeddings", None)
    return min(cfg.rollout.max_trajectory_tokens, max_pos) if max_pos else cfg.rollout.max_trajectory_tokens


def microbatch_rows(cfg: TrainConfig, world: int, width: int) -> int:
    """Rows of the experiment's largest micro-batch of `width` positions (rl/learner.py StreamLearner._chunks):
    sync's padded batch splits only under learner.max_microbatch_tokens; stream and async micro-batch queued
    arrivals where learner.microbatch says so (auto: a group or a CUDA learner), else one row at a time."""
    lc, n = cfg.learner, cfg.rollout.prompts_per_round * cfg.rollout.group_size
    on_cuda = learner_devices(cfg)[0].startswith("cuda")
    batching = lc.microbatch == "on" or (lc.microbatch == "auto" and (world > 1 or on_cuda))
    padded_sync = cfg.schedule == "sync" and cfg.sync_batching == "padded"
    items = None if padded_sync else (lc.max_microbatch_items if batching else 1)
    rows = n if lc.max_microbatch_tokens is None else max(1, lc.max_microbatch_tokens // width)
    return min(rows, n, items or n)


def buffer_sets(cfg: TrainConfig) -> int:
    """Parameter-sized streaming buffers at the peak (docs/streaming.md, "Memory"): R, plus per open GRPO group S_r
    and S_1 (S_1 alone for Dr. GRPO's `center`), per open OPD trajectory under seq-mean-token-mean one; k is
    loss.max_open_groups or everything the round can open. sync backwards complete groups only: R alone."""
    ro, lc = cfg.rollout, cfg.loss
    if cfg.schedule == "sync":
        return 1
    cap = lc.max_open_groups if lc.max_open_groups is not None else math.inf
    if cfg.objective == "grpo":
        return 1 + (2 if lc.adv_norm == "group" else 1) * int(min(cap, ro.prompts_per_round))
    if lc.loss_agg == "seq-mean-token-mean":
        return 1 + int(min(cap, ro.prompts_per_round * ro.group_size))
    return 1


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------- the learner


def learner_processes(cfg: TrainConfig, config) -> tuple[list[Process], dict]:
    """One Process per learner rank (all alike), and what the ranks keep in host memory ({"host": bytes, ...})."""
    devices = learner_devices(cfg)
    world, on_cuda = len(devices), devices[0].startswith("cuda")
    dtype = TORCH_DTYPES[cfg.model.dtype]
    masters = master_dtype(cfg)
    buf_dtype = torch.bfloat16 if cfg.loss.buffer_dtype == "bfloat16" else \
        (torch.float64 if dtype == torch.float64 else torch.float32)
    host_buffers = cfg.loss.buffer_device == "cpu" and on_cuda  # pinned host memory, a capacity of its own
    width = _trajectory_tokens(cfg, config)
    rows = microbatch_rows(cfg, world, width)
    regularized = bool(cfg.loss.kl_coef or cfg.loss.entropy_coef)
    shape = LearnerShape(rows=rows, width=width, dtype=dtype, world=world, lora=cfg.lora,
                         checkpointing=cfg.learner.activation_checkpointing, chunk_tokens=cfg.learner.logits_chunk_tokens,
                         entropy=cfg.loss.entropy_coef != 0,
                         passes=2 if cfg.objective == "grpo" and regularized and cfg.schedule != "sync" else 1,
                         master_dtype=masters, buffer_dtype=None if host_buffers else buf_dtype)
    tr = learner_pass(config, shape)
    b_opt = _size(tr.opt_dtype)
    opt_numel = sum(math.prod(s) for s in tr.opt_shapes)
    sets = buffer_sets(cfg)
    set_bytes = tr.buffer_numel * _size(buf_dtype)
    adam = cfg.optim.optimizer == "adamw"
    parts = {
        "traced_pass": tr.pass_peak,  # parameters on this rank, activations, gradients, FSDP's buffers
        "optimizer_moments": 2 * opt_numel * b_opt if adam else 0,
        "masters": 0 if tr.opt_is_model else opt_numel * b_opt,
        "streaming_buffers": 0 if host_buffers else sets * set_bytes,
        "kl_reference": tr.param_numel * _size(dtype) if cfg.loss.kl_coef else 0,
    }
    pass_bytes = sum(parts.values())
    step = optimizer_step(tr.opt_shapes, tr.opt_dtype, foreach=on_cuda) if adam else 2 * opt_numel * b_opt
    # beside the optimizer's own tensors during its step: the rest of the model, the reference, and one process's
    # round buffer R when its gradient is a cast of it (R is held by the caller until the step is done)
    resident = tr.param_bytes - (tr.trainable_bytes if tr.opt_is_model else 0) + parts["kl_reference"]
    r_extra = set_bytes if world == 1 and not host_buffers and buf_dtype != tr.opt_dtype else 0
    step_bytes = step + resident + r_extra
    peak = max(pass_bytes, step_bytes)
    parts |= {"pass": pass_bytes, "traced_optimizer_step": step, "step": step_bytes, "buffer_set": set_bytes}
    counts = {"microbatch_rows": rows, "microbatch_width": width, "buffer_sets": sets, "passes": shape.passes}
    how = (f"measured on fake CPU tensors: {'rank 0 of an FSDP2 group of ' + str(world) if world > 1 else 'one process'}, "
           f"a {rows} x {width} micro-batch, then {'the moments, ' if adam else ''}buffers by arithmetic")
    procs = [Process("learner" if world == 1 else f"learner-{r}", d, peak, how, dict(parts), dict(counts))
             for r, d in enumerate(devices)]
    host = {}
    if host_buffers:
        host["learner_pinned_buffers"] = world * sets * set_bytes
        # HostFold's pinned copy of one fold's gradients per rank, which the pinned allocator keeps
        host["learner_fold_staging"] = world * tr.buffer_numel * _size(dtype)
    if world > 1 and on_cuda:  # rank 0's full copy of the policy: publishing and checkpoints
        host["learner_rank0_policy_copy"] = world * tr.param_numel * _size(dtype)
    return procs, host


# ---------------------------------------------------------------------------- engines and the teacher


def kv_bytes_per_token(config, dtype: torch.dtype, tp: int = 1) -> int:
    """vLLM's key/value cache per token on one device: 2 (key and value) x layers x KV heads x head_dim x bytes,
    KV heads split over tensor-parallel ranks (at least one per rank)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * max(1, heads // tp) * head_dim * _size(dtype)


def vllm_profile(cfg: TrainConfig, config) -> tuple[int, int]:
    """(peak, parameter bytes) of vLLM's profile forward, measured on the HF model of the same config."""
    return inference(config, TORCH_DTYPES[cfg.model.dtype], 1, VLLM_PROFILE_TOKENS, keep=VLLM_PROFILE_SEQS)


def vllm_process(cfg: TrainConfig, config, name: str, device: str, tp: int, capacity: int, sessions: int,
                 profile: tuple[int, int]) -> Process:
    """vLLM's accounting on one device of a replica (vllm's gpu_memory_utilization): it takes fraction x capacity
    whatever the load; inside that, weights/tp, its profile forward and at least one max_model_len sequence's
    key/value cache must fit (else vLLM refuses to start), and what is left is key/value cache."""
    dtype = TORCH_DTYPES[cfg.model.dtype]
    max_len = _trajectory_tokens(cfg, config)
    peak, params = profile
    weights, act = params // tp, (peak - params) // tp
    per_token = kv_bytes_per_token(config, dtype, tp)
    budget = int(cfg.rollout.vllm_memory_fraction * capacity)
    need = weights + act + per_token * max_len
    kv = max(0, budget - weights - act)
    parts = {"weights": weights, "profile_activations": act, "kv_cache": kv, "gpu_memory_utilization": budget}
    counts = {"kv_bytes_per_token": per_token, "max_model_len": max_len,
              "full_length_sequences": kv // (per_token * max_len), "sessions": sessions}
    how = (f"vLLM's accounting: {cfg.rollout.vllm_memory_fraction:g} of the device; KV 2 x layers x kv_heads x "
           f"head_dim x bytes per token; profile forward of {VLLM_PROFILE_TOKENS} tokens measured")
    return Process(name, device, max(budget, need), how, parts, counts)


def hf_engine_process(cfg: TrainConfig, config, sessions: int) -> Process:
    """The hf engine's largest call: rollout.max_batch requests (1 when batch_invariant; at most the replica's
    sessions) prefilled at full length, with their key/value cache and the last position's logits, as HFEngine's
    prefill computes them. Named and placed by the caller."""
    rows = 1 if cfg.rollout.batch_invariant else min(cfg.rollout.max_batch, sessions)
    width = _trajectory_tokens(cfg, config)
    peak, params = inference(config, TORCH_DTYPES[cfg.model.dtype], rows, width, keep=1, cache=True, lora=cfg.lora)
    return Process("", "", peak, f"measured on fake CPU tensors: a prefill of {rows} x {width}",
                   {"weights": params, "prefill": peak - params}, {"rows": rows, "width": width, "sessions": sessions})


def teacher_process(cfg: TrainConfig, config) -> Process:
    """The teacher's worst turn: a trajectory's prefix scored from scratch (rl/teacher_worker.py TurnScorer), its
    key/value cache built and the turn's logits kept and log-softmaxed, beside the caches the scorer keeps."""
    width = _trajectory_tokens(cfg, config)
    keep = min(cfg.rollout.max_turn_tokens, width - 1) + 1
    peak, params = inference(config, TORCH_DTYPES[cfg.model.dtype], 1, width, keep=keep, cache=True, logprobs=True)
    return Process("teacher", device_of(cfg, "teacher"), peak + CACHE_BYTES,
                   f"measured on fake CPU tensors: a {width}-token prefix scored, {keep} logits kept",
                   {"weights": params, "scoring": peak - params, "kept_caches": CACHE_BYTES},
                   {"prefix": width, "kept_logits": keep})


# ---------------------------------------------------------------------------- the plan


def _capacity(device: str, capacity_gib: float | None, host_gib: float | None,
              gpus: dict[int, int] | None = None) -> tuple[int, str]:
    """(bytes, where that figure comes from) of a device: the flags, else this machine's GPU (`gpus`: index ->
    bytes, default what torch sees) or memory, else DEFAULT_DEVICE_GIB for a GPU this machine lacks."""
    if device == "cpu":
        if host_gib is not None:
            return int(host_gib * GiB), "--host-gib"
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    if capacity_gib is not None:
        return int(capacity_gib * GiB), "--capacity-gib"
    index = int(device.split(":")[1]) if device.startswith("cuda:") else -1
    if gpus is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpus = {i: torch.cuda.get_device_properties(i).total_memory for i in range(n)}
    if index in gpus:
        return gpus[index], "this machine's GPU"
    return int(DEFAULT_DEVICE_GIB * GiB), f"assumed {DEFAULT_DEVICE_GIB:g} GiB (no such GPU here; --capacity-gib)"


def plan_experiment(cfg: TrainConfig, capacity_gib: float | None = None, host_gib: float | None = None,
                    gpus: dict[int, int] | None = None) -> dict:
    """The memory plan: {"processes": [Process as a dict, ...], "fits": every process fits}. Capacities: `capacity_gib`
    for every CUDA device and `host_gib` for the host, else this machine's (`gpus`: index -> bytes, as tsrl doctor
    knows them; default what torch sees)."""
    for flag, gib in (("--capacity-gib", capacity_gib), ("--host-gib", host_gib)):
        if gib is not None and not (math.isfinite(gib) and gib > 0):  # NaN and infinity are no capacity either
            raise UsageError(f"{flag} {gib:g}: must be a finite number of GiB > 0 (e.g. {flag} 80)")
    if cfg.loss.max_open_groups is not None and cfg.loss.max_open_groups < 0:  # else a negative count of buffer sets
        raise UsageError(f"loss.max_open_groups {cfg.loss.max_open_groups}: must be >= 0 (or unset: no cap)")
    policy = _config(cfg, "policy")
    procs, host = learner_processes(cfg, policy)
    if cfg.rollout.engine != "openai":  # remote servers hold their own memory (plan them where they run)
        replicas = rollout_replicas(cfg)
        sessions = -(-cfg.rollout.concurrency // len(replicas))
        traced = vllm_profile(cfg, policy) if cfg.rollout.engine == "vllm" else hf_engine_process(cfg, policy, sessions)
        for i, devs in enumerate(replicas):
            base = "rollout" if len(replicas) == 1 else f"engine-{i}"  # one device: the rollout process's own engine
            for j, d in enumerate(devs):
                name = base if len(devs) == 1 else f"{base}.{j}"
                if cfg.rollout.engine == "vllm":
                    procs.append(vllm_process(cfg, policy, name, d, len(devs),
                                              _capacity(d, capacity_gib, host_gib, gpus)[0], sessions, traced))
                else:
                    procs.append(Process(name, d, traced.peak_bytes, traced.how, dict(traced.parts), dict(traced.counts)))
    if cfg.objective == "opd":
        procs.append(teacher_process(cfg, _config(cfg, "teacher")))
    if host:
        procs.append(Process("host", "cpu", sum(host.values()), "arithmetic: host-memory buffers and copies", host))
    for p in procs:
        p.capacity_bytes, p.capacity = _capacity(p.device, capacity_gib, host_gib, gpus)
        p.device_bytes = sum(q.peak_bytes for q in procs if q.device == p.device)
        p.fits = p.device_bytes <= p.capacity_bytes
    return {"processes": [asdict(p) for p in procs], "fits": all(p.fits for p in procs)}
