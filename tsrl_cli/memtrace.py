"""Peak memory of a model's passes, measured by PyTorch's memory tracker on fake (or real) tensors.

    learner_pass(config, shape)               one forward and backward of a micro-batch, as the learner runs it
    optimizer_step(shapes, dtype, foreach)    AdamW's step over tensors of those shapes (its moments appear here)
    inference(config, dtype, rows, width)     a no-grad forward: an engine's prefill
    teacher_scoring(config, dtype, width, turn)   the OPD teacher's costliest turn, through its own TurnScorer

Fake tensors (torch._subclasses.fake_tensor.FakeTensorMode) carry shapes, dtypes and devices and no memory:
the model of a config.json is built (policy.build_from_config) with no weights and no GPU. The tracker
(torch.distributed._tools.mem_tracker.MemTracker; FSDPMemTracker for a sharded group) records every storage an
op creates until it is freed, and keeps the peak. The same functions run on real tensors (fake=False), which
is how the fake figure is checked (tests/test_plan.py).

The trace runs on fake *CPU* tensors: torch's CPU build aborts in autograd over fake CUDA tensors. Every op
allocates the same tensors on either device except the kernels' own workspaces; attention is
scaled_dot_product_attention's flash kernel for the CPU here (its output and per-row log-sum-exp, no T x T
matrix), as the CUDA flash kernels keep. The CUDA caching allocator's 512-byte rounding, its fragmentation, the
CUDA context and NCCL's buffers are not in the figure (docs/distributed.md, "The memory plan").

A group of N ranks is traced as its rank 0: a fake process group (torch.testing._internal.distributed.fake_pg,
whose collectives return without communicating; torchtitan's memory estimation uses the same) and the model
sharded by LearnerGroup.shard with the folding all-to-all, exactly as training shards it. On real tensors the
model is built and sharded on the meta device, then only rank 0's shards are allocated (Module.to_empty) and
drawn (materialize): a real allocation of one rank of N, on the CPU here, on a GPU in experiments/fsdp_rank.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tsrl_cli.config import LoRAConfig
from tsrl_cli.policy import build_from_config, checkpoint_activations, forward_logprobs
from tsrl_cli.rl.group import LearnerGroup, ShardedGrads
from tsrl_cli.rl.learner import LocalGrads
from tsrl_cli.rl.masters import upcast_for_group
from tsrl_cli.rl.teacher_worker import TurnScorer

# Rows of full length, as the plan assumes (the largest micro-batch): transformers then passes no mask to
# scaled_dot_product_attention (is_causal). It decides so from the mask's values, which fake tensors do not have, so
# it would build a (rows, 1, T, T) mask under FakeTensorMode; this attention is transformers' own sdpa with the
# mask it builds for unpadded rows (none), on fake and real tensors alike.
UNPADDED_SDPA = "tsrl_unpadded_sdpa"
AttentionInterface.register(UNPADDED_SDPA, sdpa_attention_forward)
AttentionMaskInterface.register(UNPADDED_SDPA, lambda *args, **kwargs: None)


class _FrozenAware:
    """MemTracker registers a gradient hook on every parameter of each module it enters, which a frozen parameter
    (a LoRA base weight) refuses; modules holding one get no hooks, so their adapters' gradients count as Temp, not
    Gradient (the same bytes, the same peak)."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        hooks = install_grad_hooks and all(p.requires_grad for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks=hooks)


class _Tracker(_FrozenAware, MemTracker):
    pass


class _GroupTracker(_FrozenAware, FSDPMemTracker):
    pass


class _CallsTracker(_Tracker):
    """MemTracker refuses a second top-level call of one module (it keeps statistics per module and call); the
    teacher calls its model once per chunk, so the root's statistics are dropped before each call. The peak is
    the tracker's own over every storage, which this leaves alone."""

    def __init__(self, root):
        super().__init__()
        self._root = root

    def _pre_fw_hook(self, module, inputs):
        if module is self._root:
            self.reset_mod_stats()
        return super()._pre_fw_hook(module, inputs)


