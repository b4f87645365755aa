"""Chunked LM head log-probs and entropies against the unchunked reference (core.losses), float64 and bf16.

The reference is the plain path: logits = hidden @ W.T + b, then token_logprobs / token_entropy, differentiated
by autograd. Every chunk size (1, one that straddles rows, the whole batch, more than the batch) must give
its values and its gradients with respect to the hidden states, the weight and the bias.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tsrl_cli.core.losses import chunked_token_logprobs, token_entropy, token_logprobs

B, T, H, V = 3, 7, 5, 11


def _inputs(dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    # one loss that weighs every position differently, through both the log-probs and the entropies
    c_lp = torch.randn(B, T, generator=g, dtype=torch.float64)
    c_ent = torch.randn(B, T, generator=g, dtype=torch.float64)
    return h, w, b, ids, c_lp, c_ent


def _grads(loss, *ts):
    return torch.autograd.grad(loss, [t for t in ts if t is not None])


def _reference(h, w, b, ids, entropy):
    logits = torch.nn.functional.linear(h, w, b)
    return token_logprobs(logits, ids), (token_entropy(logits) if entropy else None)


@pytest.mark.parametrize("chunk", [1, 4, 6, B * (T - 1), 1000])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_float64_values_and_gradients_equal_unchunked(chunk, entropy, bias):
    h, w, b, ids, c_lp, c_ent = _inputs(torch.float64, bias)
    ref_lp, ref_ent = _reference(h, w, b, ids, entropy)
    lp, ent = chunked_token_logprobs(h, w, b, ids, chunk, entropy)
    assert lp.dtype == torch.float64 and lp.shape == (B, T) and (lp[:, 0] == 0).all()
    assert torch.allclose(lp, ref_lp, rtol=1e-13, atol=1e-13)
    loss_ref = (c_lp * ref_lp).sum() + ((c_ent * ref_ent).sum() if entropy else 0)
    loss = (c_lp * lp).sum() + ((c_ent * ent).sum() if entropy else 0)
    if entropy:
        assert torch.allclose(ent, ref_ent, rtol=1e-13, atol=1e-13)
    else:
        assert ent is None
    for got, want in zip(_grads(loss, h, w, b), _grads(loss_ref, h, w, b), strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-13), (got - want).abs().max()


def test_entropy_alone_and_two_backwards_of_one_forward():
    """The learner's two passes (the surrogate, then the entropy term) backward one forward with retain_graph."""
    h, w, b, ids, c_lp, c_ent = _inputs(torch.float64)
    lp, ent = chunked_token_logprobs(h, w, b, ids, 5, True)
    first = torch.autograd.grad((c_lp * lp).sum(), [h, w, b], retain_graph=True)
    second = torch.autograd.grad((c_ent * ent).sum(), [h, w, b])
    want_all = [*_grads((c_lp * _reference(h, w, b, ids, False)[0]).sum(), h, w, b),
                *_grads((c_ent * _reference(h, w, b, ids, True)[1]).sum(), h, w, b)]
    for got, want in zip([*first, *second], want_all, strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)


def test_gradient_check_catches_a_wrong_logit_gradient(monkeypatch):
    """Positive control: the comparison above fails when the entropy's gradient drops its H term."""
    import tsrl_cli.core.losses as ch

    h, w, b, ids, _, c_ent = _inputs(torch.float64)
    want = _grads((c_ent * _reference(h, w, b, ids, True)[1]).sum(), h)[0]
    real = ch.logit_grad
    monkeypatch.setattr(ch, "logit_grad", lambda logp, t, g_lp, g_ent, ent: real(logp, t, g_lp, g_ent, ent * 0))
    _, ent = chunked_token_logprobs(h, w, b, ids, 4, True)
    got = _grads((c_ent * ent).sum(), h)[0]
    assert not torch.allclose(got, want, rtol=1e-6, atol=1e-8)


def test_bf16_keeps_the_upcast_semantics():
    """bf16 hidden and weight: the log-softmax runs in float32 (as token_logprobs upcasts), the gradients come
    back in bf16; both agree with the unchunked path to bf16's resolution."""
    h, w, _, ids, c_lp, c_ent = _inputs(torch.bfloat16, bias=False)
    ref_lp, ref_ent = _reference(h, w, None, ids, True)
    lp, ent = chunked_token_logprobs(h, w, None, ids, 4, True)
    assert lp.dtype == ent.dtype == torch.float32 == ref_lp.dtype
    assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-5) and torch.allclose(ent, ref_ent, rtol=0, atol=1e-5)
    got = _grads((c_lp * lp).sum() + (c_ent * ent).sum(), h, w)
    want = _grads((c_lp * ref_lp).sum() + (c_ent * ref_ent).sum(), h, w)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert (g.float() - r.float()).abs().max() <= 2e-2 * r.float().abs().max()


