"""Models for verification and training: the built-in tiny Qwen3 and local/hub HuggingFace loading.

The built-in model is built from a config with seeded random weights (no hub, no download).
"""

from __future__ import annotations

import types
from pathlib import Path

import torch

from tsrl_cli.errors import UsageError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
BUILTIN = "builtin:tiny"
BUILTIN_TEACHER = "builtin:tiny-teacher"


def tiny_qwen3_config(vocab_size: int = 128, hidden: int = 64, layers: int = 2, max_positions: int = 512):
    """A Qwen3 architecture of ~0.1 M parameters: fast enough for tests, real enough to matter."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **cfg):
    """Qwen3ForCausalLM with random weights drawn from `seed` (the same seed gives the same model)."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_qwen3_config(**cfg))
    return prepare(model, dtype)


def keep_float64_norms(model) -> int:
    """Make RMSNorm layers compute in float64 when the model is float64.

    transformers' Qwen3RMSNorm (and its siblings) casts activations to float32 whatever the dtype;
    that alone limits float64 agreement between two computations to ~1e-7. Verification needs the
    whole model in float64. Returns the number of layers changed.
    """
    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "weight"):
            eps_attr = "variance_epsilon" if hasattr(mod, "variance_epsilon") else "eps"
            if not hasattr(mod, eps_attr):
                continue

            def forward(self, hidden_states, _eps_attr=eps_attr):
                var = hidden_states.pow(2).mean(-1, keepdim=True)
                return self.weight * (hidden_states * torch.rsqrt(var + getattr(self, _eps_attr)))

            mod.forward = types.MethodType(forward, mod)
            n += 1
    return n


def prepare(model, dtype: torch.dtype):
    model = model.to(dtype)
    if dtype == torch.float64:
        keep_float64_norms(model)
    model.eval()  # no dropout: both timings must see the same function
    return model


def load_model(spec: str, dtype: torch.dtype, seed: int = 0):
    """`builtin:tiny`, `builtin:tiny-teacher`, a local HuggingFace directory, or a hub id (online)."""
    if spec == BUILTIN:
        return build_tiny_model(seed=seed, dtype=dtype)
    if spec == BUILTIN_TEACHER:
        return build_tiny_model(seed=seed + 1000, dtype=dtype)
    from transformers import AutoModelForCausalLM

    p = Path(spec)
    looks_local = p.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1
    if looks_local and not (p / "config.json").is_file():
        raise UsageError(
            f"{spec}: not a model directory (no config.json); pass a directory written by save_pretrained, "
            f"a hub id like Qwen/Qwen3-0.6B, or {BUILTIN}"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except OSError as e:  # hub unreachable, missing weights...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{spec}: could not load the model ({first})") from None
    return prepare(model, dtype)
