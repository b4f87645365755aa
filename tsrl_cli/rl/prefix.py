"""The shared-prompt cut (learner.prefix_cut): a group's prompt forwarded and backpropagated once per group.

Every member of a group (GRPO; OPD's samples of one prompt) starts with the same prompt tokens. Without the cut
each member's row is input_ids[:end], so the prompt is forwarded and backpropagated once per member. With it:

  open     the group's first backwarded member fixes the cut c = (its first scored position) - 1: positions
           [0, c) are the prompt part (c > 0, and position c-1's logits, which score token c, stay in the member
           rows). One forward of those c tokens under autograd records each decoder layer's keys and values
           K_l, V_l (the graph is kept); detached copies with requires_grad are the members' past.
  member   a member whose input_ids[:c] equal the group's token for token is a row over [c, end), attending to
           the past (PrefixPast); its backward gives the parameter gradient of its own positions and the
           adjoints dL/dK_l, dL/dV_l at the boundary. A member that differs falls back to an uncut row.
  close    once the group is closed (GRPO: its advantages known; OPD: every trajectory ended) and none of its
           arrivals is queued, one backward of the prompt's graph with the accumulated adjoints folds J_prompt^T a
           into R.

Exact by linearity: a member's gradient is its own part plus J_prompt^T (its adjoint), and the streaming round
applies a linear map to members' gradients. The adjoints therefore follow their pass's fold target: a pass into R
with scale s adds s * a to the group's R adjoint; a pass into an open group's (group, reward r) class carries the
coefficient A(r), the group's advantage once it closes (core/streaming.py StreamingRound.advantage: the same
coefficient the accumulator gives the class's parameter gradients). Where the estimator is affine in r (the
two-accumulator form), A(r) = alpha (r - r0) + A(r0) with r0 the group's first reward seen, so two sums suffice:
sum (r - r0) a and sum a (centred on r0 as core/accumulator.py centres S_r: rewards near 100 keep their digits);
the bucket form keeps one sum per reward value. OPD: a pass into a trajectory's unit buffer (seq-mean-token-mean
while it runs) carries the unit's scale 1/n_i, known at its end: one sum per open trajectory.

Memory per open group: the prompt's retained activations (about one c-token forward) and its adjoints, three
keys-and-values sets (R's part, the two sums) or 1 + one per reward value (tsrl plan, "prefix_cut").
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from tsrl_cli.policy import decoder_layers


class _Recorder(DynamicLayer):
    """A cache layer that keeps the last keys and values it saw and attends to nothing before them: the prompt's
    forward (a recomputation under activation checkpointing overwrites with equal values)."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states


class _Past(DynamicLayer):
    """A cache layer holding a prompt's keys and values (batch 1) that every row attends to. It never grows: the
    member forward, and its recomputation under activation checkpointing, see the same past."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True

    def update(self, key_states, value_states, *args, **kwargs):
        b = key_states.shape[0]
        return (torch.cat([self.keys.expand(b, -1, -1, -1), key_states], dim=-2),
                torch.cat([self.values.expand(b, -1, -1, -1), value_states], dim=-2))


def supports_cut(model) -> bool:
    """A transformers decoder that reads its past from a Cache (Qwen3, Llama, ... and their PEFT wrappers)."""
    try:
        dec = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return False
    return dec is not None and getattr(getattr(model, "config", None), "is_encoder_decoder", False) is False


@dataclass
class PromptState:
    """One group's prompt part: its keys and values with their graph, the members' leaves, the adjoint ledger."""

    group_id: Hashable
    ids: list[int]  # the prompt part's tokens, [0, c)
    outputs: list[torch.Tensor] = field(default_factory=list)  # K_0, V_0, K_1, ... with the prompt's graph
    leaves: list[torch.Tensor] = field(default_factory=list)  # detached copies the member rows attend to
    affine: bool = True  # the streaming round's buffer form: two sums, or one per reward value
    to_round: list[torch.Tensor] | None = None  # adjoints already weighted for R
    by_reward: dict[float, list[torch.Tensor]] = field(default_factory=dict)  # buckets: open-group classes
    by_unit: dict[Hashable, list[torch.Tensor]] = field(default_factory=dict)  # OPD: a trajectory's unit buffer
    r0: float | None = None  # affine: the first reward seen, the centre of sum (r - r0) a
    centred: list[torch.Tensor] | None = None  # affine: sum (r - r0) a
    ones: list[torch.Tensor] | None = None  # affine: sum a

    @property
    def cut(self) -> int:
        return len(self.ids)

    def past(self) -> Cache:
        """A fresh cache over the leaves for one member forward (a Cache is mutable state: one per forward)."""
        return Cache(layers=[_Past(self.leaves[2 * i], self.leaves[2 * i + 1]) for i in range(len(self.leaves) // 2)])

    def add(self, fold: tuple, adjoints: Sequence[torch.Tensor | None]) -> None:
        """A pass's boundary adjoints, under the same fold target as its parameter gradients."""
        if fold[0] == "round":
            self.to_round = _axpy(self.to_round, adjoints, fold[1], self.leaves)
        elif fold[0] == "member" and self.affine:
            r = float(fold[2])
            if self.r0 is None:
                self.r0 = r
            if r != self.r0:
                self.centred = _axpy(self.centred, adjoints, r - self.r0, self.leaves)
            self.ones = _axpy(self.ones, adjoints, 1.0, self.leaves)
        elif fold[0] == "member":
            r = float(fold[2])
            self.by_reward[r] = _axpy(self.by_reward.get(r), adjoints, 1.0, self.leaves)
        elif fold[0] == "unit":
            self.by_unit[fold[1]] = _axpy(self.by_unit.get(fold[1]), adjoints, 1.0, self.leaves)
        else:
            raise ValueError(f"prefix cut: fold target {fold[0]!r} has no prompt adjoint rule")

    def adjoint(self, advantage, unit_scale=None) -> list[torch.Tensor]:
        """The prompt's total adjoint once the group closed: R's part + sum over classes of A(r) * class (GRPO), + sum
        over trajectories of its unit scale * its unit's (OPD under seq-mean-token-mean: 1/n_i)."""
        total = self.to_round
        if self.ones is not None:
            a0 = advantage(self.r0)
            total = _axpy(total, self.ones, a0, self.leaves)
            if self.centred is not None:
                total = _axpy(total, self.centred, advantage(self.r0 + 1.0) - a0, self.leaves)
        for r, adj in self.by_reward.items():
            total = _axpy(total, adj, advantage(r), self.leaves)
        for key, adj in self.by_unit.items():
            total = _axpy(total, adj, unit_scale(key), self.leaves)
        return total if total is not None else [torch.zeros_like(t) for t in self.leaves]


