"""The copy curriculum (tsrl_cli/embedded/policy/copy_curriculum.py): drill batches are copies, names are
single-word letter tokens, a phase-C branch after `fork` is exactly a fresh run's phase C, and runs
are deterministic for a seed."""

import random

import pytest
import torch

from tsrl_cli.embedded.policy.copy_curriculum import (
    CopyCurriculum,
    CopyTrainer,
    drill_ids,
    family_demos,
    letter_tokens,
    random_name,
)
from tsrl_cli.policy import build_tiny_model
from tsrl_cli.tokenizer import train_chatml_tokenizer

torch.set_num_threads(1)
TINY = CopyCurriculum(drill_steps=3, family_steps=4, drill_batch=4, family_batch=2, sft_batch=2, schedule_epochs=2)


@pytest.fixture(scope="module")
def tok():
    corpus = ["Make `plum.sh` executable.\nchmod +x plum.sh\ncat notes.txt | wc -l > count.txt",
              "THOUGHT: This does what the task asks.\n```bash\nsort -u words.txt > out.txt\n```"] * 20
    return train_chatml_tokenizer(corpus, vocab_size=300, word_stable=True)


def demos(n: int, tag: str) -> list[dict]:
    return [{"task_id": f"{tag}{i}", "kind": "terminal", "instruction": f"Make `f{i}.sh` executable.",
             "messages": [{"role": "assistant", "content": f"THOUGHT: ok\n```bash\nchmod +x f{i}.sh\n```"}]}
            for i in range(n)]


def fresh(tok, seed=0) -> CopyTrainer:
    model = build_tiny_model(seed, vocab_size=len(tok), hidden=32, layers=1, max_positions=1024,
                             pad_id=tok.pad_token_id, eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return CopyTrainer(model, tok, TINY, seed)


def same(a, b) -> bool:
    pairs = zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


def test_drill_batch_is_a_copy(tok):
    alpha, ids = letter_tokens(tok)
    assert alpha and all(t.isalpha() and t.islower() for t in alpha)
    sep = tok.convert_tokens_to_ids("<|im_start|>")
    x, n = drill_ids(random.Random(1), ids, sep, 5)
    assert 6 <= n <= 16 and x.shape == (5, 2 * n + 1)
    assert (x[:, n] == sep).all() and torch.equal(x[:, :n], x[:, n + 1:])


def test_drill_loss_is_the_cross_entropy_of_the_copy(tok):
    t = fresh(tok)
    state = t.rng.getstate()
    loss = t.drill_loss()
    t.rng.setstate(state)  # the same batch again, scored by hand
    x, n = drill_ids(t.rng, t.alpha_ids, t.sep, TINY.drill_batch)
    logp = torch.log_softmax(t.model(input_ids=x).logits.double(), -1)
    want = -torch.stack([logp[b, n + j, x[b, n + 1 + j]] for b in range(x.shape[0]) for j in range(n)]).mean()
    assert abs(loss.item() - want.item()) < 1e-5


def test_names_and_family_demos(tok):
    alpha, _ = letter_tokens(tok)
    rng = random.Random(3)
    for _ in range(50):
        w = random_name(rng, alpha)
        assert 3 <= len(w) <= 12 and w.isalpha()
    batch = family_demos(random.Random(4), alpha, 3)
    assert len(batch) == 3 and all("```bash\n" in d["messages"][0]["content"] for d in batch)
    assert family_demos(random.Random(4), alpha, 3) == batch  # seeded


def test_fork_branches_equal_fresh_runs_and_are_deterministic(tok):
    a_demos, b_demos = demos(5, "a"), demos(3, "b")
    a = fresh(tok)
    a.pretrain()
    b = a.fork()
    assert b.tok is a.tok and same(a, b)
    a.sft(a_demos, 1)
    b.sft(b_demos, 2)
    assert not same(a, b)
    c = fresh(tok)  # the independent reference for each branch: a fresh run of that branch alone
    c.pretrain()
    c.sft(a_demos, 1)
    d = fresh(tok)
    d.pretrain()
    d.sft(b_demos, 2)
    assert same(a, c) and same(b, d)
    e = fresh(tok, seed=1)
    e.pretrain()
    e.sft(a_demos, 1)
    assert not same(a, e)  # the seed matters