def _fake_params(model) -> None:
    """Every parameter and buffer of a model built on the meta device replaced by a fake CPU tensor of its shape and
    dtype (a tied parameter stays one parameter). Fake parameters cannot be cast or moved in place (Module._apply
    swaps them, which fake tensors refuse), so the model (and PEFT's adapters) are built on meta, then made fake."""
    new: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in new:
                    fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    new[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else fake
                table[name] = new[id(t)]


@dataclass(frozen=True)
class LearnerShape:
    """One learner rank's micro-batch and settings: what learner_pass runs."""

    rows: int  # padded rows of the micro-batch
    width: int  # its longest row (positions)
    dtype: torch.dtype  # model.dtype
    world: int = 1  # learner ranks (more than one: a sharded group)
    lora: LoRAConfig | None = None
    checkpointing: bool = False  # learner.activation_checkpointing
    chunk_tokens: int | None = None  # learner.logits_chunk_tokens
    entropy: bool = False  # an entropy term: the head computes entropies too
    passes: int = 1  # backwards of one forward (2: an open group's members with a KL or entropy term)
    master_dtype: torch.dtype | None = None  # optim.master_dtype resolved (rl/masters.py); None: no masters
    buffer_dtype: torch.dtype | None = None  # the fold's cast of each gradient on the device; None: no cast there


@dataclass
class LearnerTrace:
    """What one rank holds, in bytes (numel: elements), as measured by learner_pass."""

    pass_peak: int  # the pass's peak: this rank's parameters, activations, gradients, FSDP's buffers
    parts: dict = field(default_factory=dict)  # the tracker's categories at that peak
    param_bytes: int = 0  # the model's parameters resident on this rank
    param_numel: int = 0
    trainable_bytes: int = 0  # of which trained
    buffer_numel: int = 0  # elements of one streaming-buffer set on this rank (the accumulator's templates)
    buffer_numels: list = field(default_factory=list)  # of each template: one tensor (pinned block) per set each
    opt_shapes: list = field(default_factory=list)  # the tensors the optimizer steps on this rank
    opt_dtype: torch.dtype = torch.float32
    opt_is_model: bool = True  # the optimizer steps the model's own parameters (no separate masters)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _peak(tracker) -> tuple[int, dict]:
    """(peak bytes over every device, the categories at that peak)."""
    snap = tracker.get_tracker_snapshot("peak")
    parts: dict[str, int] = {}
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            name = getattr(k, "value", str(k))
            parts[name] = parts.get(name, 0) + int(v)
    total = parts.pop("Total", 0)
    return total, {k: v for k, v in parts.items() if v}


@contextlib.contextmanager
def _process_group(world: int, device: str = "cpu"):
    """Rank 0 of a fake process group of `world` ranks and its mesh on `device`'s type (None for one rank); a mesh
    cannot be made under FakeTensorMode."""
    if world == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("tracing a learner group needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh(torch.device(device).type, (world,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _traced_model(config, dtype: torch.dtype, lora, fake: bool, device: str = "cpu", on_meta: bool = False):
    """The model of `config` (seeded), on fake CPU tensors inside FakeTensorMode, or real ones on `device`, with
    the attention of unpadded rows. on_meta (real tensors of a group): left on the meta device, to be sharded
    there and then given rank 0's storage (materialize)."""
    with torch.random.fork_rng(devices=[]):
        if not fake and not on_meta:
            with torch.device(device):
                model = build_from_config(config, dtype, lora=lora)
            model.set_attn_implementation(UNPADDED_SDPA)
            yield model
            return
        with torch.device("meta"):
            model = build_from_config(config, dtype, lora=lora)
        model.set_attn_implementation(UNPADDED_SDPA)
        if not fake:
            yield model
            return
        with FakeTensorMode():
            _fake_params(model)
            yield model


def materialize(model, device: str, seed: int = 0) -> None:
    """A model built (and sharded) on the meta device given storage on `device`: Module.to_empty, which FSDP2
    follows with each parameter's shard of this rank alone, then values: N(0, 0.02) for each matrix's local shard,
    1 for vectors (the norms' weights), and the buffers (the rotary frequencies) computed by transformers' own
    init of the modules that hold them. The memory is the real thing; the values only keep the passes finite."""
    model.to_empty(device=device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's wrapper
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in model.parameters():
            t = _local(p)
            if t.dim() > 1:
                t.normal_(0.0, 0.02)
            else:
                t.fill_(1.0)
        for mod in base.modules():
            if next(mod.buffers(recurse=False), None) is not None:
                base._init_weights(mod)


@contextlib.contextmanager
def learner_rank(config, s: LearnerShape, fake: bool = True, device: str = "cpu"):
    """(model, grads, templates) of one learner rank, as training sets it up: checkpointed layers when asked; on
    a group (s.world > 1) rank 0 of a fake process group, float32 masters (s.master_dtype) sharded by
    LearnerGroup.shard with the folding all-to-all (ShardedGrads); else LocalGrads over the trained parameters.
    templates: the streaming buffers' shapes (one tensor per FSDP unit on a group)."""
    real_group = s.world > 1 and not fake
    with _process_group(s.world, device) as mesh, \
            _traced_model(config, s.dtype, s.lora, fake, device, on_meta=real_group) as model:
        if s.checkpointing:
            checkpoint_activations(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if s.world == 1:
            yield model, LocalGrads(trainable), trainable
            return
        group = LearnerGroup(0, s.world, "cpu" if fake else device)
        grads = ShardedGrads(group, model)
        compute = upcast_for_group(trainable, s.master_dtype) if s.master_dtype is not None else None
        group.shard(model, grads, compute_dtype=compute, mesh=mesh)
        if real_group:
            materialize(model, device)
        yield model, grads, grads.templates


def learner_pass(config, s: LearnerShape, fake: bool = True, device: str = "cpu") -> LearnerTrace:
    """One forward and backward of an (s.rows, s.width) micro-batch under the tracker, as StreamLearner runs it:
    policy.forward_logprobs with the chunked head and checkpointed layers when asked, one backward per pass
    through the learner's own gradient backends (LocalGrads: autograd.grad; ShardedGrads on a group: FSDP2 with
    the folding all-to-all), each gradient cast as the accumulator's fold casts it (the buffers themselves are
    counted by the caller: they outlive the pass)."""
    with learner_rank(config, s, fake, device) as (model, grads, templates):
        tracker = _GroupTracker(model) if s.world > 1 else _Tracker()
        tracker.track_external(model)
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (s.rows, s.width), device=device if not fake else "cpu")

        def fold(_target, gs) -> None:  # core.accumulator.axpy: each gradient cast to the buffer dtype, one at a time
            if s.buffer_dtype is not None:
                for g in gs:
                    if g is not None:
                        g.to(s.buffer_dtype)

        with tracker:
            logp, ent = forward_logprobs(model, ids, entropy=s.entropy, chunk_tokens=s.chunk_tokens)
            main = logp.sum() if ent is None else logp.sum() + ent.sum()
            losses = [main, logp.mean()][: s.passes]
            grads.backward(losses, [[("round", 1.0)] + [None] * (s.world - 1)] * s.passes, fold)
        peak, parts = _peak(tracker)
        local = [_local(p) for p in model.parameters()]
        mine = [_local(p) for p in model.parameters() if p.requires_grad]
        opt_is_model = s.world > 1 or s.master_dtype is None
        opt_dtype = mine[0].dtype if opt_is_model or not mine else s.master_dtype
        return LearnerTrace(
            pass_peak=peak, parts=parts,
            param_bytes=sum(t.numel() * t.element_size() for t in local), param_numel=sum(t.numel() for t in local),
            trainable_bytes=sum(t.numel() * t.element_size() for t in mine),
            buffer_numel=sum(t.numel() for t in templates), buffer_numels=[t.numel() for t in templates],
            opt_shapes=[tuple(t.shape) for t in mine], opt_dtype=opt_dtype, opt_is_model=opt_is_model)


def optimizer_step(shapes: list, dtype: torch.dtype, foreach: bool, fake: bool = True, device: str = "cpu") -> int:
    """Peak bytes of AdamW's first step over parameters of `shapes` in `dtype` with their gradients: the
    parameters, the gradients, the two moments it creates and the step's temporaries (foreach, as on CUDA,
    keeps a whole set of them)."""
    with torch.random.fork_rng(devices=[]), (FakeTensorMode() if fake else contextlib.nullcontext()):
        ps = [torch.nn.Parameter(torch.zeros(sh, dtype=dtype, device=device if not fake else "cpu")) for sh in shapes]
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-6, foreach=foreach)
        tracker = MemTracker()
        tracker.track_external(*ps, *[p.grad for p in ps])
        with tracker:
            opt.step()
        return _peak(tracker)[0]


def inference(config, dtype: torch.dtype, rows: int, width: int, *, keep: int = 0, cache: bool = False,
              lora: LoRAConfig | None = None, fake: bool = True) -> tuple[int, int]:
    """(peak bytes, parameter bytes) of a no-grad forward over (rows, width) tokens: logits at the last `keep`
    positions (0: every position, as a prefill without logits_to_keep) and the key/value cache when `cache`."""
    with _traced_model(config, dtype, lora, fake) as model:
        tracker = _Tracker()
        tracker.track_external(model)
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (rows, width))
        with torch.no_grad(), tracker:
            model(input_ids=ids, use_cache=cache, logits_to_keep=keep)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return _peak(tracker)[0], params


@dataclass
class TeacherTrace:
    """The OPD teacher's costliest turn, in bytes, as measured by teacher_scoring."""

    peak: int  # the weights, the scored trajectory's key/value cache and one chunk's transients
    param_bytes: int
    others_bytes: int  # other trajectories' caches TurnScorer may keep beside a full-length one (its byte cap's rest)
    chunk_tokens: int


def _cache_tensors(cache) -> list[torch.Tensor]:
    """The tensors of a transformers Cache (each layer's keys and values)."""
    return [v for layer in getattr(cache, "layers", []) for v in vars(layer).values() if isinstance(v, torch.Tensor)]


def teacher_scoring(config, dtype: torch.dtype, width: int, turn: int, *, chunk_tokens: int | None = None,
                    fake: bool = True, device: str = "cpu", before_trace=None) -> TeacherTrace:
    """The OPD teacher's costliest forward, through rl/teacher_worker.TurnScorer: the last chunk of a `turn`-token
    turn ending a `width`-token prefix, with every earlier position's keys and values cached (the chunk's
    forward, the cache growing to `width` tokens, the chunk's logits and their log-softmax). Scoring from
    scratch or from a trajectory's cache runs the same last chunk; the earlier chunks hold less. The cached
    prefix is built first, outside the tracker, and counted as memory the tracker found alive; `before_trace` is
    called between the two (experiments/plan_vs_cuda.py resets CUDA's peak there)."""
    with _traced_model(config, dtype, None, fake, device) as model:
        scorer = TurnScorer(model, max_tokens=width, **({"chunk_tokens": chunk_tokens} if chunk_tokens else {}))
        chunk, key, ids = scorer.chunk_tokens, "costliest", [0] * width
        cached = width - min(chunk, width - 1)  # positions before the last chunk
        tracker = _CallsTracker(model)
        tracker.track_external(model)
        if cached >= 2:
            scorer.chunk_tokens = cached  # the prefix in one forward, keeping its last position's logits
            scorer.score_tensor(key, ids, cached - 1, cached)
            scorer.chunk_tokens = chunk
            st = scorer.open[key]
            tracker.track_external(*_cache_tensors(st.past), st.last_logits)
        if before_trace is not None:
            before_trace()
        with tracker:
            scorer.score_tensor(key, ids, width - min(turn, chunk) if cached >= 2 else width - turn, width)
        return TeacherTrace(peak=_peak(tracker)[0],
                            param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                            others_bytes=max(0, scorer.max_bytes - width * scorer.bytes_per_token),
                            chunk_tokens=chunk)
