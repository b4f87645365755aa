"""`tsrl verify`: compute one round's gradient lazily and by streaming, and compare.

The lazy gradient is one backward of verl's loss over the whole round; the streamed one is
built trajectory by trajectory (GRPO) or turn by turn (OPD) in the chosen arrival order and
joined with one scalar at close. Exit 0 when they agree within the dtype's tolerance.

`--set learner.KEY=VALUE` takes tsrl train's learner.* keys: the streamed side then runs as training's learner
does (activation checkpointing, the chunked head, the micro-batch caps); the lazy side stays the plain reference
(one padded batch, every layer's activations kept, the full-vocabulary log-softmax), so the settings are checked
against the computation they replace.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import queue
import random
import shutil
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load, save, save_file

from tsrl_cli.config import DTYPES, LearnerConfig, LossConfig, load_config, parse_set
from tsrl_cli.core.graddiff import TOLERANCE, compare, tolerance  # noqa: F401 (TOLERANCE: importable from here)
from tsrl_cli.devices import check_available, parse_devices
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.files import atomic_path
from tsrl_cli.policy import (
    BUILTIN_TINY,
    BUILTIN_TINY_TEACHER,
    TORCH_DTYPES,
    checkpoint_activations,
    load_policy,
    score_tokens,
)
from tsrl_cli.processes import init_worker
from tsrl_cli.rl.group import LearnerGroup, ShardedGrads
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss, packs
from tsrl_cli.rollouts import Rollout, read_rollouts

ORDERS = ("random", "given", "reverse")


@dataclass
class VerifyOptions:
    model: str = BUILTIN_TINY
    rollouts: str | None = None
    objective: str = "grpo"
    teacher: str | None = None
    loss: LossConfig = field(default_factory=LossConfig)  # the same settings as tsrl train's loss.*
    dtype: str = "float64"
    order: str = "random"
    seed: int = 0
    groups: int = 4
    group_size: int = 8
    queued: int = 1  # arrivals queued before the learner runs: 1 = per arrival, K > 1 = micro-batches
    learners: str = "cpu"  # the streaming learner's devices: more than one (cpu:N, 0-3) is a sharded group
    max_microbatch_tokens: int | None = None  # --max-microbatch-tokens; None: learner.max_microbatch_tokens
    save_grads: str | None = None
    learner: LearnerConfig = field(default_factory=LearnerConfig)  # tsrl train's learner.* (--set learner.KEY=V)


def learner_settings(sets: list[str] | tuple[str, ...]) -> LearnerConfig:
    """`--set learner.KEY=VALUE` items as tsrl train reads them (types and values checked by config.py); any
    other section is refused: the loss has its own flags, and nothing else enters a round's gradient."""
    for item in sets:
        section = next(iter(parse_set(item)))
        if section != "learner":
            raise UsageError(f"--set {item!r}: tsrl verify takes learner.* keys only (loss settings are its own "
                             "flags; optim.* and the rest act after the gradient it compares)")
    lc = load_config(None, list(sets)).learner
    if lc.microbatch != "auto":
        raise UsageError("--set learner.microbatch: tsrl verify micro-batches what --queued arrivals leave queued; "
                         "use --queued K instead")
    return lc


def random_rollouts(vocab_size: int, groups: int, group_size: int, seed: int,
                    shared_prompt: bool = False) -> list[Rollout]:
    """Multi-turn rollouts with random tokens and rewards chosen to stress the math.
    shared_prompt: a group's members start with one prompt, as sampled groups do (the learner's shared-prompt cut,
    rl/prefix.py, then applies).

    Group kinds cycle through: binary 0/1 rewards, continuous rewards, a zero-variance group (all
    rewards equal), and rewards far from zero (100 + 0.01 * noise). Each trajectory is a prompt,
    then 1-3 model turns, each followed by a tool observation (loss_mask 0) except the last.
    """
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        kind = g % 4
        head = [rng.randrange(vocab_size) for _ in range(rng.randint(4, 10))]
        for i in range(group_size):
            ids = list(head) if shared_prompt else [rng.randrange(vocab_size) for _ in range(rng.randint(4, 10))]
            mask = [0] * len(ids)
            spans = []
            n_turns = rng.randint(1, 3)
            for t in range(n_turns):
                s = len(ids)
                n = rng.randint(2, 9)
                ids += [rng.randrange(vocab_size) for _ in range(n)]
                mask += [1] * n
                spans.append((s, len(ids)))
                if t < n_turns - 1:
                    obs = rng.randint(2, 6)
                    ids += [rng.randrange(vocab_size) for _ in range(obs)]
                    mask += [0] * obs
            reward = [float(rng.random() < 0.5), rng.gauss(0.0, 1.0), 0.5, 100.0 + 0.01 * rng.gauss(0, 1)][kind]
            out.append(Rollout(f"g{g}", i, ids, mask, reward, spans))
    return out


