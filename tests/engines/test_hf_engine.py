"""The hf engine: per-request seeds, batch invariance, log-probs, weight updates."""

import torch

from tsrl_cli.core.losses import token_logprobs
from tsrl_cli.engines.hf import HFEngine, sample_token
from tsrl_cli.engines.protocol import SamplingParams, TurnRequest, request_seed
from tsrl_cli.policy import build_tiny_model


def requests(n=6, **kw):
    return [TurnRequest([5 + i, 9, 11, 13, 2 * i + 1][: 2 + i % 4], SamplingParams(max_tokens=16, seed=100 + i, **kw))
            for i in range(n)]


def test_same_request_same_tokens_alone_or_batched_float64():
    eng = HFEngine(build_tiny_model(0, torch.float64))
    reqs = requests()
    alone = [eng.generate([r])[0] for r in reqs]
    batched = eng.generate(reqs)
    shuffled = eng.generate(list(reversed(reqs)))[::-1]
    other_load = eng.generate(reqs[:2] + requests(4, temperature=0.7)[2:])[:2]
    for a, b, c in zip(alone, batched, shuffled, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-12
    assert [o.token_ids for o in other_load] == [a.token_ids for a in alone[:2]]
    assert len({tuple(a.token_ids) for a in alone}) > 1  # different seeds, different samples


def test_batch_invariant_mode_is_bitwise_in_float32():
    eng = HFEngine(build_tiny_model(0, torch.float32), batch_invariant=True)
    reqs = requests()
    alone = [eng.generate([r])[0] for r in reqs]
    for a, b in zip(alone, eng.generate(reqs), strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_logprobs_are_the_trainers_logprobs():
    model = build_tiny_model(0, torch.float64)
    eng = HFEngine(model)
    r = requests(1)[0]
    o = eng.generate([r])[0]
    ids = torch.tensor([r.context_ids + o.token_ids])
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=ids).logits, ids)[0, len(r.context_ids):]
    assert torch.allclose(lp, torch.tensor(o.logprobs, dtype=torch.float64), atol=1e-6)


def test_stop_tokens_greedy_and_top_p():
    eng = HFEngine(build_tiny_model(0, torch.float32))
    g = eng.generate([TurnRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8))])[0]
    first = g.token_ids[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,))
    s = eng.generate([TurnRequest([1, 2, 3], greedy)])[0]
    assert s.token_ids == [first] and s.finish_reason == "stop"
    assert g.finish_reason == "length" and len(g.token_ids) == 8
    logits = torch.tensor([0.0, 10.0, 9.9, -5.0])
    picks = {sample_token(logits, SamplingParams(top_p=0.5), torch.Generator().manual_seed(i)) for i in range(50)}
    assert picks == {1}  # top-p 0.5 keeps only the most likely token


def test_update_weights_changes_samples_and_version():
    src = build_tiny_model(0, torch.float32)
    eng = HFEngine(build_tiny_model(1, torch.float32))
    r = requests(1)[0]
    before = eng.generate([r])[0].token_ids
    eng.update_weights(src.state_dict(), version=3)
    after = eng.generate([r])[0]
    assert after.policy_version == 3
    assert after.token_ids == HFEngine(src).generate([r])[0].token_ids
    assert before != after.token_ids


def test_request_seed_is_stable():
    assert request_seed(42, 1, "task", 0, 2) == request_seed(42, 1, "task", 0, 2)
    assert request_seed(42, 1, "task", 0, 2) != request_seed(42, 1, "task", 1, 2)
