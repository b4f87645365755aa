"""`hf` engine: a transformers causal LM with KV cache, turns decoded together and admitted between steps.

Sampling is per request: each request owns a torch.Generator seeded from its `seed` and draws
exactly one uniform per generated token, whatever else is in the batch. The token is the
inverse-CDF of that uniform under softmax(logits / T) (after top-p), computed in float64.
So the RNG stream never depends on the batch; only the logits can, through floating-point
summation order (padding and batch size change the kernels' reduction order, measured here for
float32 GEMMs of 1-4 rows vs 5+ rows). A token can therefore differ between batch compositions
only when its uniform falls within that rounding distance of a CDF boundary: about 1e-16 per token
in float64; in float32 about 1e-7 on the tiny test models, but log-probs of
data/embedded_policy/student (hidden 256) moved by up to 1e-5 between batch compositions and 1 of 24
turns (1,800 tokens) differed from its run alone, under static and continuous batching alike
(results/LOG.md, 2026-12-06). `batch_invariant=True` removes even that: each request then runs
alone (bitwise a pure function of weights, context, params and seed; slower).

Continuous batching (engines/protocol.py SteppingEngine): `add` queues a turn; `step` prefills the turns
added since the last step in one left-padded forward, merges their key/value cache into the running
batch (both left-padded to the longer length, with the attention mask marking real tokens and
explicit position ids, so padding changes no value, only summation order), samples one token for
every row, drops the rows that ended and decodes the rest one position. `generate` is add + step
until every turn ended. transformers' own continuous batching (`generate_batch`,
ContinuousBatchingManager) does not fit: it samples with torch.multinomial from the process's RNG,
one draw for the whole batch, so a turn's tokens depend on what else runs; it casts logits to
float32 and carries log-probs as float32; and its sampling settings are the manager's, not the
request's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from tsrl_cli.engines.protocol import SamplingParams, TurnOutput, TurnRequest
from tsrl_cli.engines.weight_sync import sync_gap


def sample_token(logits_V: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Inverse-CDF sampling from one row of logits with the request's own generator."""
    if p.temperature <= 0:
        return int(torch.argmax(logits_V))
    probs = torch.softmax(logits_V.double() / p.temperature, dim=-1)
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True, stable=True)
        keep = (torch.cumsum(sp, 0) - sp) < p.top_p  # smallest prefix with mass >= top_p
        sp, idx = sp[keep], idx[keep]
        c = torch.cumsum(sp, 0)
        j = int(torch.searchsorted(c, u * c[-1], right=True).clamp(max=len(c) - 1))
        return int(idx[j])
    c = torch.cumsum(probs, 0)
    return int(torch.searchsorted(c, u * c[-1], right=True).clamp(max=len(c) - 1))