def _perturbed(model, seed: int, scale: float = 0.05):
    """A reference model: the policy with seeded weight noise, so that KL and its gradient are not 0."""
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * scale)
    return ref


def arrival_order(items: list, order: str, seed: int) -> list:
    if order == "given":
        return list(items)
    if order == "reverse":
        return list(reversed(items))
    if order == "random":
        items = list(items)
        random.Random(seed + 1).shuffle(items)
        return items
    raise UsageError(f"--order {order!r} is unknown; use one of {', '.join(ORDERS)}")


def save_safetensors(path: Path, names: list[str], grads: list[torch.Tensor]) -> None:
    with atomic_path(path) as tmp:
        save_file({n: g.detach().contiguous().cpu() for n, g in zip(names, grads, strict=False)}, str(tmp))


@dataclass
class GradPair:
    names: list[str]
    lazy: list[torch.Tensor]
    stream: list[torch.Tensor]
    learner: StreamLearner
    lazy_loss: torch.Tensor
    num_items: int
    time_lazy_s: float
    time_stream_s: float


def lazy_and_stream(model, rollouts: list[Rollout], obj: Objective, order: str = "random", seed: int = 0,
                    queued: int = 1, max_tokens: int | None = None, learner: LearnerConfig | None = None) -> GradPair:
    """The round's gradient twice: lazily (one loss, one backward) and streamed in `order`.

    queued: the learner runs after every `queued` arrivals (1: each arrival alone; more: what is
    queued then is micro-batched, up to max_tokens padded positions per backward).
    learner: the streamed side's learner.* settings (max_microbatch_items, logits_chunk_tokens, and
    activation_checkpointing, which is put on `model` after the lazy backward and stays on: values are unchanged).
    The lazy side is always the plain computation."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = lazy_loss(model, rollouts, obj)
    loss.backward()
    t_lazy = time.perf_counter() - t0
    lazy = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for _, p in params]
    model.zero_grad(set_to_none=True)

    items = arrivals(rollouts, obj, order, seed)
    lc = learner or LearnerConfig()
    if lc.activation_checkpointing:
        checkpoint_activations(model)
    sl = StreamLearner(model, obj, Counter(r.group_id for r in rollouts), max_tokens=max_tokens,
                       max_items=lc.max_microbatch_items, chunk_tokens=lc.logits_chunk_tokens, opd_unit=lc.opd_unit,
                       granularity=lc.granularity, prefix_cut=lc.prefix_cut,
                       packed=packs(lc.packing, str(next(model.parameters()).device), model))
    t0 = time.perf_counter()
    stream = feed(sl, items, queued)
    t_stream = time.perf_counter() - t0
    return GradPair([n for n, _ in params], lazy, stream, sl, loss.detach(), len(items), t_lazy, t_stream)


def arrivals(rollouts: list[Rollout], obj: Objective, order: str, seed: int) -> list[tuple[Rollout, int | None]]:
    """The round's learner inputs in arrival order: trajectories (GRPO) or (trajectory, turn) pairs (OPD)."""
    if obj.kind == "grpo":
        items = [(r, None) for r in rollouts]
    else:
        items = [(r, k) for r in rollouts for k in range(len(r.turn_spans))]
    return arrival_order(items, order, seed)


def feed(learner: StreamLearner, items: list[tuple[Rollout, int | None]], queued: int) -> list[torch.Tensor]:
    """Arrivals into the learner, which runs after every `queued` of them; the round's gradient."""
    for n, (r, k) in enumerate(items, 1):
        if k is None:
            learner.on_trajectory(r)
        else:
            learner.on_turn(r, k)
        if n % queued == 0:
            learner.drain()
    learner.drain()
    return learner.close_round()


def sharded_stream(opts: VerifyOptions, rollouts: list[Rollout], obj: Objective, devices: tuple[str, ...]) -> dict:
    """The streamed gradient on a learner group of len(devices) ranks (rl/group.py), each rank a process:
    {"grads": {name: full gradient}, "ranks": per-rank learner figures}."""
    ctx = mp.get_context("spawn")
    store = tempfile.mkdtemp(prefix="tsrl-verify-")
    q = ctx.Queue()
    items = arrivals(rollouts, obj, opts.order, opts.seed)
    procs = [ctx.Process(target=_verify_rank, daemon=True,
                         args=(rank, devices, str(Path(store) / "store"), opts, items, obj, q))
             for rank in range(len(devices))]
    try:
        for p in procs:
            p.start()
        while True:
            try:
                kind, *payload = q.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise OperationFailed(f"learner rank {dead[0]} exited with code "
                                          f"{procs[dead[0]].exitcode}") from None
        if kind == "error":
            rank, tb = payload
            raise OperationFailed(f"learner rank {rank} failed: {tb.strip().splitlines()[-1]}\n{tb}")
        blob, ranks = payload
        return {"grads": load(blob), "ranks": ranks}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        shutil.rmtree(store, ignore_errors=True)


