"""The oracle agent in training (rollout.agent oracle): its model turns are the task's reference solution.

Turn 0 calls bash with the environment's oracle_command() (Harbor's oracle: solution/solve.sh; repair:
the gold patch), turn 1 calls submit, each written in the run's chat format (the renderer's call_text: a
fenced bash block under chatml, the template's own tool-call turn under the model's template). The turns
are real tokens of the policy's tokenizer and go through the same agent loop, sandbox, verifier and
learner as the policy's, so a round of it checks the reward path end to end: every reward must be 1.
Its log-probs are 0 (no model sampled them).
"""

from __future__ import annotations

from tsrl_cli.engines.protocol import TurnOutput, TurnRequest
from tsrl_cli.errors import UsageError

THOUGHT = "THOUGHT: I play the task's reference solution."


def oracle_turns(renderer, command: str) -> list[str]:
    """The oracle's replies, in order, in the renderer's chat format."""
    return [renderer.call_text("bash", {"command": command}, THOUGHT), renderer.call_text("submit", {})]


def oracle_turn_tokens(renderer, command: str) -> int:
    """Tokens of the oracle's longest turn (with its end-of-turn token): what rollout.max_turn_tokens must allow."""
    return max(len(renderer.encode(t)) + 1 for t in oracle_turns(renderer, command))


class OracleSession:
    """`generate` for one trajectory: the oracle's next reply, as a TurnOutput of the frozen version."""

    def __init__(self, renderer, command: str, version: int, task: str):
        self.renderer, self.version, self.task = renderer, version, task
        self.replies = oracle_turns(renderer, command)
        self.turn = 0

    async def generate(self, request: TurnRequest) -> TurnOutput:
        text = self.replies[min(self.turn, len(self.replies) - 1)]
        self.turn += 1
        ids = self.renderer.encode(text) + [self.renderer.end_of_turn]
        if len(ids) > request.params.max_tokens:  # cut, it would be a broken command scored 0: say so instead
            raise UsageError(f"rollout.agent oracle: task {self.task}'s solution is {len(ids)} tokens, over "
                             f"rollout.max_turn_tokens {request.params.max_tokens}; raise it")
        return TurnOutput(ids, [0.0] * len(ids), "stop", self.version)