def test_frozen_head_gets_no_gradient_and_bad_chunk_is_refused():
    h, w, _, ids, c_lp, _ = _inputs(torch.float64)
    w.requires_grad_(False)
    lp, _ = chunked_token_logprobs(h, w, None, ids, 3)
    (gh,) = torch.autograd.grad((c_lp * lp).sum(), [h])  # LoRA: the head is frozen, only the hidden states
    assert torch.allclose(gh, _grads((c_lp * _reference(h, w, None, ids, False)[0]).sum(), h)[0], rtol=1e-12)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(h, w, None, ids, 0)


class MatmulDtypes(TorchDispatchMode):
    """Records (op, input dtypes) of every matrix product dispatched while active: F.linear and @ reach the
    dispatcher as mm/addmm, the batched ones as bmm/baddbmm; addmm_ is the in-place one."""

    PRODUCTS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_")

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            mats = args[1:3] if name.startswith(("addmm", "baddbmm")) else args[:2]
            self.seen.append((name, tuple(m.dtype for m in mats)))
        return func(*args, **(kwargs or {}))


def _head_matmuls(dtype, bias=False) -> list[tuple[str, tuple[torch.dtype, ...]]]:
    """The products of one forward and one backward (log-probs and entropies, gradients for h, W and b)."""
    h, w, b, ids, c_lp, c_ent = _inputs(dtype, bias)
    with MatmulDtypes() as rec:
        lp, ent = chunked_token_logprobs(h, w, b, ids, 4, True)
        _grads((c_lp * lp).sum() + (c_ent * ent).sum(), h, w, b)
    return rec.seen


def test_a_bf16_head_multiplies_in_bf16_forward_and_backward():
    """Every matmul of the chunked head (the chunks' logits, their recomputation, dhidden and dW) takes bf16
    inputs for a bf16 model: no float32 GEMM. 18 positions in chunks of 4: 5 chunks, so 5 logits products in the
    forward, 5 more and 5 dhidden in the backward, and dW's products (on the CPU blocks of as many of the 11
    vocabulary rows as the chunk has positions: 3 for each chunk of 4, 6 for the last chunk of 2)."""
    for bias in (False, True):
        seen = _head_matmuls(torch.bfloat16, bias)
        assert len(seen) == 5 + 5 + 5 + 4 * 3 + 6, seen
        assert {dt for _, dts in seen for dt in dts} == {torch.bfloat16}, seen


def test_control_the_float32_weight_gradient_is_seen_as_float32_matmuls(monkeypatch):
    """Positive control: dW as dz^T @ hidden with both upcast to float32, each chunk summed by one float32 GEMM,
    shows up as float32 products beside the bf16 ones."""
    import tsrl_cli.core.losses as losses

    monkeypatch.setattr(losses, "weight_grad_into", lambda dw, dz, h: dw.addmm_(dz.float().t(), h.float()))
    seen = _head_matmuls(torch.bfloat16)
    assert [op for op, dts in seen if dts == (torch.float32, torch.float32)] == ["addmm_"] * 5  # one per chunk


def test_a_float64_head_keeps_float64_matmuls():
    seen = _head_matmuls(torch.float64, bias=True)
    assert seen and {dt for _, dts in seen for dt in dts} == {torch.float64}, seen


def test_bf16_weight_gradient_sums_the_bf16_products_in_float32():
    """dW of a bf16 head against the float64 sum of the same bf16 inputs (the logit gradient rounded to bf16, as
    autograd's backward of the upcast rounds it): within bf16's rounding of each block's product, far inside
    the 2e-2 of the unchunked comparison above."""
    h, w, _, ids, c_lp, _ = _inputs(torch.bfloat16, bias=False)
    lp, _ = chunked_token_logprobs(h, w, None, ids, 4)
    (gw,) = _grads((c_lp * lp).sum(), w)
    logits = torch.nn.functional.linear(h.detach()[:, :-1].reshape(-1, H), w.detach()).double()
    p = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(ids[:, 1:].reshape(-1), V).double()
    dz = (c_lp[:, 1:].reshape(-1, 1) * (onehot - p)).to(torch.bfloat16).double()
    want = dz.t() @ h.detach()[:, :-1].reshape(-1, H).double()
    assert gw.dtype == torch.bfloat16
    assert (gw.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
