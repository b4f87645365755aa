"""A small byte-level BPE tokenizer with a ChatML chat template, trained locally (no hub).

ChatML is the turn format of the Qwen family: `<|im_start|>role\\n...<|im_end|>\\n`. The agent
renderer (agent/renderer.py) relies on these two special tokens. `with_chat_template` puts another
model's chat template (and the added tokens it writes, e.g. Qwen3's <tool_call> and <think>) on such a
tokenizer, so the agent's rendering through a model's own template is tested offline.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Word-stable pre-tokenization: letter runs, digit runs, whitespace runs and punctuation runs are
# separate pieces, so a word is the same tokens wherever it stands. GPT-2's split (ByteLevel's regex)
# glues a leading space to a word: `window` in backticks is w|ind|ow but " window" in a command is
# Ġw|ind|ow, and `dragon` is dra|g|on against Ġd|ra|g|on. A tiny policy then cannot copy a name it
# never saw from the instruction into its command by induction; it must respell it (results/LOG.md,
# 2026-11-30). The price is about 27 % more tokens on the embedded demonstrations.
WORD_STABLE_SPLIT = r"[A-Za-z]+|[0-9]+|\s+|[^\sA-Za-z0-9]+"


def train_chatml_tokenizer(texts: Iterable[str], vocab_size: int = 512, out_dir: str | Path | None = None,
                           word_stable: bool = False):
    """Train a byte-level BPE on `texts`; returns a transformers PreTrainedTokenizerFast.

    word_stable: split with WORD_STABLE_SPLIT instead of GPT-2's regex (a word's tokens do not depend
    on what precedes it). Deterministic for the same texts, vocab size and split. Saved with
    save_pretrained when out_dir is given.
    """
    tok = Tokenizer(models.BPE())
    if word_stable:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(WORD_STABLE_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
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


def with_chat_template(tokenizer, template: str, added_tokens: Iterable[str] = ()):
    """A copy of `tokenizer` with `template` as its chat template and `added_tokens` added, each one token
    that BPE never splits (as a model's tokenizer holds them; not special, so decoding keeps them). The
    new ids come after the vocabulary: a model of the old vocabulary size cannot embed them."""
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tok.chat_template = template
    return tok
