"""tsrl_cli.policy: the one loader (every spec kind, dtype, errors), the saver, and token log-probs."""

import random

import pytest
import torch

from tsrl_cli.core.losses import token_logprobs
from tsrl_cli.policy import score_tokens


def test_score_tokens_of_a_turn_match_the_full_forward(teacher64):
    """What the OPD teacher sends per turn: the log-probs of the turn's tokens, from the prefix alone."""
    rng = random.Random(0)
    ids = [rng.randrange(teacher64.config.vocab_size) for _ in range(40)]
    with torch.no_grad():
        full = token_logprobs(teacher64(input_ids=torch.tensor([ids])).logits, torch.tensor([ids]))[0]
    for s, e in ((5, 12), (20, 21), (30, 40)):
        got = torch.tensor(score_tokens(teacher64, ids, s, e), dtype=torch.float64)
        assert torch.allclose(got, full[s:e], rtol=0, atol=1e-12)


def test_score_tokens_from_the_start_is_the_whole_sequence(teacher64):
    rng = random.Random(1)
    ids = [rng.randrange(teacher64.config.vocab_size) for _ in range(12)]
    with torch.no_grad():
        full = token_logprobs(teacher64(input_ids=torch.tensor([ids])).logits, torch.tensor([ids]))[0]
    got = score_tokens(teacher64, ids)
    assert len(got) == len(ids) and got[0] == 0.0  # position 0 predicts nothing
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), full, rtol=0, atol=1e-12)


def test_load_policy_round_trip_in_every_dtype(tmp_path, tok):
    """A saved policy loads with its tokenizer, in the asked dtype, in eval mode; float64 gets float64 norms."""
    from tsrl_cli.policy import build_tiny_model, load_policy, save_policy

    model = build_tiny_model(3, torch.float32, vocab_size=len(tok))
    save_policy(model, tok, tmp_path / "pol")
    ids = torch.tensor([tok.encode("THOUGHT: fix the bug")])
    for dtype, torch_dtype in (("float32", torch.float32), ("float64", torch.float64), ("bfloat16", torch.bfloat16)):
        m, t = load_policy(tmp_path / "pol", dtype=dtype)
        assert next(m.parameters()).dtype == torch_dtype and not m.training and t.get_vocab() == tok.get_vocab()
    m64, _ = load_policy(tmp_path / "pol", dtype="float64")
    with torch.no_grad():
        h = torch.randn(1, 3, m64.config.hidden_size, dtype=torch.float64)
        norm = m64.model.norm
        want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
        assert torch.equal(norm(h), want)  # computed in float64, not through float32
        m32, _ = load_policy(tmp_path / "pol")
        assert torch.equal(m32(input_ids=ids).logits, model(input_ids=ids).logits)


def test_load_policy_errors_name_the_place(tmp_path):
    from tsrl_cli.errors import UsageError
    from tsrl_cli.policy import load_policy

    with pytest.raises(UsageError, match="not a model directory"):
        load_policy(tmp_path)
    with pytest.raises(UsageError, match="dtype 'float16' is unknown"):
        load_policy("builtin:tiny", dtype="float16")
    m, t = load_policy("builtin:tiny", dtype="float64", seed=2)
    m2, _ = load_policy("builtin:tiny", dtype="float64", seed=2)
    assert t is None and all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))


def test_save_policy_is_atomic(tmp_path, tok):
    """A failure while the folder is written leaves the previous policy as it was, and no temporary behind."""
    from tsrl_cli.policy import build_tiny_model, save_policy

    out = tmp_path / "pol"
    save_policy(build_tiny_model(0, vocab_size=len(tok)), tok, out, extra=lambda d: (d / "mark").write_text("old"))

    def crash(d):
        (d / "mark").write_text("new")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_policy(build_tiny_model(1, vocab_size=len(tok)), tok, out, extra=crash)
    assert (out / "mark").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["pol"]


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_are_the_checkpoints_tensors(tmp_path, tok, tied):
    """parameter_names (the config's model on meta) is what trainable_state of the loaded policy publishes and
    what save_pretrained wrote into the checkpoint (read from the safetensors header), tied weights once."""
    from safetensors import safe_open

    from tsrl_cli.policy import build_tiny_model, load_policy, parameter_names, save_policy, trainable_state

    model = build_tiny_model(0, vocab_size=len(tok))
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    folder = save_policy(model, tok, tmp_path / "pol")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    names = parameter_names(folder)
    assert ("lm_head.weight" in names) is not tied and len(names) > 10
    assert names == written == set(trainable_state(load_policy(folder, dtype="float32")[0]))
