"""The OPD teacher's per-turn scores over a key/value cache (rl/teacher_worker.TurnScorer).

The reference is policy.score_tokens: a fresh forward over the turn's whole prefix, what the teacher
sent before it kept caches. float64 agrees to 1e-12; the forward covers each token once.
"""

import random

import pytest
import torch

from tsrl_cli.policy import build_tiny_model, score_tokens
from tsrl_cli.rl.teacher_worker import TurnScorer

# one trajectory: prompt 0..9, turn 0 [10, 15), tool output 15..19, turn 1 [20, 26), turn 2 right after
# the cached prefix [26, 30) (its first token's logits are the cached ones), tool 30..33, turn 3 [34, 40)
SPANS = [(10, 15), (20, 26), (26, 30), (34, 40)]


def _ids(model, n, seed):
    rng = random.Random(seed)
    return [rng.randrange(model.config.vocab_size) for _ in range(n)]


def test_cached_turn_scores_equal_the_prefix_forward(teacher64):
    ids = _ids(teacher64, 40, 0)
    scorer = TurnScorer(teacher64)
    covered = 0
    for s, e in SPANS:
        got, n = scorer.score("a", ids[:e], s, e)
        want = score_tokens(teacher64, ids[:e], s, e)
        assert len(got) == e - s
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                              rtol=0, atol=1e-12)
        covered += n
    assert covered == 40  # every token once; a fresh forward per turn covers 15 + 26 + 30 + 40 = 111
    scorer.close("a")
    assert scorer.cached_tokens() == 0


def test_interleaved_trajectories_and_a_prefix_that_does_not_extend_the_cache(teacher64):
    a, b = _ids(teacher64, 40, 1), _ids(teacher64, 40, 2)
    scorer = TurnScorer(teacher64)
    for s, e in SPANS[:2]:  # two trajectories' turns interleaved keep separate caches
        for key, ids in (("a", a), ("b", b)):
            got, _ = scorer.score(key, ids[:e], s, e)
            assert torch.allclose(torch.tensor(got), torch.tensor(score_tokens(teacher64, ids[:e], s, e)),
                                  rtol=0, atol=1e-12)
    c = list(a)
    c[3] = (c[3] + 1) % teacher64.config.vocab_size  # "a" again, but its prefix differs: scored from scratch
    got, n = scorer.score("a", c[:30], 26, 30)
    assert n == 30
    assert torch.allclose(torch.tensor(got), torch.tensor(score_tokens(teacher64, c[:30], 26, 30)), rtol=0, atol=1e-12)


def test_position_zero_and_empty_turns():
    model = build_tiny_model(seed=3, dtype=torch.float64)
    ids = _ids(model, 12, 3)
    scorer = TurnScorer(model)
    assert scorer.score("a", ids[:4], 4, 4) == ([], 0)
    got, n = scorer.score("a", ids[:6], 0, 6)  # position 0 predicts nothing, as in score_tokens
    assert got[0] == 0.0 and n == 6
    assert torch.allclose(torch.tensor(got), torch.tensor(score_tokens(model, ids[:6], 0, 6)), rtol=0, atol=1e-12)


def test_float32_within_rounding(tmp_path):
    model = build_tiny_model(seed=4, dtype=torch.float32)
    ids = _ids(model, 40, 4)
    scorer = TurnScorer(model)
    for s, e in SPANS:
        got, _ = scorer.score("a", ids[:e], s, e)
        assert torch.allclose(torch.tensor(got), torch.tensor(score_tokens(model, ids[:e], s, e)), rtol=0, atol=1e-5)


def test_caches_beyond_the_byte_cap_are_dropped_oldest_first(teacher64):
    ids = _ids(teacher64, 40, 5)
    scorer = TurnScorer(teacher64, max_bytes=0)
    scorer.score("a", ids[:15], 10, 15)
    scorer.score("b", ids[:15], 10, 15)
    assert list(scorer.open) == ["b"]  # the newest stays (it is needed for its next turn)
    got, n = scorer.score("a", ids[:26], 20, 26)  # "a" was dropped: scored from scratch, same numbers
    assert n == 26
    want = score_tokens(teacher64, ids[:26], 20, 26)
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_forwards_score_the_same_and_never_run_longer_than_a_chunk(teacher64, chunk):
    """Each forward covers at most `chunk` positions (a chunk attends to the cached keys before it), and every
    turn's scores equal the fresh prefix forward's, from scratch and from the cache alike."""
    ids = _ids(teacher64, 40, 6)
    want = {(s, e): score_tokens(teacher64, ids[:e], s, e) for s, e in SPANS}
    lengths = []
    hook = teacher64.register_forward_pre_hook(lambda mod, args, kw: lengths.append(kw["input_ids"].shape[1]),
                                               with_kwargs=True)
    try:
        scorer = TurnScorer(teacher64, chunk_tokens=chunk)
        got = {(s, e): scorer.score("a", ids[:e], s, e)[0] for s, e in SPANS}
        fresh, n = TurnScorer(teacher64, chunk_tokens=chunk).score("b", ids[:40], 34, 40)  # one long from-scratch turn
    finally:
        hook.remove()
    for span in SPANS:
        assert torch.allclose(torch.tensor(got[span]), torch.tensor(want[span]), rtol=0, atol=1e-12)
    assert n == 40 and torch.allclose(torch.tensor(fresh), torch.tensor(want[SPANS[-1]]), rtol=0, atol=1e-12)
    assert max(lengths) <= chunk and sum(lengths) == 40 + 40  # every position once per scorer


def test_room_is_made_before_the_forward_and_the_kept_logits_are_one_row(teacher64):
    """The caches alive during a forward (the others kept, and this trajectory's e tokens) fit max_bytes: the
    least recently used are dropped before, not after, the forward; the row kept to predict a trajectory's next
    token is a (1, 1, V) copy, not a view holding its chunk's logits."""
    scorer = TurnScorer(teacher64, max_bytes=0)
    scorer.max_bytes = 40 * scorer.bytes_per_token  # room for 40 tokens in all
    alive = []
    hook = teacher64.register_forward_pre_hook(lambda mod, args: alive.append(scorer.cached_tokens()))
    try:
        a, b = _ids(teacher64, 40, 7), _ids(teacher64, 40, 8)
        scorer.score("a", a[:15], 10, 15)
        scorer.score("b", b[:15], 10, 15)
        assert list(scorer.open) == ["a", "b"]  # 30 tokens: both fit
        alive.clear()
        scorer.score("a", a[:30], 26, 30)  # a grows to 30: with b's 15 that is 45 > 40, so b goes first
        assert alive == [0] and list(scorer.open) == ["a"]  # nothing else cached while a's forward ran (a's own
        # cache is out of `open` while it grows)
    finally:
        hook.remove()
    row = scorer.open["a"].last_logits
    V = teacher64.config.vocab_size
    assert row.shape == (1, 1, V) and row.untyped_storage().nbytes() == V * row.element_size()
