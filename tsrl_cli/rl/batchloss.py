"""The losses of one micro-batch: one forward over its rows, one loss per backward pass.

    microbatch_losses(model, batch, obj, rules, ...) -> [loss of pass 1, (loss of pass 2)]

A row is one arrival, or an OPD trajectory's queued turns, which share the row of their longest
prefix: that forward scores them all. A row ends at its last scored token. Each loss is
sum_i w_i * sum_t m_it * l_it over the rows (w_i the per-sequence weight known now, m the loss mask of
the row's own turns, l the per-token term); the group and round scalars are applied by the accumulator
at their close, never here. The LM head runs over the scored positions only.

Layout: `padded` rows of the widest row's length (B, T), or `packed`: the rows end to end in one
sequence (1, sum T_i) whose position ids restart at 0 per row, so each row attends within itself
(transformers reads packed sequences from the position ids) and no position is padding.
With the shared-prompt cut (rl/prefix.py) a batch's rows are one group's members over [c, end), padded, attending
to the group's prompt part as past keys and values; their per-token fields are the same slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tsrl_cli.policy import forward_logprobs
from tsrl_cli.rl.arrivals import Arrival
from tsrl_cli.rl.microbatch import MicroBatch, rows_of
from tsrl_cli.rl.objective import Objective, pad_rows, regularizer
from tsrl_cli.rollouts import Rollout

TokenWeights = Callable[[list[Rollout], torch.Tensor], torch.Tensor]  # (rollouts, logp (B, T)) -> (B, T) detached


class Layout:
    """One micro-batch's rows as model inputs: padded (B, T) or packed (1, sum T_i)."""

    def __init__(self, heads: list[Arrival], masks: list[list[int]], packed: bool, device, prompt=None):
        self.heads, self.device = heads, device
        self.prompt = prompt  # rl/prefix.py PromptState: rows start at its cut and attend to it
        self.start = 0 if prompt is None else prompt.cut
        self.packed = packed and prompt is None
        self.lengths = [h.end - self.start for h in heads]
        self.width = max(self.lengths)
        if prompt is not None:  # rows over [c, end) attending to the prompt's (or earlier segments') keys and values
            c = self.start
            self.ids = pad_rows([h.rollout.input_ids[c: h.end] for h in heads], self.width, torch.long, device)
            self.attn = pad_rows([[1] * (c + n) for n in self.lengths], c + self.width, torch.long, device)
            self.positions = (torch.arange(self.width, device=device) + c)[None, :].expand(len(heads), -1)
        elif self.packed:
            self.ids = torch.tensor([[t for h in heads for t in h.rollout.input_ids[: h.end]]], device=device)
            self.positions = torch.tensor([[j for n in self.lengths for j in range(n)]], device=device)
            self.attn = None
            self.row_of = torch.tensor([i for i, n in enumerate(self.lengths) for _ in range(n)], device=device)
        else:
            self.ids = pad_rows([h.rollout.input_ids[: h.end] for h in heads], self.width, torch.long, device)
            self.attn = pad_rows([[1] * n for n in self.lengths], self.width, torch.long, device)
            self.positions = None
        self.masks = masks

    @property
    def computed(self) -> int:
        """Token positions the forward and backward cover, padding included."""
        return sum(self.lengths) if self.packed else len(self.lengths) * self.width

    def per_token(self, rows: list[list[float]], dtype) -> torch.Tensor:
        """A per-token field of each row (its positions [start, end)), in the layout."""
        c = self.start
        if self.packed:
            flat = [v for row, n in zip(rows, self.lengths, strict=True) for v in row[:n]]
            return torch.tensor([flat], dtype=dtype, device=self.device)
        return pad_rows([row[c:c + n] for row, n in zip(rows, self.lengths, strict=True)], self.width, dtype,
                        self.device)

    def per_row(self, values: list[float], dtype) -> torch.Tensor:
        """One value per row, broadcast over its tokens: (B, 1) padded, (1, sum T_i) packed."""
        v = torch.tensor(values, dtype=torch.float64).to(device=self.device, dtype=dtype)
        return v[self.row_of][None, :] if self.packed else v[:, None]

    def row_sum(self, per_tok: torch.Tensor, w: list[float]) -> torch.Tensor:
        """sum_i w_i * sum_t per_tok[i, t] (per_tok already masked)."""
        if self.packed:
            return (self.per_row(w, per_tok.dtype) * per_tok).sum()
        return (torch.tensor(w, dtype=torch.float64).to(per_tok) * per_tok.sum(-1)).sum()

    def forward(self, model, *, entropy: bool, chunk_tokens: int | None, scored: torch.Tensor | None):
        return forward_logprobs(model, self.ids, self.attn, entropy=entropy, chunk_tokens=chunk_tokens,
                                scored_B_T=scored, position_ids_B_T=self.positions,
                                past_key_values=None if self.prompt is None else self.prompt.past())