@dataclass
class _Row:
    """One running turn."""

    rid: int
    params: SamplingParams
    gen: torch.Generator  # seeded from params.seed; one uniform per token
    pos: int  # position id of the row's last token in the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Batch:
    """Rows decoded together: `cache` holds per layer keys/values (B, heads, L, head_dim), each row left
    padded to the L columns; `attn` (B, L) is 1 where a row has a token; `logits` (B, V) are every row's
    next-token logits."""

    rows: list[_Row]
    cache: object  # a transformers DynamicCache
    attn: torch.Tensor
    logits: torch.Tensor

    def plain_layers(self) -> bool:
        """Whether every layer is a full-attention DynamicLayer (keys/values hold all L columns)."""
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def keep(self, idx: list[int]) -> None:
        """Keep rows `idx` only, and drop the leading columns that are padding in every kept row."""
        self.rows = [self.rows[i] for i in idx]
        sel = torch.tensor(idx, dtype=torch.long, device=self.attn.device)
        self.cache.batch_select_indices(sel)
        self.attn, self.logits = self.attn[sel], self.logits[sel]
        if self.plain_layers():
            lead = int(self.attn.any(0).long().argmax())  # first column some row uses
            if lead > 0:
                self.attn = self.attn[:, lead:]
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    def merge(self, other: _Batch) -> None:
        """Append `other`'s rows: both caches left padded with zeros to the longer length (masked out)."""
        if not (self.plain_layers() and other.plain_layers()):
            raise NotImplementedError("continuous batching on the hf engine merges full-attention caches only "
                                      "(this model has sliding-window or other layers); set rollout.batching=static")
        L = max(self.attn.shape[1], other.attn.shape[1])

        def pad(x: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            n = L - x.shape[-dim_from_end]
            return x if n == 0 else F.pad(x, (0, 0) * (dim_from_end - 1) + (n, 0))

        for a, b in zip(self.cache.layers, other.cache.layers, strict=True):
            a.keys = torch.cat([pad(a.keys, 2), pad(b.keys, 2)])
            a.values = torch.cat([pad(a.values, 2), pad(b.values, 2)])
        self.attn = torch.cat([pad(self.attn, 1), pad(other.attn, 1)])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows += other.rows


class HFEngine:
    """Generate model turns with a HuggingFace causal LM.

    Args:
        model: a loaded causal LM (its dtype and device are used as they are).
        pad_id: the token under the left padding (masked out; never sampled from).
        batch_invariant: run each request alone (bitwise pure; see module docstring).
    """

    def __init__(self, model, pad_id: int = 0, batch_invariant: bool = False):
        self.model = model.eval()
        self.pad_id = pad_id
        self.batch_invariant = batch_invariant
        self.version = 0
        self.device = next(model.parameters()).device
        self._added: list[tuple[int, TurnRequest]] = []  # admitted, prefilled at the next step
        self._batches: list[_Batch] = []  # running rows (one batch; one per row with batch_invariant)
        # what one weight sync must carry: the parameters the learner trains (all of them, or the LoRA
        # adapters: policy.trainable_state), tied ones once
        self._synced = {n for n, p in self.model.named_parameters() if p.requires_grad}
        self._received: set[str] = set()  # names loaded since the last finish_weights
        self._refused: str | None = None  # why turns are refused (a sync missed tensors), else None

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int) -> None:
        """Copy new weights in place (between rounds; one bus bucket at a time through engines/weight_sync.py
        apply_sync, which calls finish_weights after the last); `version` becomes the policy version. One copy
        per tensor: copy_ casts and moves in the same pass (a bucket on the host into a GPU engine)."""
        params = dict(self.model.named_parameters())
        for name, t in dict(named_tensors).items():
            if name not in params:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            params[name].copy_(t)
            self._received.add(name)
        self.version = version

    def finish_weights(self) -> None:
        """The sync is in: a sync that missed any trained tensor would serve a mix of two versions under
        the new version number, so it raises naming the first, and turns are refused until a sync carries
        them all (as VLLMEngine)."""
        received, self._received = self._received, set()
        self._refused = sync_gap(self._synced, received)
        if self._refused:
            raise RuntimeError(f"HFEngine: {self._refused}")

    # ---- continuous batching (engines/protocol.py SteppingEngine) ---------------------------------------
    def add(self, rid: int, request: TurnRequest) -> None:
        """Admit one turn; it is prefilled and joins the running batch at the next step."""
        if not request.context_ids:
            raise ValueError("a turn request needs a non-empty context")
        if self._refused:
            raise RuntimeError(f"HFEngine.add: {self._refused}")
        self._added.append((rid, request))

    def running(self) -> int:
        return len(self._added) + sum(len(b.rows) for b in self._batches)

    def step(self) -> list[tuple[int, TurnOutput]]:
        """Prefill the turns added since the last step into the batch, then one token for every row: the
        turns that ended in it (a stop token, or max_tokens reached). On an exception every turn is dropped."""
        try:
            return self._step()
        except BaseException:
            self._added, self._batches = [], []
            raise

    @torch.no_grad()
    def _step(self) -> list[tuple[int, TurnOutput]]:
        if self._added:
            if self.batch_invariant:  # each turn its own batch: computed as if alone
                self._batches += [self._prefill([a]) for a in self._added]
            elif self._batches:
                self._batches[0].merge(self._prefill(self._added))
            else:
                self._batches = [self._prefill(self._added)]
            self._added = []
        ended = [e for b in self._batches for e in self._advance(b)]
        self._batches = [b for b in self._batches if b.rows]
        return ended

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        """Every turn of `requests` decoded together (each alone with batch_invariant); not while add()ed
        turns run."""
        if self.running():
            raise RuntimeError("HFEngine.generate: turns added with add() are still running")
        if not all(r.context_ids for r in requests):
            raise ValueError("a turn request needs a non-empty context")
        for i, r in enumerate(requests):
            self.add(i, r)
        out: dict[int, TurnOutput] = {}
        while self.running():
            out.update(self.step())
        return [out[i] for i in range(len(requests))]

    def _prefill(self, added: list[tuple[int, TurnRequest]]) -> _Batch:
        B, T = len(added), max(len(r.context_ids) for _, r in added)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        for i, (_, r) in enumerate(added):  # left padding: every row's last token is at column T-1
            ids[i, T - len(r.context_ids):] = torch.tensor(r.context_ids)
            attn[i, T - len(r.context_ids):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        # logits at the last position only: the prefill's other (B, T, V) logits would be unused (at B = 16 rows of
        # 32,768 tokens of Qwen3, 148 GiB in bf16; tsrl plan)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        rows = [_Row(rid, r.params, torch.Generator().manual_seed(r.params.seed), len(r.context_ids) - 1)
                for rid, r in added]
        return _Batch(rows, out.past_key_values, attn, out.logits[:, -1])

    def _advance(self, b: _Batch) -> list[tuple[int, TurnOutput]]:
        """Sample one token per row of `b`; drop the rows that ended; decode the others one position."""
        logp = torch.log_softmax(b.logits.double(), dim=-1)
        ended, keep, nxt = [], [], []
        for i, row in enumerate(b.rows):
            t = sample_token(b.logits[i], row.params, row.gen)
            row.tokens.append(t)
            row.logprobs.append(float(logp[i, t]))
            if t in row.params.stop_token_ids or len(row.tokens) >= row.params.max_tokens:
                reason = "stop" if t in row.params.stop_token_ids else "length"
                ended.append((row.rid, TurnOutput(row.tokens, row.logprobs, reason, self.version)))
            else:
                keep.append(i)
                nxt.append(t)
        if not keep:
            b.rows = []
            return ended
        if len(keep) < len(b.rows):
            b.keep(keep)
        b.attn = torch.cat([b.attn, torch.ones((len(keep), 1), dtype=b.attn.dtype, device=b.attn.device)], dim=1)
        for row in b.rows:
            row.pos += 1
        pos = torch.tensor([[row.pos] for row in b.rows], device=self.device)
        ids = torch.tensor([[t] for t in nxt], device=self.device)
        out = self.model(input_ids=ids, attention_mask=b.attn, position_ids=pos, past_key_values=b.cache,
                         use_cache=True)
        b.cache, b.logits = out.past_key_values, out.logits[:, -1]
        return ended
