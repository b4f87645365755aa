"""ChatML rendering, token in / token out: the model's sampled tokens are kept exactly as sampled.

Re-tokenizing the decoded text could change the tokens (and so the log-probs the learner
recomputes); instead the trajectory is built by appending:
  prompt       <|im_start|>system\\n..<|im_end|>\\n<|im_start|>user\\n..<|im_end|>\\n<|im_start|>assistant\\n   mask 0
  model turn   the sampled ids, including the closing <|im_end|> when the model emitted it       mask 1
  (length cut) <|im_end|> appended for it                                                    mask 0
  observation  \\n<|im_start|>user\\n{tool output}<|im_end|>\\n<|im_start|>assistant\\n           mask 0
so that loss_mask / turn_spans follow the rollout schema of tsrl_cli.rollouts exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tsrl_cli.agent.actions import FORMAT_ERROR, SYSTEM_PROMPT, Action, parse_action
from tsrl_cli.engines.api import ChatFormat
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import load_tokenizer


@dataclass
class TokenTrajectory:
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)  # 0.0 where not sampled

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> tuple[int, int]:
        start = len(self.input_ids)
        self.input_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.behavior_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        return start, len(self.input_ids)


class ChatMLRenderer:
    """Renders agent turns for a tokenizer that has ChatML's <|im_start|> and <|im_end|> tokens, in the text
    action format of agent/actions.py (one fenced bash block per turn): the format the builtin policies are
    trained in. agent/template.py renders through the model's own chat template instead; both answer the
    same methods, which are all that the agent loop and the oracle use."""

    name = "chatml"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, tokenizer):
        self.tok = tokenizer
        vocab = tokenizer.get_vocab()
        for t in ("<|im_start|>", "<|im_end|>"):
            if t not in vocab:
                raise UsageError(f"tokenizer has no {t} token: the agent renderer needs a ChatML tokenizer")
        self.im_end = vocab["<|im_end|>"]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def conversation(self, messages: list[tuple[str, str]]) -> list[int]:
        """(role, text) turns in ChatML, then the assistant's generation prompt, encoded as one text."""
        turns = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages)
        return self.encode(f"{turns}<|im_start|>assistant\n")

    def prompt(self, system: str, user: str) -> list[int]:
        return self.conversation([("system", system), ("user", user)])

    def observation(self, text: str) -> list[int]:
        return self.encode(f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def feedback(self, text: str) -> list[int]:
        """A format error's message: a user turn, as every observation is."""
        return self.observation(text)

    def parse(self, ids: list[int]) -> Action:
        return parse_action(self.decode(ids))

    def error_text(self, action: Action) -> str:
        return FORMAT_ERROR  # one text for every kind: the one the builtin policies were trained on

    def call_text(self, name: str, arguments: dict, thought: str = "") -> str:
        """A model turn's text that calls tool `name` (bash or submit), as this format writes it."""
        if name == "submit":
            return "```bash\nsubmit\n```"
        return (f"{thought}\n" if thought else "") + f"```bash\n{arguments['command']}\n```"

    @property
    def end_of_turn(self) -> int:
        return self.im_end

    @property
    def label(self) -> str:
        return self.name

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.im_end,)


def served_chat(model_dir: str | Path) -> ChatFormat | None:
    """`tsrl serve`'s chat format for the policy in model_dir: ChatML as the agent renders it (the format
    the policy is rolled out and trained in), its context from config.json's max_position_embeddings;
    None when the folder holds no ChatML tokenizer (the server then answers token-id completions only)."""
    try:
        r = ChatMLRenderer(load_tokenizer(model_dir))
    except UsageError:
        return None
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return ChatFormat("ChatML", r.conversation, r.decode, r.stop_token_ids, config.get("max_position_embeddings"))
