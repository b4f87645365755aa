"""The teacher's per-turn scores equal the full-sequence log-probs of the turn's tokens."""

import random

import torch

from tsrl_cli.core.losses import token_logprobs
from tsrl_cli.rl.teacher_worker import score_turn


def test_score_turn_matches_full_forward(teacher64):
    rng = random.Random(0)
    ids = [rng.randrange(teacher64.config.vocab_size) for _ in range(40)]
    with torch.no_grad():
        full = token_logprobs(teacher64(input_ids=torch.tensor([ids])).logits, torch.tensor([ids]))[0]
    for s, e in ((5, 12), (20, 21), (30, 40)):
        got = torch.tensor(score_turn(teacher64, ids, s, e), dtype=torch.float64)
        assert torch.allclose(got, full[s:e], rtol=0, atol=1e-12)
