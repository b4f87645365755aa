"""The learner's memory options, each against the lazy reference on the plain model (float64):

- learner.activation_checkpointing: each decoder layer recomputed in the backward (the layers really run twice);
- learner.logits_chunk_tokens: the LM head and log-softmax a few positions at a time (no full-vocabulary
  tensor longer than that is ever created, counted on every op's output);
both with GRPO and OPD, KL and entropy terms (two passes of one forward), micro-batched and per arrival.
"""

import copy
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tsrl_cli.config import LossConfig
from tsrl_cli.policy import build_tiny_model, checkpoint_activations, forward_logprobs, score_tokens
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.verify import random_rollouts

VOCAB = 128  # build_tiny_model's default vocabulary


@pytest.fixture(scope="module")
def scored(tiny64, teacher64):
    ro = random_rollouts(VOCAB, 3, 4, 5)
    rng = random.Random(5)
    for r in ro:
        r.reward = float(rng.random() < 0.5)
        r.teacher_logprobs = score_tokens(teacher64, r.input_ids)
        r.ref_logprobs = score_tokens(teacher64, r.input_ids)  # any fixed reference will do
    return ro


def _obj(kind):
    return Objective(kind, LossConfig(kl_coef=0.1, kl_type="k3", entropy_coef=0.01, loss_agg="seq-mean-token-mean"))


def _streamed(model, rollouts, obj, seed, **kw):
    """Arrivals in a random order, backwarded as they come (max_items 1) or micro-batched (None)."""
    order = list(rollouts)
    random.Random(seed).shuffle(order)
    sl = StreamLearner(model, obj, Counter(r.group_id for r in rollouts), **kw)
    for i, r in enumerate(order):
        if obj.kind == "grpo":
            sl.on_trajectory(r)
        else:
            for k in range(len(r.turn_spans)):
                sl.on_turn(r, k)
        if i % 3 == 2:
            sl.drain()
    sl.drain()
    return sl.close_round()


def _max_rel(got, want):
    return max(float((g - w).abs().max() / w.abs().max().clamp(min=1e-300)) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", ["grpo", "opd"])
@pytest.mark.parametrize("feature", ["checkpointing", "chunked", "both"])
@pytest.mark.parametrize("max_items", [1, None], ids=["per-arrival", "micro-batched"])
def test_memory_options_equal_lazy_float64(tiny64, scored, kind, feature, max_items):
    obj = _obj(kind)
    params = [p for p in tiny64.parameters() if p.requires_grad]
    ref = torch.autograd.grad(lazy_loss(tiny64, scored, obj), params)  # the plain model, unchunked
    model = copy.deepcopy(tiny64)
    if feature != "chunked":
        assert checkpoint_activations(model) == 2
    chunk = 7 if feature != "checkpointing" else None  # 7 positions: chunks straddle rows and turns
    got = _streamed(model, scored, obj, seed=len(feature), max_items=max_items, chunk_tokens=chunk)
    assert max(float(g.abs().max()) for g in got) > 1e-4
    assert _max_rel(got, ref) <= 1e-10
    assert _max_rel(torch.autograd.grad(lazy_loss(model, scored, obj, chunk_tokens=chunk),
                                        [p for p in model.parameters() if p.requires_grad]), ref) <= 1e-10


def test_checkpointing_recomputes_every_layer_in_the_backward(tiny64, monkeypatch):
    """With it on, each layer's MLP runs twice per forward and backward (forward, then the recomputation)."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    mlp = type(tiny64.model.layers[0].mlp)
    calls = []
    real = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda self, x: calls.append(1) or real(self, x))
    counts = {}
    for on in (False, True):
        model = copy.deepcopy(tiny64)
        if on:
            checkpoint_activations(model)
        calls.clear()
        forward_logprobs(model, ids)[0].sum().backward()
        counts[on] = len(calls)
    assert counts == {False: 2, True: 4}
    twin = copy.deepcopy(model)  # a deepcopy (the group's host copy) rebinds the checkpointed forward
    assert twin.model.layers[0].forward.__self__ is twin.model.layers[0]


class _VocabWidth(TorchDispatchMode):
    """The most positions any op's output holds along a full-vocabulary last dimension."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.vocab, self.hidden, self.widest = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            # new storage only (a view allocates nothing), and not the head's (hidden, V) weight gradient
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and not t._is_view()
                    and tuple(t.shape) != (self.hidden, self.vocab)):
                self.widest = max(self.widest, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [None, 5])
def test_no_full_vocabulary_tensor_wider_than_the_chunk(chunk):
    """Forward and backward of log-probs and entropies: with chunk None (the positive control) the logits
    of every position exist at once; with a chunk of 5 no op ever makes a (more than 5, V) tensor."""
    vocab = 211  # apart from every other width of the model (its MLP is 128 wide, as tiny64's vocabulary)
    model = build_tiny_model(seed=0, dtype=torch.float64, vocab_size=vocab)
    ids = torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(1))
    mode = _VocabWidth(vocab, model.config.hidden_size)
    with mode:
        lp, ent = forward_logprobs(model, ids, entropy=True, chunk_tokens=chunk)
        (lp.sum() + ent.sum()).backward()
    assert mode.widest == (3 * 20 if chunk is None else chunk)
