"""Peak memory of the loss's LM head, log-softmax and entropy, unchunked against chunked (learner.logits_chunk_tokens).

One forward and backward of sum(c_lp * log p(token)) + sum(c_ent * H) from random (T, hidden) last hidden
states through a (V, hidden) LM head, measured by PyTorch's MemTracker (torch.distributed._tools.mem_tracker,
which counts every tensor storage alive; it works on the CPU): the peak over the whole step, minus the
inputs and the head's weight, which both paths hold. The two paths' gradients are compared too.

    .venv/bin/python experiments/logits_memory.py                              # T 1024, hidden 512, V 151,936
    .venv/bin/python experiments/logits_memory.py --tokens 4096 --hidden 1024 --chunk 1024 --json

Prints one JSON document with --json: per path the peak bytes above the inputs, the seconds, and the
largest full-vocabulary float32 tensor the path may hold (T x V x 4, or chunk x V x 4).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from tsrl_cli.core.losses import chunked_token_logprobs, token_entropy, token_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def step(h, w, ids, c_lp, c_ent, chunk):
    if chunk is None:
        logits = torch.nn.functional.linear(h, w)
        lp, ent = token_logprobs(logits, ids), token_entropy(logits)
    else:
        lp, ent = chunked_token_logprobs(h, w, None, ids, chunk, entropy=True)
    loss = (c_lp * lp).sum() + (c_ent * ent).sum()
    return torch.autograd.grad(loss, [h, w])


def measure(h, w, ids, c_lp, c_ent, chunk) -> tuple[int, float, tuple]:
    """(peak bytes above what exists before the step, seconds, the gradients)."""
    mt = MemTracker()
    mt.track_external(h, w)  # the inputs count in the baseline, not as the step's activations
    with mt:
        base = mt.get_tracker_snapshot("current")
        t0 = time.perf_counter()
        grads = step(h, w, ids, c_lp, c_ent, chunk)
        s = time.perf_counter() - t0
        peak = mt.get_tracker_snapshot("peak")

    def total(snap) -> int:
        return sum(v.get("Total", 0) for v in snap.values())

    return total(peak) - total(base), s, grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="positions T of one row")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151936, help="V (Qwen3: 151,936)")
    ap.add_argument("--chunk", type=int, default=256, help="learner.logits_chunk_tokens")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    dt = DTYPES[a.dtype]
    h = (torch.randn(1, a.tokens, a.hidden) * 0.5).to(dt).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden) * 0.02).to(dt).requires_grad_()
    ids = torch.randint(0, a.vocab, (1, a.tokens))
    c_lp, c_ent = torch.randn(1, a.tokens), torch.randn(1, a.tokens)
    out = {"tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab, "chunk": a.chunk, "dtype": a.dtype,
           "inputs_bytes": sum(t.numel() * t.element_size() for t in (h, w)),
           "weight_grad_bytes": w.numel() * w.element_size()}  # held by both paths: the head's gradient
    grads = {}
    for name, chunk in (("unchunked", None), ("chunked", a.chunk)):
        peak, s, grads[name] = measure(h, w, ids, c_lp, c_ent, chunk)
        n = a.tokens - 1 if chunk is None else min(chunk, a.tokens - 1)
        out[name] = {"peak_bytes_above_inputs": peak, "seconds": round(s, 2),
                     "largest_vocab_tensor_bytes": n * a.vocab * 4}
    out["ratio"] = out["unchunked"]["peak_bytes_above_inputs"] / out["chunked"]["peak_bytes_above_inputs"]
    out["grad_max_rel_diff"] = max(float((x.float() - y.float()).abs().max() / y.float().abs().max())
                                   for x, y in zip(grads["chunked"], grads["unchunked"], strict=True))
    if a.json:
        print(json.dumps(out))
        return
    for k in ("unchunked", "chunked"):
        r = out[k]
        print(f"{k:>9}: peak {r['peak_bytes_above_inputs'] / 2**20:8.1f} MiB above the inputs, {r['seconds']:.1f} s")
    print(f"ratio {out['ratio']:.1f}x; gradients agree to {out['grad_max_rel_diff']:.1e} relative")


if __name__ == "__main__":
    main()
