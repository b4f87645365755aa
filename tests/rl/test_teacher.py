"""The OPD teacher's per-turn scores over a key/value cache (rl/teacher_worker.TurnScorer).

The reference is policy.score_tokens: a fresh forward over the turn's whole prefix, what the teacher
sent before it kept caches. float64 agrees to 1e-12; the forward covers each token once.
"""

import random

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
    assert torch.allclose(torch.tensor(got), torch.tensor(score_tokens(teacher64, ids[:26], 20, 26)), rtol=0, atol=1e-12)