def _verify_rank(rank: int, devices: tuple[str, ...], store: str, opts: VerifyOptions, items, obj: Objective,
                 q) -> None:
    """One rank of `sharded_stream`: shard the policy, stream the arrivals, hand back the full gradient."""
    try:
        init_worker()
        group = LearnerGroup.join(rank, len(devices), devices[rank], store)
        model, _ = load_policy(opts.model, dtype=TORCH_DTYPES[opts.dtype], seed=opts.seed, tokenizer=False)
        lc = opts.learner
        if lc.activation_checkpointing:
            checkpoint_activations(model)  # before sharding: inside each FSDP unit's hooks, as training does
        grads = ShardedGrads(group, model)
        group.shard(model, grads)
        sl = StreamLearner(model, obj, Counter(r.group_id for r, k in items if k in (None, 0)), grads=grads,
                           rank=rank, world=len(devices), max_tokens=lc.max_microbatch_tokens,
                           max_items=lc.max_microbatch_items, chunk_tokens=lc.logits_chunk_tokens,
                           opd_unit=lc.opd_unit, granularity=lc.granularity,
                           packed=packs(lc.packing, devices[rank], model))
        grads.emit(feed(sl, items, opts.queued), sl.zero_loss)
        full = {n: p.grad.full_tensor().detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
        mine = {"backwards": sl.backwards, "microbatches": len(sl.batches), "buffer_bytes_per_set": sl.acc.param_bytes,
                "peak_open_buffer_bytes": sl.acc.peak_open_bytes, "num_tokens": sl.num_tokens}
        ranks = group.gather(mine)
        if group.leader:  # bytes, not tensors: a tensor through a queue is shared memory this process takes along
            q.put(("ok", save(full), ranks))
        group.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        q.put(("error", rank, traceback.format_exc()))


def run_verify(opts: VerifyOptions, progress=lambda msg: None) -> dict:
    if opts.dtype not in DTYPES:
        raise UsageError(f"--dtype {opts.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    if opts.order not in ORDERS:
        raise UsageError(f"--order {opts.order!r} is unknown; use one of {', '.join(ORDERS)}")
    if opts.queued < 1 or (opts.max_microbatch_tokens is not None and opts.max_microbatch_tokens < 1):
        raise UsageError("--queued and --max-microbatch-tokens must be >= 1")
    if opts.max_microbatch_tokens is not None:  # the flag over learner.max_microbatch_tokens, as flags over --set
        opts = replace(opts, learner=replace(opts.learner, max_microbatch_tokens=opts.max_microbatch_tokens))
    lc = opts.learner
    devices = parse_devices(opts.learners, "--learner-devices")
    for d in devices:
        check_available(d, "--learner-devices")
    obj = Objective(opts.objective, opts.loss)
    dtype = TORCH_DTYPES[opts.dtype]
    torch.manual_seed(opts.seed)
    progress(f"loading model {opts.model} ({opts.dtype})")
    model, _ = load_policy(opts.model, dtype=dtype, seed=opts.seed, tokenizer=False)
    vocab = model.get_input_embeddings().weight.shape[0]

    if opts.rollouts:
        rollouts = read_rollouts(opts.rollouts)
        for r in rollouts:
            if max(r.input_ids) >= vocab:
                raise UsageError(f"{opts.rollouts}: rollout {r.key} has token id {max(r.input_ids)} >= the model's "
                                 f"vocabulary ({vocab})")
        source = opts.rollouts
    else:
        if opts.groups < 1 or opts.group_size < 1:
            raise UsageError("--groups and --group-size must be >= 1")
        rollouts = random_rollouts(vocab, opts.groups, opts.group_size, opts.seed, shared_prompt=True)
        source = f"random (seed {opts.seed}, {opts.groups} groups x {opts.group_size}, a prompt per group)"

    if obj.kind == "opd" and (opts.teacher or any(r.teacher_logprobs is None for r in rollouts)):
        spec = opts.teacher or BUILTIN_TINY_TEACHER
        progress(f"scoring {len(rollouts)} rollouts with teacher {spec}")
        teacher, _ = load_policy(spec, dtype=dtype, seed=opts.seed, tokenizer=False)
        if teacher.get_input_embeddings().weight.shape[0] < vocab:
            raise UsageError(f"--teacher {spec}: vocabulary smaller than the student's ({vocab}); "
                             "OPD needs one tokenizer")
        for r in rollouts:  # the whole sequence at once: by causality, what per-turn scoring gives
            r.teacher_logprobs = score_tokens(teacher, r.input_ids)
        del teacher
    if obj.loss.kl_coef and any(r.ref_logprobs is None for r in rollouts):
        progress("reference log-probs from the policy with seeded weight noise (no ref_logprobs in the input)")
        ref = _perturbed(model, opts.seed)
        for r in rollouts:
            r.ref_logprobs = score_tokens(ref, r.input_ids)

    progress("lazy: one loss over the whole round, one backward; then stream in " + opts.order + " order")
    g = lazy_and_stream(model, rollouts, obj, opts.order, opts.seed, opts.queued, lc.max_microbatch_tokens, lc)
    names, lazy, stream, learner = g.names, g.lazy, g.stream, g.learner
    loss, t_lazy, t_stream, items = g.lazy_loss, g.time_lazy_s, g.time_stream_s, g.num_items
    ranks = None
    if len(devices) > 1:  # the same arrivals streamed on a sharded learner group
        progress(f"stream again on a learner group of {len(devices)} ranks ({opts.learners})")
        t0 = time.perf_counter()
        sharded = sharded_stream(opts, rollouts, obj, devices)
        t_stream = time.perf_counter() - t0
        stream, ranks = [sharded["grads"][n] for n in names], sharded["ranks"]

    cmp = compare(names, lazy, stream)
    tol = tolerance(dtype, bf16_buffers=obj.loss.buffer_dtype == "bfloat16")
    result = {
        "ok": cmp["max_rel_diff"] <= tol,
        "tolerance": tol,
        **cmp,
        "objective": obj.kind,
        "loss_agg": obj.loss.loss_agg,
        "adv_norm": obj.loss.adv_norm if obj.kind == "grpo" else None,
        "opd_form": obj.loss.opd_form if obj.kind == "opd" else None,
        "kl_coef": obj.loss.kl_coef,
        "kl_type": obj.loss.kl_type if obj.loss.kl_coef else None,
        "entropy_coef": obj.loss.entropy_coef,
        "dtype": opts.dtype,
        "order": opts.order,
        "seed": opts.seed,
        "model": opts.model,
        "rollouts": source,
        "num_trajectories": len(rollouts),
        "num_groups": len({r.group_id for r in rollouts}),
        "num_items": items,
        "num_loss_tokens": learner.num_tokens,
        "stream_backwards": learner.backwards,
        "microbatches": len(learner.batches),
        # positions of the groups' prompt parts forwarded once each (learner.prefix_cut; 0: rows whole)
        "prefix_cut_positions": learner.cut.positions if learner.cut is not None and ranks is None else 0,
        "queued": opts.queued,
        "buffer_dtype": obj.loss.buffer_dtype,
        "buffer_device": obj.loss.buffer_device,
        "lazy_loss": float(loss.detach()),
        "params": sum(p.numel() for p in learner.params),
        "buffer_bytes_per_set": learner.acc.param_bytes,
        "peak_open_buffer_bytes": learner.acc.peak_open_bytes,
        "max_open_groups": obj.loss.max_open_groups,
        "time_lazy_s": round(t_lazy, 4),
        "time_stream_s": round(t_stream, 4),
        "learner_ranks": len(devices),
        "activation_checkpointing": lc.activation_checkpointing,  # the streamed side's learner.* settings
        "logits_chunk_tokens": lc.logits_chunk_tokens,
        "max_microbatch_tokens": lc.max_microbatch_tokens,
        "max_microbatch_items": lc.max_microbatch_items,
        "opd_unit": lc.opd_unit if obj.kind == "opd" else None,
        "granularity": lc.granularity,
        "adv_std": obj.loss.adv_std if obj.kind == "grpo" else None,
    }
    if ranks is not None:  # the sharded group's own figures (the single-process ones above are the reference's)
        result.update(stream_backwards=ranks[0]["backwards"], microbatches=ranks[0]["microbatches"],
                      buffer_bytes_per_set_rank=[r["buffer_bytes_per_set"] for r in ranks],
                      peak_open_buffer_bytes_rank=[r["peak_open_buffer_bytes"] for r in ranks])
    if opts.save_grads:
        out = Path(opts.save_grads)
        out.mkdir(parents=True, exist_ok=True)
        save_safetensors(out / "lazy.safetensors", names, lazy)
        save_safetensors(out / "stream.safetensors", names, stream)
        result["saved_grads"] = str(out)
    return result
