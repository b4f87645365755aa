"""The engine interface: one model turn asked (TurnRequest: a token context and its SamplingParams) and
answered (TurnOutput), the PolicyEngine protocol every engine implements (hf, vllm, openai, scripted),
SteppingEngine for the engines that batch continuously (can_step), and request_seed, a turn's seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128  # per model turn
    stop_token_ids: tuple[int, ...] = ()  # the turn ends after emitting one of these (kept in the turn)
    seed: int = 0  # per request: the same (weights, context, params, seed) gives the same tokens


@dataclass
class TurnRequest:
    context_ids: list[int]
    params: SamplingParams


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw model log-probs of the sampled tokens (kept as behavior_logprobs)
    finish_reason: str  # "stop" (a stop token was emitted) | "length" (max_tokens reached)
    policy_version: int = 0


class PolicyEngine(Protocol):
    version: int

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]: ...

    def update_weights(self, named_tensors, version: int) -> None: ...


class SteppingEngine(PolicyEngine, Protocol):
    """An engine that batches continuously (HFEngine, VLLMEngine): turns join and leave a running batch.
    Called from one thread; update_weights only while running() == 0 (between rounds)."""

    def add(self, rid: int, request: TurnRequest) -> None: ...  # admitted; joins the batch at the next step

    def step(self) -> list[tuple[int, TurnOutput]]: ...  # one decode step of every running turn: those that ended

    def running(self) -> int: ...  # admitted and not yet returned


def can_step(engine) -> bool:
    """Whether `engine` batches continuously (has add, step and running)."""
    return all(callable(getattr(engine, m, None)) for m in ("add", "step", "running"))


def request_seed(*parts: object) -> int:
    """A 63-bit seed from (seed, round, task, sample, turn, ...): stable across processes and runs."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1
