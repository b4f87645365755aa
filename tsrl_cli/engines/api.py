"""The OpenAI request and reply shapes that `tsrl serve` (engines/server.py) answers.

    /v1/completions       vLLM's token-id subset: token ids in, token ids and log-probs out
    /v1/chat/completions  OpenAI chat: messages rendered in the served model's chat format (ChatFormat),
                          the turn decoded to text; non-streaming only

Parsing turns a JSON body into a TurnRequest or raises ApiError naming the field (HTTP 400), so a bad
request never reaches the engine.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tsrl_cli.engines.protocol import SamplingParams, TurnOutput, TurnRequest

SEED_RANGE = (-(2**63), 2**63 - 1)  # vLLM's bound (a torch long)
CHAT_ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """An error reply: HTTP `status` (400: a bad request, whose `param` names the field)."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class ChatFormat:
    """How the served model's chat turns become tokens and back.

    render([(role, text), ...]) -> the prompt's token ids, ending in the assistant's generation prompt;
    decode(ids) -> text (special tokens dropped); a turn ends at one of stop_token_ids (ChatML: <|im_end|>);
    max_model_len bounds prompt + completion (None: unknown, then max_tokens defaults to 256)."""

    name: str
    render: Callable[[list[tuple[str, str]]], list[int]]
    decode: Callable[[list[int]], str]
    stop_token_ids: tuple[int, ...]
    max_model_len: int | None = None


# ---- fields -------------------------------------------------------------------------------------

def int_field(body: dict, key: str, default, lo: int | None = None):
    """body[key] as an integer (default when absent or null), >= lo; ApiError naming the key otherwise."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(key, f"{key}: expected an integer, got {v!r}")
    if lo is not None and v < lo:
        raise ApiError(key, f"{key}: must be >= {lo}, got {v}")
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(key, f"{key}: expected a number, got {v!r}")
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        raise ApiError(key, f"{key}: {v} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _token_ids(v, key: str) -> list[int]:
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
        raise ApiError(key, f"{key}: expected a list of token ids (non-negative integers)")
    return v


def _seed(body: dict) -> int:
    seed = int_field(body, "seed", None)
    if seed is None:
        return secrets.randbits(63)  # OpenAI semantics: no seed, a fresh sample each time
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ApiError("seed", f"seed: {seed} does not fit in 64 bits")
    return seed


def _one_sample(body: dict) -> None:
    if int_field(body, "n", 1, lo=1) != 1:
        raise ApiError("n", "n: only n=1 is served; send one request per sample (each with its own seed)")


# ---- /v1/completions ----------------------------------------------------------------------------

def parse_completion(body) -> tuple[TurnRequest, dict]:
    """A /v1/completions body -> (TurnRequest, reply options). Raises ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError(None, "request body: expected a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise ApiError("prompt", "prompt: text prompts are not accepted; send token ids (this endpoint does not "
                                   "tokenize; /v1/chat/completions takes text messages)")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):  # [[ids]]: a batch of one
        if len(prompt) != 1:
            raise ApiError("prompt", f"prompt: {len(prompt)} prompts in one request; send one per request")
        prompt = prompt[0]
    prompt = _token_ids(prompt, "prompt")
    if not prompt:
        raise ApiError("prompt", "prompt: empty; a completion needs at least one context token")
    _one_sample(body)
    for flag in ("stream", "echo", "use_beam_search"):
        if body.get(flag):
            raise ApiError(flag, f"{flag}: not supported by tsrl serve")
    params = SamplingParams(
        temperature=_float(body, "temperature", 1.0, 0.0, 1e6),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        max_tokens=int_field(body, "max_tokens", 16, lo=1),  # 16: the OpenAI and vLLM default
        stop_token_ids=tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids")),
        seed=_seed(body),
    )
    logprobs = int_field(body, "logprobs", None, lo=0)
    rti = body.get("return_token_ids")
    if rti is not None and not isinstance(rti, bool):
        raise ApiError("return_token_ids", f"return_token_ids: expected true or false, got {rti!r}")
    return TurnRequest(prompt, params), {"logprobs": logprobs, "return_token_ids": bool(rti),
                                         "model": body.get("model")}


