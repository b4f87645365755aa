"""The round learner that `sync`, `stream` and `async` share: one round's gradient, any timing.

  StreamLearner    arrivals in (a GRPO trajectory with its reward, an OPD turn with its teacher scores),
                   micro-batches backwarded as the learner is free, group and round scalars at their close
  LocalGrads       the single-process backend (autograd.grad per pass); rl/group.py ShardedGrads on N ranks

Its rooms: rl/arrivals.py (each objective's arrival rules: where a gradient goes), rl/microbatch.py (which
arrivals are backwarded together), rl/batchloss.py (the losses of one micro-batch), core/accumulator.py (the
buffers S_r, S_1, S_u, R). rl/objective.py holds the Objective and the lazy reference this learner equals.

Micro-batching stays exact because one backward is taken per *fold target*, never across targets:
  - a GRPO group whose rewards are all known ("complete") has its advantages: any of its members, of
    any complete groups, go into the round buffer R in one backward with weights A_i;
  - members of an open group with the same reward share their weight in both S_r and S_1 (docs/
    streaming.md): one backward per (group, reward value) class, folded with (r - b) and 1;
  - OPD turns go into R (their scalar is known: 1, or 1/n_i once the trajectory ended under
    seq-mean-token-mean), or into their trajectory's unit buffer while n_i is still unknown;
    queued turns of one trajectory share one row: the longest prefix's forward scores them all.
    With opd_unit "trajectory" a trajectory's turns wait for its end and go to R in that one row.
The first arrival never waits for company: the learner backwards whatever is queued when it is free.

On a learner group (rl/group.py) every rank runs this learner on the same arrivals, plans the same
micro-batches, backwards its own one per lockstep pass, and the folding all-to-all puts each source
rank's gradient into that rank's target: the same buffers, sharded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tsrl_cli.config import GRANULARITIES, OPD_UNITS
from tsrl_cli.core.losses import round_scale
from tsrl_cli.core.streaming import StreamingRound
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import decoder_layers
from tsrl_cli.rl import microbatch
from tsrl_cli.rl.arrivals import RULES, Arrival, OpenBuffers
from tsrl_cli.rl.batchloss import TokenWeights, idle_losses, microbatch_losses, zero_loss
from tsrl_cli.rl.hostfold import HostFold, auto_threads
from tsrl_cli.rl.microbatch import MicroBatch
from tsrl_cli.rl.objective import Objective, check_inputs, lazy_loss, pad_rows
from tsrl_cli.rl.prefix import SEGMENT, Chain, PrefixCut, supports_cut
from tsrl_cli.rollouts import Rollout

__all__ = ["LocalGrads", "MicroBatch", "Objective", "StreamLearner", "lazy_loss", "packs", "pad_rows"]


PACKED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")  # varlen attention, no dense mask


def packs(packing: str, device: str, model) -> bool:
    """learner.packing: on | off, or auto: packed on a GPU where the attention runs packed rows natively. sdpa and
    eager build a dense mask over the packed length, quadratic in it: on the CPU a packed micro-batch of 8 rows
    took 1.2-2.2x the padded one's time (results/LOG.md), so auto pads there."""
    if packing != "auto":
        return packing == "on"
    return device.startswith("cuda") and getattr(model.config, "_attn_implementation", None) in PACKED_ATTENTION


def cut_applies(model, obj: Objective, world: int, ref_model, token_weights) -> bool:
    """Where the shared-prompt cut runs (learner.prefix_cut): groups sharing a prompt on one process, a transformers
    decoder with a Cache, rows that no reference model (KL) or TIS weights read over their whole length."""
    return (world == 1 and token_weights is None
            and (ref_model is None or not obj.loss.kl_coef) and supports_cut(model))


