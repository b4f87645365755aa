"""`hf` engine: a transformers causal LM with KV cache, many turns decoded in one batched loop.

Sampling is per request: each request owns a torch.Generator seeded from its `seed` and draws
exactly one uniform per generated token, whatever else is in the batch. The token is the
inverse-CDF of that uniform under softmax(logits / T) (after top-p), computed in float64.
So the RNG stream never depends on the batch; only the logits can, through floating-point
summation order (padding and batch size change the kernels' reduction order, measured here for
float32 GEMMs of 1-4 rows vs 5+ rows). A token can therefore differ between batch compositions
only when its uniform falls within that rounding distance of a CDF boundary: about 1e-7 per
token in float32, about 1e-16 in float64. `batch_invariant=True` removes even that: each request
then runs alone (bitwise a pure function of weights, context, params and seed; slower).
"""

from __future__ import annotations

import torch

from tsrl_cli.engines.base import SamplingParams, TurnOutput, TurnRequest


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


class HFEngine:
    """Generate model turns with a HuggingFace causal LM.

    Args:
        model: a loaded causal LM (its dtype and device are used as they are).
        pad_id: token fed to finished rows and used for left padding (never sampled from).
        batch_invariant: run each request alone (bitwise pure; see module docstring).
    """

    def __init__(self, model, pad_id: int = 0, batch_invariant: bool = False):
        self.model = model.eval()
        self.pad_id = pad_id
        self.batch_invariant = batch_invariant
        self.version = 0
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int) -> None:
        """Copy new weights in place (between rounds); `version` becomes the policy version."""
        params = dict(self.model.named_parameters())
        for name, t in dict(named_tensors).items():
            if name not in params:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            params[name].copy_(t.to(params[name].dtype))
        self.version = version

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        if not requests:
            return []
        if self.batch_invariant:
            return [self._generate_batch([r])[0] for r in requests]
        return self._generate_batch(requests)

    @torch.no_grad()
    def _generate_batch(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        B = len(requests)
        for r in requests:
            if not r.context_ids:
                raise ValueError("a turn request needs a non-empty context")
        T = max(len(r.context_ids) for r in requests)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every row's last token is at column T-1
            ids[i, T - len(r.context_ids):] = torch.tensor(r.context_ids)
            attn[i, T - len(r.context_ids):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        # logits at the last position only: the prefill's other (B, T, V) logits would be unused (at B = 16 rows of
        # 32,768 tokens of Qwen3, 148 GiB in bf16; tsrl plan)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1]
        gens = [torch.Generator().manual_seed(r.params.seed) for r in requests]
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        done = [False] * B
        reason = ["length"] * B
        last_pos = pos[:, -1]
        while not all(done):
            nxt = torch.full((B, 1), self.pad_id, dtype=torch.long)
            logp = torch.log_softmax(logits.double(), dim=-1)
            for i, r in enumerate(requests):
                if done[i]:
                    continue
                t = sample_token(logits[i], r.params, gens[i])
                toks[i].append(t)
                lps[i].append(float(logp[i, t]))
                nxt[i, 0] = t
                if t in r.params.stop_token_ids:
                    done[i], reason[i] = True, "stop"
                elif len(toks[i]) >= r.params.max_tokens:
                    done[i] = True
            if all(done):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=attn.device)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt.to(self.device), attention_mask=attn, position_ids=last_pos[:, None],
                             past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
        return [TurnOutput(toks[i], lps[i], reason[i], self.version) for i in range(B)]
