import pytest

CORPUS = [
    "THOUGHT: look at the files\n```bash\nls -la\n```",
    "THOUGHT: fix the bug\n```bash\nsed -i 's/a - b/a + b/' calc.py\n```",
    "```bash\nsubmit\n```",
    "def add(a, b):\n    return a + b\n",
    "[exit code 0]\ncalc.py\ntest_calc.py\n",
    "You are an agent working in a shell. Each reply: a short THOUGHT, then exactly one bash block.",
]


@pytest.fixture(scope="session")
def tok():
    from tsrl_cli.tokenizer import train_chatml_tokenizer

    return train_chatml_tokenizer(CORPUS * 10, vocab_size=320)
