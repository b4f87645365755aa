"""`tsrl plan EXPERIMENT.yaml`: each process's peak memory, its device's capacity, and whether it fits, from the
models' config.json alone (no weights, no GPU). The arithmetic is in docs/distributed.md, "The memory plan".

    plan_experiment(cfg, capacity_gib=None, host_gib=None) -> {"processes": [...], "fits": bool}

  learner-r  measured (memtrace): one forward and backward of the largest micro-batch with the run's learner.*
             settings, and AdamW's step over this rank's tensors; added by arithmetic: AdamW's two moments in the
             optimizer's dtype, one process's float32 masters, the streaming buffers on the device (1 + 2k sets of
             this rank's trained elements), a KL term's frozen reference, and with host buffers the gradients of
             the loss.host_fold_pending passes the fold queue may hold (fold_backlog).
  engine-i   vllm: vLLM's own accounting. It takes rollout.vllm_memory_fraction of the device; the weights, LoRA's
             stacked adapters, its profile forward, the CUDA allowance and the key/value cache of one max_model_len
             sequence must fit in that; a warning when the rest, the key/value cache, holds fewer tokens than the
             replica's running turns at full length (kv_shortfall). hf: measured, the prefill of rollout.max_batch
             full-length requests.
  teacher    measured: the costliest forward of rl/teacher_worker.TurnScorer (a full-length prefix's last chunk),
             plus the other open sessions' key/value caches (teacher_cache_bytes: rollout.concurrency full-length
             trajectories, or model.teacher_cache_gib), and how many full-length sessions those caches hold.
  host       pinned streaming buffers of ranks on GPUs (loss.buffer_device cpu), each tensor a power-of-two block of
             the caching host allocator (pinned_block_bytes), rank 0's copy of the policy, vLLM's host copies of the
             LoRA adapters.

Every process on a CUDA device gets CUDA_RUNTIME_BYTES on top of what the tracker measures (the CUDA context,
library workspaces, NCCL's buffers, allocator slack), inside vLLM's fraction for an engine. Processes on one device
share it: each process `fits` when all of that device's processes together fit. Capacities: --capacity-gib for
every CUDA device (else this machine's GPU of that index, else an 80 GB device); --host-gib, else
devices.host_memory_gib (the host the run is planned for), else this machine's memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import device_of, learner_devices, rollout_replicas
from tsrl_cli.engines.vllm import MAX_LORAS, lora_rank_cap
from tsrl_cli.errors import UsageError
from tsrl_cli.memtrace import LearnerShape, inference, learner_pass, optimizer_step, teacher_scoring
from tsrl_cli.policy import TORCH_DTYPES, build_from_config, model_config
from tsrl_cli.rl.masters import master_dtype
from tsrl_cli.rl.teacher_worker import teacher_cache_bytes

GiB = 1 << 30
# a CUDA device this machine does not have is taken to be an 80 GB one (H100 class; 80e9 bytes, 74.5 GiB, less than
# such a device reports to CUDA, so the difference is margin); --capacity-gib says otherwise
DEFAULT_DEVICE_BYTES = 80 * 10**9
# beside the tracked tensors, per process on a CUDA device: the CUDA context and its libraries' workspaces (cuBLAS,
# cuDNN), NCCL's communicator buffers and the caching allocator's rounding and fragmentation. An allowance, not a
# measurement here: experiments/plan_vs_cuda.py measures the context and the allocator's slack on a GPU
CUDA_RUNTIME_BYTES = 2 * GiB
# vLLM's profile run: a forward over max_num_batched_tokens, logits for max_num_seqs. tsrl sets max_num_seqs to
# rollout.max_batch (rl/replicas.py) and leaves the token budget on a GPU to vLLM's default for the LLM class on a GPU
# of 70 GiB or more (vllm/engine/arg_utils.py; not checked against 0.33)
VLLM_PROFILE_TOKENS = 16384
# vLLM shards these layers by rows (ColumnParallelLinear: the output split over tensor-parallel ranks); the others
# of Qwen3's decoder (o_proj, down_proj) by columns (RowParallelLinear: the input split)
VLLM_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# the host parts in pinned memory (loss.buffer_device cpu, a learner on GPUs): the tensors as asked, and what the
# caching host allocator's power-of-two blocks add to them (pinned_block_bytes)
PINNED_PARTS = ("learner_pinned_buffers", "learner_fold_staging", "pinned_rounding")


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
    warnings: list = field(default_factory=list)  # what fits but costs time (vLLM: a KV cache short of its turns)


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
    """Rows of the experiment's largest micro-batch of `width` positions (rl/microbatch.py chunks):
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
    and S_1 (S_1 alone for Dr. GRPO's `center`), per open OPD trajectory under seq-mean-token-mean one (none under
    learner.opd_unit trajectory: a trajectory's turns go to R in one row at its end); k is loss.max_open_groups or
    everything the round can open. sync backwards complete groups only: R alone."""
    ro, lc = cfg.rollout, cfg.loss
    if cfg.schedule == "sync":
        return 1
    cap = lc.max_open_groups if lc.max_open_groups is not None else math.inf
    if cfg.objective == "grpo":
        return 1 + (2 if lc.adv_norm == "group" else 1) * int(min(cap, ro.prompts_per_round))
    if lc.loss_agg == "seq-mean-token-mean" and cfg.learner.opd_unit == "turn":
        return 1 + int(min(cap, ro.prompts_per_round * ro.group_size))
    return 1


def prefix_cut_states(cfg: TrainConfig, world: int) -> tuple[int, int]:
    """(prompt parts held at once, keys-and-values sets each) of the shared-prompt cut (rl/prefix.py), (0, 0) where it
    does not run. sync backwards one complete group at a time: one part with R's adjoint. stream and async: up to
    every group of the round, each with R's adjoint and the open group's two sums (affine) or one per reward value
    (GRPO), or one per running trajectory's unit buffer (OPD, seq-mean-token-mean with learner.opd_unit turn)."""
    lc = cfg.learner
    if not (lc.prefix_cut and world == 1 and not cfg.loss.kl_coef and cfg.offpolicy.tis_cap is None):
        return 0, 0
    if cfg.schedule == "sync":
        return 1, 1
    if cfg.objective == "opd":
        units = cfg.loss.loss_agg == "seq-mean-token-mean" and lc.opd_unit == "turn"
        return cfg.rollout.prompts_per_round, 1 + (cfg.rollout.group_size if units else 0)
    buckets = cfg.loss.group_buffers == "buckets"
    return cfg.rollout.prompts_per_round, 1 + (cfg.rollout.group_size if buckets else 2)


def prefix_cut_bytes(cfg: TrainConfig, config, world: int, tr, positions: int) -> int:
    """The cut's kept prompt parts: each a learner.prompt_tokens forward's activations (the traced pass's per
    position, its graph kept until the group closes), its keys and values and their adjoint sets."""
    parts, sets = prefix_cut_states(cfg, world)
    if not parts:
        return 0
    p = cfg.learner.prompt_tokens
    act = tr.parts.get("Activation", 0) * p // max(positions, 1)
    kv = kv_bytes_per_token(config, TORCH_DTYPES[cfg.model.dtype]) * p
    return parts * (act + (1 + sets) * kv)


_TRACES: dict = {}


def _traced(trace, first, *args, **kwargs):
    """trace(first, *args, **kwargs), a fake-tensor trace of memtrace, once per process for the same inputs: a trace
    is a pure function of the model's config and the shapes, so planning one experiment at several capacities
    (`tsrl doctor`, tests) traces each process once. Keyed by the function itself and the inputs' text."""
    head = first.to_json_string() if hasattr(first, "to_json_string") else repr(first)
    key = (trace, head, repr(args), repr(sorted(kwargs.items())))
    if key not in _TRACES:
        _TRACES[key] = trace(first, *args, **kwargs)
    return _TRACES[key]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pinned_block_bytes(n: int) -> int:
    """Bytes of pinned host memory a tensor of `n` bytes holds: PyTorch's caching host allocator rounds every
    request up to the next power of two (CachingHostAllocatorImpl::allocate, aten/src/ATen/core/
    CachingHostAllocator.h: c10::llvm::PowerOf2Ceil(size), below pinned_max_round_threshold_mb, unlimited by
    default) and keeps the block when the tensor is freed. 0 for 0 bytes; 5 MiB -> 8 MiB; 2^k stays 2^k."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


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
                         checkpointing=cfg.learner.activation_checkpointing,
                         chunk_tokens=cfg.learner.logits_chunk_tokens,
                         entropy=cfg.loss.entropy_coef != 0,
                         passes=2 if cfg.objective == "grpo" and regularized and cfg.schedule != "sync" else 1,
                         master_dtype=masters, buffer_dtype=None if host_buffers else buf_dtype)
    tr = _traced(learner_pass, config, shape)
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
        # host buffers: the fold queue keeps up to loss.host_fold_pending passes' gradients on the device, each
        # what one pass hands the fold thread (a group rank: every unit's all-to-all output, N x its shard)
        "fold_backlog": cfg.loss.host_fold_pending * world * tr.buffer_numel * _size(dtype) if host_buffers else 0,
        "prefix_cut": prefix_cut_bytes(cfg, config, world, tr, rows * width),
    }
    pass_bytes = sum(parts.values())
    step = _traced(optimizer_step, tr.opt_shapes, tr.opt_dtype, foreach=on_cuda) if adam else 2 * opt_numel * b_opt
    # beside the optimizer's own tensors during its step: the rest of the model, the reference, and one process's
    # round buffer R when its gradient is a cast of it (R is held by the caller until the step is done)
    resident = tr.param_bytes - (tr.trainable_bytes if tr.opt_is_model else 0) + parts["kl_reference"]
    r_extra = set_bytes if world == 1 and not host_buffers and buf_dtype != tr.opt_dtype else 0
    step_bytes = step + resident + r_extra
    peak = max(pass_bytes, step_bytes)
    parts |= {"pass": pass_bytes, "traced_optimizer_step": step, "step": step_bytes, "buffer_set": set_bytes}
    counts = {"microbatch_rows": rows, "microbatch_width": width, "buffer_sets": sets, "passes": shape.passes,
              "prefix_cut_parts": prefix_cut_states(cfg, world)[0]}
    how = ("measured on fake CPU tensors: "
           f"{'rank 0 of an FSDP2 group of ' + str(world) if world > 1 else 'one process'}, "
           f"a {rows} x {width} micro-batch, then {'the moments, ' if adam else ''}buffers by arithmetic")
    procs = [Process("learner" if world == 1 else f"learner-{r}", d, peak, how, dict(parts), dict(counts))
             for r, d in enumerate(devices)]
    host = {}
    if host_buffers:
        host["learner_pinned_buffers"] = world * sets * set_bytes
        # HostFold's pinned copy of one fold's gradients per rank, which the pinned allocator keeps
        host["learner_fold_staging"] = world * tr.buffer_numel * _size(dtype)
        # one pinned block per template tensor, per buffer set and in the staging copy, each a power of two
        rounded = sum(sets * pinned_block_bytes(n * _size(buf_dtype)) + pinned_block_bytes(n * _size(dtype))
                      for n in tr.buffer_numels)
        host["pinned_rounding"] = world * rounded - host["learner_pinned_buffers"] - host["learner_fold_staging"]
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
    return _traced(inference, config, TORCH_DTYPES[cfg.model.dtype], 1, VLLM_PROFILE_TOKENS,
                     keep=min(cfg.rollout.max_batch, VLLM_PROFILE_TOKENS))


def vllm_lora(cfg: TrainConfig, config, tp: int) -> tuple[int, int, dict]:
    """(bytes on each device of a replica, bytes in its host memory, counts) of vLLM's LoRA. With no target_modules
    (engines/vllm.py sets none) vLLM wraps every linear layer of the decoder, whatever lora.targets names
    (vllm/lora/model_manager.py, utils.get_supported_lora_modules), and gives each `lora_a_stacked` (max_loras, 1,
    r, in) and `lora_b_stacked` (max_loras, 1, out, r) in the model's dtype (vllm/lora/layers/base_linear.py
    create_lora_weights), r = engines.vllm.lora_rank_cap(lora.rank), `in` or `out` split over tensor-parallel
    ranks as the base layer is; beside them the punica wrapper's index buffers (four of max_num_batched_tokens
    int64) and a forward's float32 shrink buffer (3 slices x tokens x r). On the host: the adapter vLLM keeps
    loaded (max_cpu_loras, default max_loras), at its own rank and targets."""
    if cfg.lora.rank == 0:
        return 0, 0, {}
    r = lora_rank_cap(cfg.lora.rank)
    b = _size(TORCH_DTYPES[cfg.model.dtype])
    with torch.device("meta"):
        model = build_from_config(config, TORCH_DTYPES[cfg.model.dtype])
    device = host = 0
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(mod, torch.nn.Linear) or mod is model.get_output_embeddings():
            continue
        n_in, n_out = mod.in_features, mod.out_features
        split_in, split_out = (n_in, -(-n_out // tp)) if leaf in VLLM_COLUMN_PARALLEL else (-(-n_in // tp), n_out)
        device += MAX_LORAS * r * (split_in + split_out) * b
        if leaf in cfg.lora.targets:
            host += MAX_LORAS * cfg.lora.rank * (n_in + n_out) * b
    buffers = 4 * VLLM_PROFILE_TOKENS * 8 + 3 * VLLM_PROFILE_TOKENS * r * 4
    return device + buffers, host, {"lora_stacked_rank": r, "max_loras": MAX_LORAS}


def vllm_process(cfg: TrainConfig, config, name: str, device: str, tp: int, capacity: int, sessions: int,
                 profile: tuple[int, int], lora: tuple[int, int, dict] = (0, 0, {})) -> Process:
    """vLLM's accounting on one device of a replica (vllm's gpu_memory_utilization): it takes fraction x capacity
    whatever the load; inside that, weights/tp, LoRA's stacked adapters, its profile forward, the CUDA allowance
    (vLLM counts the memory torch does not allocate inside the fraction) and at least one max_model_len sequence's
    key/value cache must fit (else vLLM refuses to start), and what is left is key/value cache."""
    dtype = TORCH_DTYPES[cfg.model.dtype]
    max_len = _trajectory_tokens(cfg, config)
    peak, params = profile
    weights, act = params // tp, (peak - params) // tp
    per_token = kv_bytes_per_token(config, dtype, tp)
    budget = int(cfg.rollout.vllm_memory_fraction * capacity)
    fixed = weights + lora[0] + act + CUDA_RUNTIME_BYTES
    need = fixed + per_token * max_len
    kv = max(0, budget - fixed)
    parts = {"weights": weights, "lora": lora[0], "profile_activations": act, "cuda_runtime": CUDA_RUNTIME_BYTES,
             "kv_cache": kv, "gpu_memory_utilization": budget}
    running = min(cfg.rollout.max_batch, sessions)  # turns the batcher runs at once on this replica
    counts = {"kv_bytes_per_token": per_token, "max_model_len": max_len, "kv_cache_tokens": kv // per_token,
              "full_length_sequences": kv // (per_token * max_len), "sessions": sessions, "running_turns": running,
              **lora[2]}
    how = (f"vLLM's accounting: {cfg.rollout.vllm_memory_fraction:g} of the device; KV 2 x layers x kv_heads x "
           f"head_dim x bytes per token; profile forward of {VLLM_PROFILE_TOKENS} tokens measured")
    warn = kv_shortfall(name.rsplit(".", 1)[0] if tp > 1 else name, kv // per_token, running, max_len)
    return Process(name, device, max(budget, need), how, parts, counts, warnings=[warn] if warn else [])


def kv_shortfall(replica: str, kv_tokens: int, running: int, context: int) -> str | None:
    """Why a vLLM replica whose key/value cache holds `kv_tokens` will preempt turns: `running` turns at once
    (rollout.max_batch, at most the replica's sessions) of `context` tokens each (rollout.max_trajectory_tokens: an
    agent's context grows to it over its turns) need more. vLLM then preempts running turns when the cache is full
    and prefills them again when they resume (a recompute of their whole context). None when they fit."""
    need = running * context
    if kv_tokens >= need:
        return None
    return (f"{replica}: vLLM's key/value cache holds {kv_tokens:,} tokens, fewer than {running} running turns x "
            f"{context:,} tokens (rollout.max_batch x rollout.max_trajectory_tokens = {need:,}; room for "
            f"{kv_tokens // context} at full length): vLLM will preempt turns and prefill them again; raise "
            f"rollout.vllm_memory_fraction or rollout.tensor_parallel, or lower rollout.max_batch")


def hf_engine_process(cfg: TrainConfig, config, sessions: int) -> Process:
    """The hf engine's largest call: rollout.max_batch requests (1 when batch_invariant; at most the replica's
    sessions) prefilled at full length, with their key/value cache and the last position's logits, as HFEngine's
    prefill computes them. Continuous batching holds no more: the turns joining the running batch are prefilled beside
    the others' caches (running + joining <= max_batch rows, so fewer rows' activations), and the merge concatenates
    the caches one layer at a time (a transient of one layer's keys and values, 1/num_hidden_layers of the cache).
    Named and placed by the caller."""
    rows = 1 if cfg.rollout.batch_invariant else min(cfg.rollout.max_batch, sessions)
    width = _trajectory_tokens(cfg, config)
    peak, params = _traced(inference, config, TORCH_DTYPES[cfg.model.dtype], rows, width, keep=1, cache=True,
                           lora=cfg.lora)
    return Process("", "", peak, f"measured on fake CPU tensors: a prefill of {rows} x {width}",
                   {"weights": params, "prefill": peak - params}, {"rows": rows, "width": width, "sessions": sessions})


def teacher_process(cfg: TrainConfig, config) -> Process:
    """The teacher's costliest forward (memtrace.teacher_scoring: TurnScorer's last chunk of a full-length prefix,
    the prefix's key/value cache and the chunk's logits), beside the other sessions' caches: its cap is
    teacher_cache_bytes (every open session at full length unless model.teacher_cache_gib says less), at least the
    scored prefix's. Under a cap below every session's the worker drops caches least recently used first, and
    `sessions_cached` < `sessions` says so: a dropped session's next turn re-scores its whole prefix."""
    width = _trajectory_tokens(cfg, config)
    turn = min(cfg.rollout.max_turn_tokens, width - 1)
    tr = _traced(teacher_scoring, config, TORCH_DTYPES[cfg.model.dtype], width, turn)
    per_token = kv_bytes_per_token(config, TORCH_DTYPES[cfg.model.dtype])
    full = width * per_token  # one full-length session's keys and values: the traced forward holds them
    others = max(0, teacher_cache_bytes(cfg, per_token) - full)
    sessions, held = cfg.rollout.concurrency, (full + others) // full
    caches = (f"the caches of all {sessions} open sessions at full length" if held >= sessions else
              f"caches for {held} of {sessions} full-length sessions (model.teacher_cache_gib; least recently used "
              "dropped: a dropped session's next turn re-scores its prefix)")
    return Process("teacher", device_of(cfg, "teacher"), tr.peak + others,
                   f"measured on fake CPU tensors: the teacher's scorer, the last {tr.chunk_tokens}-position chunk "
                   f"of a {width}-token prefix; {caches}",
                   {"weights": tr.param_bytes, "scoring": tr.peak - tr.param_bytes, "other_caches": others},
                   {"prefix": width, "turn": turn, "chunk_tokens": tr.chunk_tokens, "kv_bytes_per_token": per_token,
                    "sessions": sessions, "sessions_cached": min(held, sessions)},
                   warnings=[] if held >= sessions else [
                       f"teacher: its key/value caches hold {held} of {sessions} full-length sessions "
                       "(model.teacher_cache_gib): with turns interleaved, a turn whose cache was dropped re-scores "
                       "its whole prefix, about (K + 1)/2 x the tokens of a K-turn trajectory; tsrl predict shows "
                       "the teacher's busy time per round"])