def _axpy(buf, adjoints, alpha: float, like) -> list[torch.Tensor]:
    adj = [a if a is not None else torch.zeros_like(t) for a, t in zip(adjoints, like, strict=True)]
    if buf is None:
        return [a * alpha if alpha != 1.0 else a for a in adj]  # autograd's fresh tensors: owned here
    for b, a in zip(buf, adj, strict=True):
        b.add_(a, alpha=alpha)
    return buf


class PrefixCut:
    """The round's prompt parts, one per group that used the cut."""

    def __init__(self, model, affine: bool = True):
        self.model, self.affine = model, affine
        self.cuts: dict[Hashable, list[int]] = {}  # group -> its prompt part's tokens (fixed by its first arrival)
        self.states: dict[Hashable, PromptState] = {}
        self.positions = 0  # prompt positions forwarded (and backpropagated) this round

    def start_of(self, rollout) -> int:
        """Where this trajectory's row starts: the group's cut if it shares the prompt part, else 0 (uncut)."""
        ids, mask = rollout.input_ids, rollout.loss_mask
        first = next((j for j, m in enumerate(mask) if m), None)
        if first is None:
            return 0
        gid = rollout.group_id
        if gid not in self.cuts:
            self.cuts[gid] = list(ids[: first - 1]) if first >= 2 else []
        prompt = self.cuts[gid]
        c = len(prompt)
        if c == 0 or first - 1 < c or list(ids[:c]) != prompt:
            return 0
        return c

    def state(self, group_id: Hashable) -> tuple[PromptState, bool]:
        """The group's prompt state, forwarding the prompt part now if it is the group's first cut batch;
        (state, whether this call forwarded it)."""
        st = self.states.get(group_id)
        if st is not None:
            return st, False
        st = PromptState(group_id, self.cuts[group_id], affine=self.affine)
        dec = self.model.get_decoder()
        device = next(self.model.parameters()).device
        n_layers = len(decoder_layers(self.model))
        cache = Cache(layers=[_Recorder() for _ in range(n_layers)])
        dec(input_ids=torch.tensor([st.ids], device=device), past_key_values=cache, use_cache=True)
        st.outputs = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        st.leaves = [t.detach().requires_grad_(True) for t in st.outputs]
        self.states[group_id] = st
        self.positions += st.cut
        return st, True

    def closable(self, closed, busy_groups: set) -> list:
        """Groups whose prompt part can be backpropagated: closed (closed(gid); None: every group, the round's
        close) and not busy (nothing of it queued, no segment chain of it open)."""
        return [gid for gid in self.states if (closed is None or closed(gid)) and gid not in busy_groups]

    def ready(self, closed, busy_groups: set) -> list[PromptState]:
        """The closable prompt states, removed here: their backward runs now."""
        return [self.states.pop(gid) for gid in self.closable(closed, busy_groups)]


# ---------------------------------------------------------------------------- OPD: a trajectory's turns as segments

SEGMENT = "segment"  # the learner's OPD unit for Chain (StreamLearner(opd_unit=...); measured, not a config choice)


