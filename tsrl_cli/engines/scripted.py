"""A scripted policy: replies are chosen by a function of the context, not sampled from a model.

Used to test the agent loop, sandboxes and rewards end to end through the same code path as a
real engine (and to demonstrate a task being solved). Its log-probs are 0 and it has no weights.
"""

from __future__ import annotations

from collections.abc import Callable

from tsrl_cli.engines.protocol import TurnOutput, TurnRequest


class ScriptedEngine:
    """`script(context_text, turn_index) -> reply text`; the reply is tokenized and closed with <|im_end|>."""

    def __init__(self, tokenizer, script: Callable[[str, int], str]):
        self.tok, self.script, self.version = tokenizer, script, 0
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def update_weights(self, named_tensors, version: int) -> None:
        self.version = version

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        outs = []
        for r in requests:
            context = self.tok.decode(r.context_ids, skip_special_tokens=False)
            turn = context.count("<|im_start|>assistant") - 1
            ids = self.tok.encode(self.script(context, turn), add_special_tokens=False)
            if len(ids) >= r.params.max_tokens:
                ids, reason = ids[: r.params.max_tokens], "length"
            else:
                ids, reason = ids + [self.im_end], "stop"
            outs.append(TurnOutput(ids, [0.0] * len(ids), reason, self.version))
        return outs
