"""The oracle agent in training (rollout.agent oracle): its model turns are the task's reference solution.

Turn 0 is one bash block holding the environment's oracle_command() (Harbor's oracle: solution/solve.sh;
repair: the gold patch), turn 1 is `submit`. The turns are real tokens of the policy's tokenizer and
go through the same agent loop, sandbox, verifier and learner as the policy's, so a round of it
checks the reward path end to end: every reward must be 1. Its log-probs are 0 (no model sampled them).
"""

from __future__ import annotations

from tsrl_cli.engines.base import TurnOutput, TurnRequest
from tsrl_cli.errors import UsageError

THOUGHT = "THOUGHT: I play the task's reference solution."


def oracle_turns(command: str) -> list[str]:
    """The oracle's replies, in order."""
    return [f"{THOUGHT}\n```bash\n{command}\n```", "```bash\nsubmit\n```"]


def oracle_turn_tokens(tokenizer, command: str) -> int:
    """Tokens of the oracle's longest turn (with its closing <|im_end|>): what rollout.max_turn_tokens must allow."""
    return max(len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in oracle_turns(command))


class OracleSession:
    """`generate` for one trajectory: the oracle's next reply, as a TurnOutput of the frozen version."""

    def __init__(self, tokenizer, command: str, version: int, task: str):
        self.tok, self.version, self.task = tokenizer, version, task
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies = oracle_turns(command)
        self.turn = 0

    async def generate(self, request: TurnRequest) -> TurnOutput:
        text = self.replies[min(self.turn, len(self.replies) - 1)]
        self.turn += 1
        ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
        if len(ids) > request.params.max_tokens:  # cut, it would be a broken command scored 0: say so instead
            raise UsageError(f"rollout.agent oracle: task {self.task}'s solution is {len(ids)} tokens, over "
                             f"rollout.max_turn_tokens {request.params.max_tokens}; raise it")
        return TurnOutput(ids, [0.0] * len(ids), "stop", self.version)
