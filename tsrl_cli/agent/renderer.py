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

from dataclasses import dataclass, field

from tsrl_cli.errors import UsageError


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
    """Renders agent turns for a tokenizer that has ChatML's <|im_start|> and <|im_end|> tokens."""

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

    def prompt(self, system: str, user: str) -> list[int]:
        return self.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")

    def observation(self, text: str) -> list[int]:
        return self.encode(f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.im_end,)
