"""Round-engine fixtures: the builtin toy workload (echo tasks, tiny policy cached in data/cache/toy)."""

import pytest
from toy_workload import TOY


@pytest.fixture(scope="session")
def toy_policies():
    """Build (or reuse) the cached toy student and teacher once per session."""
    from tsrl_cli.rl.toy import ensure_toy_policy

    return ensure_toy_policy("builtin:toy"), ensure_toy_policy("builtin:toy-teacher")


@pytest.fixture
def toy_config(toy_policies, tmp_path):
    """toy_config(*sets, **flags) -> a TrainConfig on the toy workload writing under tmp_path."""
    from tsrl_cli.config import load_config

    def make(*sets, out="run", **flags):
        return load_config(sets=[*TOY, f"run.out={tmp_path / out}", *sets], flags=flags)

    return make


@pytest.fixture(scope="session")
def tok():
    """A ChatML tokenizer trained on the echo tasks' text (no model needed)."""
    from tsrl_cli.agent.loop import SYSTEM_PROMPT
    from tsrl_cli.rl.toy import INSTRUCTION, WORDS
    from tsrl_cli.tokenizer import train_chatml_tokenizer

    corpus = [SYSTEM_PROMPT, "```bash\necho apple\n```", "```bash\nsubmit\n```", "[exit code 0]\napple"]
    return train_chatml_tokenizer(corpus * 4 + [INSTRUCTION.format(word=w) for w in WORDS], vocab_size=320)