def microbatch_losses(model, batch: MicroBatch, obj: Objective, rules, *, ref_model=None,
                      token_weights: TokenWeights | None = None, chunk_tokens: int | None = None,
                      packed: bool = False, prompt=None) -> tuple[list[torch.Tensor], int]:
    """(this batch's losses, one per backward pass, and the token positions its forward covered). Two passes for a
    GRPO open group's members with a KL or entropy term: the term carries no advantage and goes to R apart.
    token_weights (TIS) read padded rows: a batch with them is never packed. prompt: the group's PromptState when
    the batch's rows start at its cut (rl/prefix.py; never with token_weights or a reference model)."""
    device = next(model.parameters()).device
    rows = rows_of(batch.items)
    heads: list[Arrival] = [max(row, key=lambda a: a.end) for row in rows]  # each row's longest prefix

    # the mask keeps only the positions of the row's own arrivals
    mask_rows = []
    for row, h in zip(rows, heads, strict=True):
        m = [0] * h.end
        for a in row:
            s, e = a.span
            m[s:e] = h.rollout.loss_mask[s:e]
        mask_rows.append(m)
    lay = Layout(heads, mask_rows, packed and token_weights is None, device, prompt)
    scored = lay.per_token(mask_rows, torch.bool)
    logp, ent = lay.forward(model, entropy=obj.loss.entropy_coef != 0, chunk_tokens=chunk_tokens, scored=scored)
    mask = scored.to(logp.dtype)

    def aligned(name):  # a per-token field of each row's rollout, in logp's dtype and the batch's layout
        return lay.per_token([getattr(h.rollout, name) for h in heads], logp.dtype)

    ref = None
    if obj.loss.kl_coef:
        if ref_model is not None:
            with torch.no_grad():
                ref = lay.forward(ref_model, entropy=False, chunk_tokens=chunk_tokens, scored=scored)[0].to(logp.dtype)
        else:
            ref = aligned("ref_logprobs")
    reg = regularizer(obj, logp, ref, ent)  # advantage-free per-token terms, or None
    w = [rules.weight(h) for h in heads]

    main = rules.main_term(logp, heads, batch.target, aligned, lambda v: lay.per_row(v, logp.dtype))
    if token_weights is not None:  # TIS: a detached per-token weight, linear like the advantage
        main = main * token_weights([h.rollout for h in heads], logp)
    if rules.regularizer_apart(batch.target):
        out = [lay.row_sum(main * mask, w)]
        if reg is not None:
            out.append(lay.row_sum(reg * mask, w))
        return out, lay.computed
    per_tok = main if reg is None else main + reg
    return [lay.row_sum(per_tok * mask, w)], lay.computed


def idle_losses(model, obj: Objective, ref_model=None) -> list[torch.Tensor]:
    """A rank without a batch: the same forwards in the same order as a rank with one (FSDP's all-gathers run
    in lockstep), and a loss of 0."""
    out = zero_loss(model)
    if ref_model is not None and obj.loss.kl_coef:
        with torch.no_grad():
            forward_logprobs(ref_model, torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device))
    return [out]


def zero_loss(model) -> torch.Tensor:
    """A loss of 0 over a 2-token forward: the pass a rank runs when it has nothing to backward."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    return forward_logprobs(model, ids)[0].sum() * 0.0