def completion_reply(out: TurnOutput, prompt_ids: list[int], model_name: str, opts: dict) -> dict:
    """The OpenAI completions shape (vLLM's token-id fields) for one TurnOutput.

    `text` is empty (this endpoint does not detokenize); `tokens` are "token_id:N" as vLLM writes them
    with return_tokens_as_token_ids. Only the sampled token's log-prob is reported: top_logprobs is null
    whatever `logprobs` asked for.
    """
    n, prompt_len = len(out.token_ids), len(prompt_ids)
    choice = {"index": 0, "text": "", "finish_reason": out.finish_reason,
              "stop_reason": out.token_ids[-1] if out.finish_reason == "stop" and out.token_ids else None,
              "logprobs": None}
    if opts["return_token_ids"]:
        choice["token_ids"] = list(out.token_ids)
        choice["prompt_token_ids"] = list(prompt_ids)
    if opts["logprobs"] is not None:
        choice["logprobs"] = {"text_offset": [0] * n, "token_logprobs": list(out.logprobs),
                              "tokens": [f"token_id:{t}" for t in out.token_ids], "top_logprobs": None}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n},
            "policy_version": out.policy_version}


# ---- /v1/chat/completions -----------------------------------------------------------------------

def _text(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(where, f"{where}: expected a string or a list of text parts (images and audio are not served)")


def _messages(body: dict) -> list[tuple[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("messages", "messages: expected a non-empty list of {\"role\", \"content\"}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}]", f"messages[{i}]: expected an object with role and content")
        if m.get("role") not in CHAT_ROLES:
            raise ApiError(f"messages[{i}].role", f"messages[{i}].role: {m.get('role')!r}; this server renders "
                                                  f"{', '.join(CHAT_ROLES)} turns (no tool messages)")
        out.append((m["role"], _text(m.get("content"), f"messages[{i}].content")))
    return out


# requests that would be answered as if asked something else are refused: field -> its no-op values
_CHAT_NOOP = {"stream": (None, False), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
              "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
              "stop": (None, [], ""), "top_logprobs": (None, 0), "echo": (None, False)}


def parse_chat(body, chat: ChatFormat) -> tuple[TurnRequest, dict]:
    """A /v1/chat/completions body -> (TurnRequest, reply options): the messages rendered by `chat`,
    the turn ending at its stop tokens (and any `stop_token_ids`, vLLM's extension). Raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(None, "request body: expected a JSON object")
    turns = _messages(body)
    _one_sample(body)
    for key, noop in _CHAT_NOOP.items():
        if body.get(key, None) not in noop:
            why = ("streaming is not served; send stream=false" if key == "stream" else
                   "stop strings are not served; a turn ends at the chat format's end-of-turn token (or send "
                   "stop_token_ids)" if key == "stop" else "not supported by tsrl serve")
            raise ApiError(key, f"{key}: {why}")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise ApiError("response_format", "response_format: only {\"type\": \"text\"} is served")
    prompt = chat.render(turns)
    room = None if chat.max_model_len is None else chat.max_model_len - len(prompt)
    if room is not None and room < 1:
        raise ApiError("messages", f"messages: the rendered prompt is {len(prompt)} tokens; this model's context "
                                   f"holds {chat.max_model_len}")
    max_tokens = int_field(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", None, lo=1)
    if max_tokens is None:  # OpenAI and vLLM: as many as the context has room for
        max_tokens = room if room is not None else 256
    elif room is not None and max_tokens > room:
        raise ApiError("max_tokens", f"max_tokens: {max_tokens} tokens after a {len(prompt)}-token prompt do not "
                                     f"fit this model's context of {chat.max_model_len}")
    extra_stops = tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    params = SamplingParams(temperature=_float(body, "temperature", 1.0, 0.0, 1e6),
                            top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), max_tokens=max_tokens,
                            stop_token_ids=tuple(dict.fromkeys(chat.stop_token_ids + extra_stops)), seed=_seed(body))
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError("logprobs", f"logprobs: expected true or false, got {logprobs!r}")
    return TurnRequest(prompt, params), {"logprobs": bool(logprobs), "model": body.get("model")}


def chat_reply(out: TurnOutput, prompt_ids: list[int], model_name: str, opts: dict, chat: ChatFormat) -> dict:
    """The OpenAI chat.completion shape for one TurnOutput, plus our `policy_version`.

    `content` is the turn decoded without its stop token; `logprobs.content` lists every sampled token
    (the stop token too) with its raw log-prob, `top_logprobs` empty."""
    ids = list(out.token_ids)
    text_ids = ids[:-1] if out.finish_reason == "stop" and ids else ids
    choice = {"index": 0, "message": {"role": "assistant", "content": chat.decode(text_ids)},
              "finish_reason": out.finish_reason, "logprobs": None}
    if opts["logprobs"]:
        pieces = [chat.decode([t]) for t in ids]
        choice["logprobs"] = {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                          for p, lp in zip(pieces, out.logprobs, strict=False)]}
    n, prompt_len = len(ids), len(prompt_ids)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n},
            "policy_version": out.policy_version}
