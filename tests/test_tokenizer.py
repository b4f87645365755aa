"""The project's BPE tokenizer: word-stable pre-tokenization (a word's tokens do not depend on its left
context), exact round trips, and the ChatML special tokens."""

import pytest

from tsrl_cli.tokenizer import train_chatml_tokenizer

CORPUS = [
    "Make the script `plum.sh` executable.\n```bash\nchmod +x plum.sh\n```",
    "Write the number of lines in `river.txt` to `count.txt`.\n```bash\nwc -l < river.txt > count.txt\n```",
    "def total(xs):\n    return sum(x for x in xs)  # 3 items\n",
    "Let me look at `garden/` first.\n```bash\nls garden\n```\n[exit code 0]\n",
]


def pieces(tok, text: str, word: str) -> list[str]:
    """The tokens that spell `word` inside `text` (by character offsets)."""
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    s = text.index(word)
    e = s + len(word)
    return [tok.convert_ids_to_tokens(i) for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
            if a < e and b > s]


@pytest.fixture(scope="module")
def toks():
    return {ws: train_chatml_tokenizer(CORPUS * 10, vocab_size=320, word_stable=ws) for ws in (False, True)}


# words the corpus never contains, as a held-out file name would be
@pytest.mark.parametrize("word", ["window", "dragon", "timber", "zebra"])
def test_word_stable_tokens_do_not_depend_on_left_context(toks, word):
    tok = toks[True]
    contexts = [f"Make `{word}.sh` executable.", f"chmod +x {word}.sh", f"ls\n{word}/", f"({word})", f"x={word}"]
    seen = {tuple(pieces(tok, c, word)) for c in contexts}
    assert len(seen) == 1, seen
    (only,) = seen
    assert tok.convert_tokens_to_string(list(only)) == word


def test_gpt2_split_glues_the_space_to_the_word(toks):
    # the failure word_stable removes: " window" and "`window" begin with different tokens
    tok = toks[False]
    a = pieces(tok, "chmod +x window.sh", " window")
    b = pieces(tok, "Make `window.sh` executable.", "window")
    assert a[0] != b[0] and a[0].startswith("Ġ")


@pytest.mark.parametrize("ws", [False, True])
def test_round_trip_is_exact(toks, ws):
    tok = toks[ws]
    for text in CORPUS + ["  tabs\tand  double  spaces\n\n", "naïve café ✓ 100%", "a_b-c.d/e:f"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chatml_specials_survive(toks):
    tok = toks[True]
    text = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                   add_generation_prompt=True)
    toks_ = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    assert toks_.count("<|im_start|>") == 2 and toks_.count("<|im_end|>") == 1
