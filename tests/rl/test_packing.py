"""The learner's work where the loss is: rows end at their last scored token, the LM head runs over scored
positions only, and packed micro-batches (rows end to end, no padding) equal the lazy batch in float64."""

import random
from collections import Counter

import pytest
import torch
from grad_compare import grads, rel

from tsrl_cli.config import LossConfig
from tsrl_cli.core import losses
from tsrl_cli.policy import forward_logprobs, score_tokens
from tsrl_cli.rl.arrivals import Arrival
from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss
from tsrl_cli.rollouts import Rollout
from tsrl_cli.verify import random_rollouts


@pytest.fixture(scope="module")
def scored_rollouts(tiny64, teacher64):
    ro = random_rollouts(128, 4, 5, seed=2)
    for r in ro:
        r.teacher_logprobs = score_tokens(teacher64, r.input_ids)
        r.ref_logprobs = score_tokens(teacher64, r.input_ids)
        r.input_ids += [7, 8, 9]  # a last tool output after the last model turn: no loss there
        r.loss_mask += [0, 0, 0]
        r.teacher_logprobs += [0.0] * 3
        r.ref_logprobs += [0.0] * 3
    return ro


@pytest.mark.parametrize("kind,loss", [("grpo", {}), ("grpo", {"kl_coef": 0.1, "entropy_coef": 0.01}),
                                       ("opd", {"loss_agg": "seq-mean-token-mean"}), ("opd", {"kl_coef": 0.05})])
@pytest.mark.parametrize("packed", [False, True])
def test_queued_batches_equal_the_lazy_batch(tiny64, scored_rollouts, kind, loss, packed):
    obj = Objective(kind, LossConfig(**loss))
    ref = grads(tiny64, lazy_loss(tiny64, scored_rollouts, obj))
    sl = StreamLearner(tiny64, obj, Counter(r.group_id for r in scored_rollouts), packed=packed)
    for r in random.Random(4).sample(scored_rollouts, len(scored_rollouts)):
        (sl.on_trajectory if kind == "grpo" else sl.on_opd_trajectory)(r)
    sl.drain()
    assert rel(sl.close_round(), ref) <= 1e-9
    real = sum(b.real for b in sl.batches)
    assert real == sum(len(r.input_ids) - 3 for r in scored_rollouts)  # every row ends at its last scored token
    computed = sum(b.tokens for b in sl.batches)
    assert computed == real if packed else computed > real  # packed: no padding at all


def test_a_row_ends_at_its_last_scored_token():
    r = Rollout("g", 0, list(range(12)), [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0], 1.0, [(3, 5), (7, 9)])
    assert Arrival(r, None).end == 9 and Arrival(r, 0).end == 5 and Arrival(r, 1).end == 9
    assert Arrival(Rollout("g", 1, [1, 2, 3], [0, 0, 0], 0.0, []), None).end == 3  # nothing scored: whole


def test_the_head_runs_over_scored_positions_only(tiny64, monkeypatch):
    ids = torch.randint(0, 64, (2, 16))
    scored = torch.zeros(2, 16, dtype=torch.bool)
    scored[0, 4:7] = scored[1, 9:16] = True
    rows = []
    real_apply = losses._ChunkedHead.apply
    monkeypatch.setattr(losses._ChunkedHead, "apply", lambda h, *a: rows.append(h.shape[0]) or real_apply(h, *a))
    lp, ent = forward_logprobs(tiny64, ids, entropy=True, scored_B_T=scored)
    assert rows == [10]  # 3 + 7 scored positions, not 2 x 15
    full, full_ent = forward_logprobs(tiny64, ids, entropy=True)  # the positive control: every position
    assert (lp - full * scored).abs().max() <= 1e-14 and (ent - full_ent * scored).abs().max() <= 1e-14
    params = [p for p in tiny64.parameters() if p.requires_grad]
    a = torch.autograd.grad((lp * scored).sum() + ent.sum(), params, allow_unused=True)
    b = torch.autograd.grad((full * scored).sum() + (full_ent * scored).sum(), params, allow_unused=True)
    assert max((x - y).abs().max().item() for x, y in zip(a, b, strict=True) if x is not None) <= 1e-12


def test_packed_rows_attend_within_themselves(tiny64):
    """Position ids restarting at 0 per row: a packed row's log-probs are its own, whatever precedes it."""
    a, b = [3, 5, 7, 9, 11], [2, 4, 6]
    packed = torch.tensor([a + b])
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    lp, _ = forward_logprobs(tiny64, packed, position_ids_B_T=pos)
    alone_a, _ = forward_logprobs(tiny64, torch.tensor([a]))
    alone_b, _ = forward_logprobs(tiny64, torch.tensor([b]))
    assert (lp[0, 1:5] - alone_a[0, 1:]).abs().max() <= 1e-12
    assert (lp[0, 6:] - alone_b[0, 1:]).abs().max() <= 1e-12
    joined, _ = forward_logprobs(tiny64, packed)  # the control: one sequence, b attends to a
    assert (joined[0, 6:] - alone_b[0, 1:]).abs().max() > 1e-6


@pytest.mark.parametrize("packing,device,attn,packed", [
    ("auto", "cpu", "sdpa", False),  # a dense mask over the packed length: slower than padding on the CPU
    ("auto", "cuda:0", "sdpa", False),
    ("auto", "cuda:0", "flash_attention_2", True),  # varlen attention: packed rows cost their own lengths
    ("auto", "cuda:0", "flex_attention", True),
    ("on", "cpu", "sdpa", True),
    ("off", "cuda:0", "flash_attention_2", False),
])
def test_auto_packs_where_the_attention_runs_packed_rows_natively(packing, device, attn, packed):
    from types import SimpleNamespace

    from tsrl_cli.rl.learner import packs

    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn))
    assert packs(packing, device, model) is packed