class _SegmentLayer(DynamicLayer):
    """A cache layer over a fixed past (batch 1, or none) that keeps this forward's own keys and values (`new`): a
    turn's segment. Idempotent under activation checkpointing's recomputation, like _Past and _Recorder."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None):
        super().__init__()
        if keys is not None:  # the past's length is what the attention mask is built from
            self.keys, self.values, self.is_initialized = keys, values, True
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        self.new = (key_states, value_states)
        if self.keys is None:
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@dataclass
class Segment:
    """Positions [start, end) of one trajectory, forwarded once: its keys and values with their graph (replayed at the
    trajectory's close with the adjoints later turns left on them), and the leaves later turns attend to."""

    start: int
    end: int
    outputs: list[torch.Tensor]
    leaves: list[torch.Tensor]
    to_round: list[torch.Tensor] | None = None  # adjoints already weighted for R
    to_unit: list[torch.Tensor] | None = None  # adjoints of passes into the trajectory's unit buffer (scale at its end)

    def add(self, fold: tuple, adjoints) -> None:
        if fold[0] == "round":
            self.to_round = _axpy(self.to_round, adjoints, fold[1], self.leaves)
        elif fold[0] == "unit":
            self.to_unit = _axpy(self.to_unit, adjoints, 1.0, self.leaves)
        else:
            raise ValueError(f"segment: fold target {fold[0]!r} has no adjoint rule")


class Chain:
    """One OPD trajectory under the OPD unit `segment` (the authors' per-turn scheme): each scored turn is forwarded
    once over [end of what was kept, its end), attending to the earlier segments' keys and values (and its group's
    prompt part), and backwarded at once for its own loss; the gradient that loss leaves on earlier keys and values (a
    later turn's dependence on them) is kept per segment, and replayed through each segment's kept graph, last first,
    when the trajectory is done. Exact by the chain rule; positions: each token forwarded once (plus one per row,
    whose logits score the next row's first token), backwarded twice (its turn's own loss, then its segment's
    replay)."""

    def __init__(self, group_id: Hashable, prompt: PromptState | None, n_layers: int):
        self.group_id, self.prompt, self.n_layers = group_id, prompt, n_layers
        self.segments: list[Segment] = []
        self._layers: list[_SegmentLayer] = []

    @property
    def cut(self) -> int:
        """Where the next segment starts (Layout reads a prompt-like object's cut and past())."""
        if self.segments:
            return self.segments[-1].end
        return self.prompt.cut if self.prompt is not None else 0

    def past_leaves(self) -> list[torch.Tensor]:
        """Every leaf the next segment attends to, in order: the prompt's, then each segment's."""
        out = list(self.prompt.leaves) if self.prompt is not None else []
        for s in self.segments:
            out += s.leaves
        return out

    def past(self) -> Cache:
        """A fresh cache for the next segment's forward: the past leaves per layer; it records the segment's own."""
        parts = ([self.prompt.leaves] if self.prompt is not None else []) + [s.leaves for s in self.segments]
        self._layers = [_SegmentLayer(torch.cat([p[2 * i] for p in parts], dim=-2) if parts else None,
                                      torch.cat([p[2 * i + 1] for p in parts], dim=-2) if parts else None)
                        for i in range(self.n_layers)]
        return Cache(layers=self._layers)

    def record(self, start: int, end: int) -> None:
        """The row just run covered [start, end): keep the keys and values of [start, end - 1) as a new segment. The
        last position's logits score the next row's first token, so the next row starts there, re-encoding that one
        position: its keys and values are kept once, from that row."""
        n = end - 1 - start
        if n <= 0:
            return
        outputs = [t[:, :, :n] for layer in self._layers for t in layer.new]  # (1, kv heads, n, head dim)
        self.segments.append(Segment(start, end - 1, outputs, [t.detach().requires_grad_(True) for t in outputs]))

    def add(self, fold: tuple, adjoints: Sequence[torch.Tensor | None]) -> None:
        """A pass's adjoints on every past leaf (past_leaves' order), under its fold target."""
        i = 0
        if self.prompt is not None:
            n = len(self.prompt.leaves)
            self.prompt.add(fold, adjoints[:n])
            i = n
        for s in self.segments:
            n = len(s.leaves)
            s.add(fold, adjoints[i:i + n])
            i += n

    def replay(self, unit_scale: float, backward_outputs, fold_round) -> list[int]:
        """The trajectory is done: last segment first, its total adjoint (R's part + unit_scale x its unit part) through
        its kept graph; the parameters' gradient goes to R (fold_round), the adjoints it leaves on earlier segments
        and on the prompt part join theirs, already weighted. backward_outputs(outputs, adjoints, extra) -> (parameter
        gradients, extra's gradients). Returns the positions of each segment replayed (a segment no later turn read
        needs none)."""
        runs = []
        for j in reversed(range(len(self.segments))):
            s = self.segments[j]
            adj = s.to_round
            if s.to_unit is not None:
                adj = _axpy(adj, s.to_unit, unit_scale, s.leaves)
            if adj is None:
                continue
            earlier = Chain(self.group_id, self.prompt, self.n_layers)
            earlier.segments = self.segments[:j]
            grads, extra = backward_outputs(s.outputs, adj, earlier.past_leaves())
            fold_round(grads)
            earlier.add(("round", 1.0), extra)
            runs.append(s.end - s.start)
        self.segments = []
        return runs