# ---------------------------------------------------------------------------- the plan


def _capacity(device: str, capacity_gib: float | None, host: tuple[float, str] | None,
              gpus: dict[int, int] | None = None) -> tuple[int, str]:
    """(bytes, where that figure comes from) of a device: --capacity-gib, or `host` (GiB, its source: --host-gib
    or devices.host_memory_gib), else this machine's GPU (`gpus`: index -> bytes, default what torch sees) or
    memory, else an 80 GB device for a GPU this machine lacks."""
    if device == "cpu":
        if host is not None:
            return int(host[0] * GiB), host[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    if capacity_gib is not None:
        return int(capacity_gib * GiB), "--capacity-gib"
    index = int(device.split(":")[1]) if device.startswith("cuda:") else -1
    if gpus is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpus = {i: torch.cuda.get_device_properties(i).total_memory for i in range(n)}
    if index in gpus:
        return gpus[index], "this machine's GPU"
    return DEFAULT_DEVICE_BYTES, "an 80 GB device assumed (no such GPU here; --capacity-gib)"


def plan_experiment(cfg: TrainConfig, capacity_gib: float | None = None, host_gib: float | None = None,
                    gpus: dict[int, int] | None = None, host_source: str = "--host-gib") -> dict:
    """The memory plan: {"processes": [Process as a dict, ...], "fits": every process fits}. Capacities: `capacity_gib`
    for every CUDA device; `host_gib` for the host (named `host_source`), else cfg.devices.host_memory_gib; else
    this machine's (`gpus`: index -> bytes, as tsrl doctor knows them; default what torch sees)."""
    for flag, gib in (("--capacity-gib", capacity_gib), ("--host-gib", host_gib)):
        if gib is not None and not (math.isfinite(gib) and gib > 0):  # NaN and infinity are no capacity either
            raise UsageError(f"{flag} {gib:g}: must be a finite number of GiB > 0 (e.g. {flag} 80)")
    if cfg.loss.max_open_groups is not None and cfg.loss.max_open_groups < 0:  # else a negative count of buffer sets
        raise UsageError(f"loss.max_open_groups {cfg.loss.max_open_groups}: must be >= 0 (or unset: no cap)")
    host_cap = (host_gib, host_source) if host_gib is not None else \
        (cfg.devices.host_memory_gib, "devices.host_memory_gib") if cfg.devices.host_memory_gib is not None else None
    policy = _config(cfg, "policy")
    procs, host = learner_processes(cfg, policy)
    if cfg.rollout.engine != "openai":  # remote servers hold their own memory (plan them where they run)
        replicas = rollout_replicas(cfg)
        sessions = -(-cfg.rollout.concurrency // len(replicas))
        vllm = cfg.rollout.engine == "vllm"
        traced = vllm_profile(cfg, policy) if vllm else hf_engine_process(cfg, policy, sessions)
        lora = vllm_lora(cfg, policy, len(replicas[0])) if vllm else (0, 0, {})
        if lora[1]:
            host["engine_cpu_loras"] = len(replicas) * lora[1]
        for i, devs in enumerate(replicas):
            base = "rollout" if len(replicas) == 1 else f"engine-{i}"  # one device: the rollout process's own engine
            for j, d in enumerate(devs):
                name = base if len(devs) == 1 else f"{base}.{j}"
                if vllm:
                    procs.append(vllm_process(cfg, policy, name, d, len(devs),
                                              _capacity(d, capacity_gib, host_cap, gpus)[0], sessions, traced, lora))
                else:
                    procs.append(Process(name, d, traced.peak_bytes, traced.how, dict(traced.parts),
                                         dict(traced.counts)))
    if cfg.objective == "opd":
        procs.append(teacher_process(cfg, _config(cfg, "teacher")))
    for p in procs:  # vLLM's own accounting has its allowance inside the fraction
        if p.device != "cpu" and "gpu_memory_utilization" not in p.parts:
            p.parts["cuda_runtime"] = CUDA_RUNTIME_BYTES
            p.peak_bytes += CUDA_RUNTIME_BYTES
    if host:
        pinned = {k: v for k, v in host.items() if k in PINNED_PARTS}
        counts = {"pinned_requested_bytes": sum(pinned.values()) - pinned["pinned_rounding"],
                  "pinned_bytes": sum(pinned.values())} if pinned else {}
        procs.append(Process("host", "cpu", sum(host.values()), "arithmetic: host-memory buffers and copies", host,
                             counts))
    for p in procs:
        p.capacity_bytes, p.capacity = _capacity(p.device, capacity_gib, host_cap, gpus)
        p.device_bytes = sum(q.peak_bytes for q in procs if q.device == p.device)
        p.fits = p.device_bytes <= p.capacity_bytes
    return {"processes": [asdict(p) for p in procs], "fits": all(p.fits for p in procs)}