class LocalGrads:
    """The single-process backend: autograd.grad per pass, one tensor per trainable parameter."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self.templates = self.params
        self.passes = 0

    def backward(self, losses, folds_by_rank, fold, extra: Sequence[torch.Tensor] = (), keep: bool = False) -> list:
        """Each loss's gradient folded into its target; returns each pass's gradients of `extra` (leaf tensors the
        losses read beside the parameters: a group's prompt keys and values, rl/prefix.py). keep: the graph stays
        for a later backward (an OPD segment's replay)."""
        out, n = [], len(self.params)
        for k, loss in enumerate(losses):
            grads = torch.autograd.grad(loss, self.params + list(extra), retain_graph=keep or k < len(losses) - 1,
                                        allow_unused=True)
            self.passes += 1
            if folds_by_rank[k][0] is not None:
                fold(folds_by_rank[k][0], list(grads[:n]))
            out.append(list(grads[n:]))
        return out

    def backward_outputs(self, outputs: Sequence[torch.Tensor], adjoints: Sequence[torch.Tensor],
                         extra: Sequence[torch.Tensor] = ()) -> tuple[list, list]:
        """J^T adjoints: the gradients of kept outputs (a group's prompt keys and values, an OPD segment's) with
        respect to the parameters and to `extra` (leaves those outputs read)."""
        self.passes += 1
        n = len(self.params)
        grads = torch.autograd.grad(outputs, self.params + list(extra), grad_outputs=adjoints, allow_unused=True)
        return list(grads[:n]), list(grads[n:])


class StreamLearner:
    """The round learner for one round (one rank, or every rank of a group alike).

        arrivals   on_trajectory(r) (GRPO), on_turn(r, k) / end_trajectory(r) / on_opd_trajectory(r) (OPD):
                   the objective's rules (rl/arrivals.py) queue them and close buffers whose scalar is known
        step()     plan the next micro-batches from the queue (rl/microbatch.py), one per rank; run this
                   rank's losses (rl/batchloss.py) and backward them, each pass folded into its target
        drain()    step until nothing queued can run now
        close_round()  apply the round scalar Z once; the gradient per template

    `obj.loss.max_open_groups`: beyond this many open groups (GRPO) or open trajectories (OPD with
    seq-mean-token-mean), new ones are deferred: their arrivals wait until their scalar is known and then
    join R with their final weights (exact, costing no buffer). `opd_unit`, `granularity` (trajectory | group:
    a group's arrivals wait for its last one, then go to R together): see rl/arrivals.py.
    fold_fault: wraps the fold of every pass (rl/faults.py: a test's broken fold), or None.
    """

    def __init__(self, model, obj: Objective, group_sizes: Mapping[str, int] | None = None, *,
                 grads=None, rank: int = 0, world: int = 1, max_tokens: int | None = None,
                 max_items: int | None = None, ref_model=None, token_weights: TokenWeights | None = None,
                 threaded_host_fold: bool | None = None, chunk_tokens: int | None = None,
                 opd_unit: str = "turn", granularity: str = "trajectory", packed: bool = False,
                 prefix_cut: bool = False, fold_fault=None):
        if opd_unit not in (*OPD_UNITS, SEGMENT):
            raise UsageError(f"OPD unit {opd_unit!r} is unknown; use one of {', '.join(OPD_UNITS)}")
        if granularity not in GRANULARITIES:
            raise UsageError(f"granularity {granularity!r} is unknown; use one of {', '.join(GRANULARITIES)}")
        self.model, self.obj = model, obj
        self.chunk_tokens = chunk_tokens  # learner.logits_chunk_tokens: the LM head N positions at a time
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads = grads if grads is not None else LocalGrads(self.params)
        self.rank, self.world = rank, world
        self.max_tokens, self.max_items = max_tokens, max_items
        self.packed = packed and token_weights is None  # rows end to end (rl/batchloss.py); TIS reads padded rows
        self.ref_model, self.token_weights = ref_model, token_weights
        lc = obj.loss
        # host buffers beside GPU gradients: folds leave the critical path (rl/hostfold.py)
        host_gpu = any(t.is_cuda for t in self.grads.templates) and lc.buffer_device == "cpu"
        self.host_fold = HostFold(cuda=host_gpu, threaded=threaded_host_fold,
                                  device=next((t.device for t in self.grads.templates if t.is_cuda), None),
                                  threads=lc.host_fold_threads or auto_threads(world, host_gpu),
                                  pending=lc.host_fold_pending, pass_of=lambda: self.grads.passes)
        # the streaming contract (core/streaming.py): the group ledger, its rails and the buffers; on a group the
        # watched parameters are FSDP's shards, whose in-place changes it cannot see: one process only
        self.round = StreamingRound(self.grads.templates, estimator=lc.adv_norm, std=lc.adv_std, eps=lc.adv_eps,
                                    buffers=lc.group_buffers,
                                    dtype=None if lc.buffer_dtype == "float32" else torch.bfloat16,
                                    device="cpu" if lc.buffer_device == "cpu" else None,
                                    fold=self.host_fold, sync=self.host_fold.sync,
                                    watch=self.params if world == 1 else None)
        self.acc = self.round.acc
        self.buffers = OpenBuffers(lc.max_open_groups)
        extra = {"opd_unit": opd_unit} if obj.kind == "opd" else {}
        self.rules = RULES[obj.kind](obj, group_sizes or {}, self.round, self.buffers, self._tally, self._queue,
                                     granularity, **extra)
        self._apply = self._fold if fold_fault is None else fold_fault(self._fold)
        self.num_tokens = 0  # N: loss tokens of the round so far
        self._nonempty: set[tuple[str, int]] = set()  # B: sequences with >= 1 loss token
        self.queue: list[Arrival] = []
        self._seq = 0
        self.backwards = 0  # backward passes this rank ran (dummies included)
        self._loss_sum = 0.0  # this rank's round-target losses before Z (the lazy loss, once Z is known)
        self.loss: float | None = None
        self.batches: list[MicroBatch] = []  # every micro-batch of the round, in order (all ranks')
        self.replayed = 0  # OPD unit segment: positions backwarded again at their trajectory's end (no forward)
        # the shared-prompt cut (rl/prefix.py): one process, rows read by no reference model or TIS weights
        self.cut = None
        if prefix_cut and cut_applies(model, obj, world, ref_model, token_weights):
            self.cut = PrefixCut(model, affine=self.round.form == "affine")
        # OPD unit `segment` (rl/prefix.py Chain): each trajectory's turns as segments over kept keys and values
        self.chains: dict | None = None
        if obj.kind == "opd" and opd_unit == SEGMENT:
            if not cut_applies(model, obj, world, ref_model, token_weights):
                raise UsageError("OPD unit segment runs on one learner process, a transformers decoder, without a "
                                 "reference-model KL or TIS weights; use opd_unit trajectory or turn")
            self.chains = {}
            self._layers = len(decoder_layers(model))

    # ---- arrivals ------------------------------------------------------------------------------
    def _tally(self, r: Rollout, n: int) -> None:
        self.num_tokens += n
        if n:
            self._nonempty.add(r.key)

    def _queue(self, r: Rollout, turn: int | None, row) -> None:
        self._seq += 1
        start = self.cut.start_of(r) if self.cut is not None else 0
        self.queue.append(Arrival(r, turn, self._seq, row if row is not None else (r.key, self._seq), start))

    def _rule(self, name: str, r: Rollout):
        check_inputs([r], self.obj, self.ref_model is not None)
        fn = getattr(self.rules, name, None)
        if fn is None:
            raise UsageError(f"rollout {r.key}: {name} is not an arrival of a {self.obj.kind} round")
        return fn

    def on_trajectory(self, r: Rollout) -> None:
        """GRPO: a trajectory and its reward arrived (queued; backwarded by step/drain)."""
        self._rule("on_trajectory", r)(r)

    def on_turn(self, r: Rollout, k: int) -> None:
        """OPD: model turn k of trajectory r was scored by the teacher (queued)."""
        self._rule("on_turn", r)(r, k)

    def on_opd_trajectory(self, r: Rollout) -> None:
        """OPD, all turns at once (the lazy baselines): one row over the whole trajectory."""
        self._rule("on_opd_trajectory", r)(r)

    def end_trajectory(self, r: Rollout) -> None:
        """OPD trajectory end: its per-sequence scalar (seq-mean-token-mean) is now known."""
        self.rules.end_trajectory(r)

    @property
    def deferred(self) -> frozenset:
        """The groups (GRPO group ids) or trajectories (OPD keys) that max_open_groups held back at least once:
        their arrivals waited for the group's close (or for a buffer to free) instead of opening one."""
        return frozenset(self.buffers.held)

    # ---- one step ------------------------------------------------------------------------------
    def plan(self) -> list[MicroBatch]:
        """The next step's micro-batches (at most one per rank), from the queue, in arrival order."""
        classes: dict[tuple, list[Arrival]] = {}
        opening: set = set()
        for a in self.queue:
            t = self.rules.target(a, opening)
            if t is None:
                continue
            if self.chains is not None:  # a segment's row is alone in its batch: one trajectory's past
                classes.setdefault((t, ("chain", a.rollout.key)), []).append(a)
            else:  # cut rows batch with their own group's only: one prompt part per batch
                classes.setdefault((t, a.rollout.group_id if a.start else None), []).append(a)
        batches = microbatch.plan(classes, self.world, self.max_items, self.max_tokens, self.packed)
        for b in batches:
            b.target, b.prefix = b.target
        return batches

    def has_work(self) -> bool:
        """Arrivals queued that can be backwarded now (deferred ones wait for their group or trajectory), or a
        prompt part or OPD segment chain whose backward can run (rl/prefix.py): a step runs those."""
        opening: set = set()
        deferred = set(self.buffers.deferred)
        try:
            return any(self.rules.target(a, opening) is not None for a in self.queue) or self._closable()
        finally:
            self.buffers.deferred = deferred  # has_work never decides a deferral

    def _closable(self) -> bool:
        return bool(self._ready_chains()) or (self.cut is not None
                                              and bool(self.cut.closable(self.rules.group_closed, self._busy_groups())))

    def _ready_chains(self, every: bool = False) -> list:
        """OPD segment chains whose trajectory ended (every: all of them) with nothing of it queued."""
        if not self.chains:
            return []
        queued = {a.rollout.key for a in self.queue}
        return [k for k in self.chains if k not in queued and (every or self.rules.ended(k))]

    def _busy_groups(self) -> set:
        """Groups whose prompt part may still get adjoints: an arrival queued, or a segment chain open."""
        return {a.rollout.group_id for a in self.queue} | {ch.group_id for ch in (self.chains or {}).values()}

    def step(self) -> list[MicroBatch]:
        """Backward the next micro-batch of each rank (every rank calls this together); returns them all."""
        batches = self.plan()
        if not batches:  # nothing to backward but what closed: prompt parts, OPD segment replays
            self._close_prompts()
            return []
        mine = batches[self.rank] if self.rank < len(batches) else None
        prompt = None
        if mine is not None and self.chains is not None:
            prompt = self._chain(mine)
            mine.width = mine.real = max(a.end for a in mine.items) - prompt.cut  # the row starts where its past ends
        elif mine is not None and mine.prefix is not None:
            prompt, forwarded = self.cut.state(mine.prefix)
            mine.prompt = prompt.cut if forwarded else 0
        if mine is None:
            losses = idle_losses(self.model, self.obj, self.ref_model)
        else:
            losses, _ = microbatch_losses(self.model, mine, self.obj, self.rules, ref_model=self.ref_model,
                                          token_weights=self.token_weights, chunk_tokens=self.chunk_tokens,
                                          packed=self.packed, prompt=prompt)
        n_pass = max(self._passes(b) for b in batches)
        losses += [losses[0] * 0.0] * (n_pass - len(losses))  # lockstep: every rank runs as many passes
        folds = [[self._fold_of(b, k) for b in batches] + [None] * (self.world - len(batches)) for k in range(n_pass)]
        self._loss_sum += sum(float(loss.detach()) for loss, f in zip(losses, folds, strict=False)
                              if f[self.rank] is not None and f[self.rank][0] == "round")
        if prompt is None:
            self.grads.backward(losses, folds, self._apply)
        else:  # the boundary adjoints follow their pass's fold target
            chain = isinstance(prompt, Chain)
            leaves = prompt.past_leaves() if chain else prompt.leaves
            for k, adj in enumerate(self.grads.backward(losses, folds, self._apply, extra=leaves, keep=chain)):
                if folds[k][self.rank] is not None:
                    prompt.add(folds[k][self.rank], adj)
            if chain:
                prompt.record(prompt.cut, max(a.end for a in mine.items))
        self.backwards += n_pass
        done = {id(a) for b in batches for a in b.items}
        self.queue = [a for a in self.queue if id(a) not in done]
        self.batches += batches
        for b in batches:  # the groups and units these batches opened now hold buffers
            if b.target[0] != "round":
                self.buffers.open.add(b.target[1])
        self._close_prompts()
        return batches

    def _chain(self, b: MicroBatch) -> Chain:
        """The trajectory's chain of segments (opened with its group's prompt part where the cut applies)."""
        r = b.items[0].rollout
        ch = self.chains.get(r.key)
        if ch is None:
            st = None
            if self.cut is not None and b.items[0].start:
                st, forwarded = self.cut.state(r.group_id)
                b.prompt = st.cut if forwarded else 0
            ch = self.chains[r.key] = Chain(r.group_id, st, self._layers)
        return ch

    def _close_chains(self, every: bool = False) -> None:
        """Replay each ended trajectory's segments (nothing of it queued): their gradient into R, the prompt part's
        adjoint into its group's ledger."""
        for key in self._ready_chains(every):
            ch = self.chains.pop(key)
            runs = ch.replay(self.rules.unit_scale(key), self.grads.backward_outputs,
                             lambda g: self._apply(("round", 1.0), g))
            self.backwards += len(runs)
            self.replayed += sum(runs)

    def _close_prompts(self, every: bool = False) -> None:
        """Backpropagate each prompt part whose group closed and has nothing queued: J^T (its total adjoint) into R.
        every: the round's close (every group and trajectory closed by then, or the round fails after this)."""
        self._close_chains(every)
        if self.cut is None:
            return
        for st in self.cut.ready(None if every else self.rules.group_closed, self._busy_groups()):
            adj = st.adjoint(lambda r, gid=st.group_id: self.round.advantage(gid, r), self.rules.unit_scale)
            self._apply(("round", 1.0), self.grads.backward_outputs(st.outputs, adj)[0])
            self.backwards += 1

    def drain(self) -> None:
        while self.has_work():
            self.step()

    def _passes(self, b: MicroBatch) -> int:
        """A batch whose regularizer goes apart (GRPO open group, KL/entropy on) takes a second pass into R."""
        reg = bool(self.obj.loss.kl_coef or self.obj.loss.entropy_coef)
        return 2 if reg and self.rules.regularizer_apart(b.target) else 1

    def _fold_of(self, b: MicroBatch, k: int):
        if k >= self._passes(b):
            return None
        return ("round", 1.0) if k == 1 or b.target == ("round",) else b.target

    def _fold(self, fold: tuple, grads: list) -> None:
        if fold[0] == "round":
            self.round.add(grads=grads, scale=fold[1])
        else:
            self.rules.fold(fold, grads)

    def zero_loss(self) -> torch.Tensor:
        """A loss of 0 over a 2-token forward: the pass a rank runs when it has nothing to backward."""
        return zero_loss(self.model)

    # ---- round close ---------------------------------------------------------------------------
    def close_round(self) -> list[torch.Tensor]:
        """Apply the round scalar (1/N, 1/B or 1/C) once; the gradient per template (parameter or shard)."""
        self._close_prompts(every=True)
        if self.queue or (self.cut is not None and self.cut.states):
            raise RuntimeError(f"round closed with {len(self.queue)} item(s) not backwarded and "
                               f"{len(self.cut.states) if self.cut else 0} prompt part(s) open (a group or trajectory "
                               "never completed)")
        z = round_scale(self.obj.loss.loss_agg, self.num_tokens, len(self._nonempty), self.obj.loss.global_batch_size,
                        self.obj.loss.norm_constant)
        self.loss = z * self._loss_sum
        out = self.round.finish(z)
        self.host_fold.close()
        return out
