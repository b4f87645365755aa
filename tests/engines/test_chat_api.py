"""`tsrl serve`'s /v1/chat/completions against the official `openai` Python client (the dev extra).

The reference is computed without the server: the toy policy's tokenizer renders the messages with its
own chat template (tokenizer.apply_chat_template, not the agent's renderer that the server uses), and
the same float64 model generates through HFEngine directly with the same seed. The reply must hold that
turn's text and its log-probs within 1e-12. Positive control: a prompt one token shorter gives other
log-probs, so the comparison sees a rendering that is off by one token.
"""

from __future__ import annotations

import pytest

from tsrl_cli.agent.renderer import ChatMLRenderer, served_chat
from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.protocol import SamplingParams, TurnRequest
from tsrl_cli.engines.server import start_server
from tsrl_cli.policy import load_policy
from tsrl_cli.rl.toy import ensure_toy_policy

openai = pytest.importorskip("openai", reason="the official openai client is in the dev extra")
httpx = pytest.importorskip("httpx")

KEY = "chat-key-42"
MESSAGES = [{"role": "system", "content": "You are a shell agent."},
            {"role": "user", "content": [{"type": "text", "text": "Print the word "},
                                         {"type": "text", "text": "dragon."}]},
            {"role": "assistant", "content": "echo dragon"},
            {"role": "user", "content": "Again."}]


@pytest.fixture(scope="module")
def toy():
    """(server, tokenizer, model): the toy policy behind a keyed server with its chat format."""
    path = ensure_toy_policy("builtin:toy")
    model, tok = load_policy(path, dtype="float64")
    srv = start_server(HFEngine(model, pad_id=tok.pad_token_id, batch_invariant=True), model_name="toy",
                       api_key=KEY, chat=served_chat(path))
    yield srv, tok, model
    srv.shutdown()


def client(url: str, key: str):
    # no proxy from the environment, no retries: each call is one request
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


def reference(tok, model, prompt_ids, seed, max_tokens):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, stop_token_ids=(im_end,), seed=seed)
    return HFEngine(model, pad_id=tok.pad_token_id, batch_invariant=True).generate([TurnRequest(prompt_ids, params)])[0]


def template_ids(tok, messages) -> list[int]:
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in messages]
    return tok.encode(tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def test_the_official_client_gets_the_models_turn(toy):
    srv, tok, model = toy
    reply = client(srv.url, KEY).chat.completions.create(model="toy", messages=MESSAGES, max_tokens=24, seed=11,
                                                         temperature=1.0, logprobs=True)
    prompt = template_ids(tok, MESSAGES)
    ref = reference(tok, model, prompt, seed=11, max_tokens=24)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "toy" and choice.message.role == "assistant"
    assert choice.finish_reason == ref.finish_reason
    text_ids = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
    assert choice.message.content == tok.decode(text_ids, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(ref.token_ids)
    got = [t.logprob for t in choice.logprobs.content]
    assert len(got) == len(ref.logprobs) and max(abs(a - b) for a, b in zip(got, ref.logprobs, strict=True)) < 1e-12
    off = reference(tok, model, prompt[:-1], seed=11, max_tokens=24)  # positive control: one token off
    assert off.logprobs[: len(got)] != got[: len(off.logprobs)]


def test_the_agents_rendering_is_the_templates():
    """The server renders with the agent's ChatML renderer: the same ids as the tokenizer's own template."""
    tok = load_policy(ensure_toy_policy("builtin:toy"), dtype="float32")[1]
    turns = [(m["role"], m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"]))
             for m in MESSAGES]
    r = ChatMLRenderer(tok)
    assert r.conversation(turns) == template_ids(tok, MESSAGES)
    assert r.prompt("sys", "usr") == template_ids(tok, [{"role": "system", "content": "sys"},
                                                        {"role": "user", "content": "usr"}])


def test_a_wrong_key_is_401_through_the_client(toy):
    srv, _, _ = toy
    for key in ("wrong", "Bearer " + KEY):
        with pytest.raises(openai.AuthenticationError) as e:
            client(srv.url, key).chat.completions.create(model="toy", messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 401


def test_what_is_not_served_is_a_400_naming_it(toy):
    srv, _, _ = toy
    c = client(srv.url, KEY)
    for kwargs, field in (({"stream": True}, "stream"), ({"n": 2}, "n"), ({"stop": ["\n"]}, "stop"),
                          ({"max_tokens": 10**6}, "max_tokens"),
                          ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].role")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": "toy", "messages": MESSAGES, "max_tokens": 2, **kwargs})
        assert e.value.status_code == 400 and e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=MESSAGES, max_tokens=2)
