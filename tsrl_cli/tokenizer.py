"""A small byte-level BPE tokenizer with a ChatML chat template, trained locally (no hub).

ChatML is the turn format of the Qwen family: `<|im_start|>role\\n...<|im_end|>\\n`. The agent
renderer (agent/renderer.py) relies on these two special tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_chatml_tokenizer(texts: Iterable[str], vocab_size: int = 512, out_dir: str | Path | None = None):
    """Train a byte-level BPE on `texts`; returns a transformers PreTrainedTokenizerFast.

    Deterministic for the same texts and vocab size. Saved with save_pretrained when out_dir is given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast
