"""Who may steer a `tsrl serve` server (engines/auth.py, engines/server.py): the API key, where it may
listen, how much of a request it reads; the client's key (engines/openai.py, doctor) and the saved config.

The server here runs over a spy engine and a spy weight bus that count their calls, so "never reaches
the engine or the bus" is a count of zero; every refusal has its positive control (the same request
with the key does reach them).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest
import yaml
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import config_diff, dump_config, load_config
from tsrl_cli.engines import auth
from tsrl_cli.engines.api import ChatFormat
from tsrl_cli.engines.openai import OpenAIEngine, Unauthorized
from tsrl_cli.engines.protocol import SamplingParams, TurnOutput, TurnRequest
from tsrl_cli.engines.server import RolloutServer, start_server
from tsrl_cli.errors import UsageError

KEY = "k3y-Secret.0123456789"


class SpyEngine:
    """Records every engine call; answers each request with two fixed tokens."""

    def __init__(self):
        self.version, self.calls, self.updates = 0, [], []

    def generate(self, requests):
        self.calls.append([list(r.context_ids) for r in requests])
        return [TurnOutput([5, 2], [-0.5, -0.25], "stop", self.version) for _ in requests]

    def update_weights(self, named_tensors, version):
        self.updates.append(version)


class SpyBus:
    """A weight bus that records joins and receives; each sync carries no new weights."""

    def __init__(self):
        self.joins, self.receives = [], 0

    def join(self, **args):
        self.joins.append(args)
        return self

    def receive(self, apply):
        self.receives += 1
        return {"version": None, "bytes": 0, "published_at": None}


SPY_CHAT = ChatFormat("spy", render=lambda turns: [len(t) + 3 for _, t in turns] + [9],
                      decode=lambda ids: " ".join(map(str, ids)), stop_token_ids=(2,), max_model_len=64)
COMPLETION = {"prompt": [3, 4], "max_tokens": 2, "seed": 1}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": 1}
JOIN = {"host": "127.0.0.1", "port": 1, "rank": 1, "world": 2}
# every endpoint that is not /health, and a path that is no endpoint at all
GUARDED = [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", CHAT),
           ("POST", "/tsrl/weights/join", JOIN), ("GET", "/tsrl/weights/status", None),
           ("POST", "/tsrl/weights/sync", {}), ("GET", "/nosuch", None)]


@pytest.fixture
def spied():
    """(server, engine, bus): a server with the key, a spy engine, a spy bus and a chat format."""
    eng, bus = SpyEngine(), SpyBus()
    srv = start_server(eng, model_name="tiny", join_bus=bus.join, api_key=KEY, chat=SPY_CHAT,
                       max_body_bytes=64 << 10, read_timeout_s=0.5)
    yield srv, eng, bus
    srv.shutdown()


def call(url, method, path, body=None, headers=None):
    """(status, reply JSON, reply headers) of one request, no proxy."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, json.loads(r.read() or b"{}"), dict(r.getheaders())
    conn.close()
    return out


def raw(url, data: bytes, wait_s: float = 0.0):
    """Send `data` as it is (from another thread, so a server that answers early is heard), optionally
    stop sending and keep the connection open for wait_s; (status, reply JSON, seconds to the reply)."""
    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=30)

    def send():
        try:
            s.sendall(data)
        except OSError:  # the server answered and closed before the rest was sent
            pass

    t0 = time.monotonic()
    sender = threading.Thread(target=send)
    sender.start()
    got = b""
    while chunk := s.recv(1 << 16):
        got += chunk
    elapsed = time.monotonic() - t0
    sender.join()
    s.close()
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body), elapsed


def post_head(path: str, length: int | str, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


# ---- the key ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("header", [None, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", KEY, "Bearer ",
                                    f"Bearer  {KEY}"])
def test_a_wrong_or_missing_key_is_401_and_reaches_nothing(spied, header):
    srv, eng, bus = spied
    for method, path, body in GUARDED:
        status, reply, headers = call(srv.url, method, path, body, {"Authorization": header} if header else None)
        assert status == 401, (path, status, reply)
        assert reply["error"]["type"] == "AuthenticationError" and "API key" in reply["error"]["message"]
        assert headers.get("WWW-Authenticate") == "Bearer"
    assert eng.calls == [] and bus.joins == [] and bus.receives == 0  # nothing reached the engine or the bus
    status, reply, _ = call(srv.url, "GET", "/health")  # /health answers anyone, as vLLM's does
    assert status == 200 and reply["status"] == "ok"


def test_the_right_key_reaches_the_engine_and_the_bus(spied):
    """Positive control of the 401 test: the same requests with the key are served."""
    srv, eng, bus = spied
    for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 7235, as vLLM reads it)
        status, reply, _ = call(srv.url, "POST", "/v1/completions", COMPLETION, {"Authorization": f"{scheme} {KEY}"})
        assert status == 200 and reply["choices"][0]["finish_reason"] == "stop"
    status, reply, _ = call(srv.url, "POST", "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and reply["choices"][0]["message"]["content"] == "5"  # the stop token 2 is cut
    assert eng.calls == [[[3, 4]], [[3, 4]], [[5, 9]]]  # SPY_CHAT's rendering of one 2-character user turn
    status, _, _ = call(srv.url, "POST", "/tsrl/weights/join", JOIN, {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    status, reply, _ = call(srv.url, "POST", "/tsrl/weights/sync", {}, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and reply["version"] is None and bus.receives == 1
    assert [j["rank"] for j in bus.joins] == [1]
    status, _, _ = call(srv.url, "GET", "/nosuch", None, {"Authorization": f"Bearer {KEY}"})
    assert status == 404  # with the key, an unknown path is told so


def test_keys_are_compared_in_constant_time(spied, monkeypatch):
    """The server's decision goes through hmac.compare_digest (of SHA-256 digests), not ==."""
    srv, _, _ = spied
    seen = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: seen.append((len(a), len(b))) or real(a, b))
    assert call(srv.url, "GET", "/v1/models", None, {"Authorization": "Bearer x"})[0] == 401
    assert call(srv.url, "GET", "/v1/models", None, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert seen == [(32, 32), (32, 32)]  # digests of equal length whatever the guess: its length leaks nothing
    assert not hasattr(srv, "api_key") and srv.key_digest == auth.key_digest(KEY)  # only the digest is kept


# ---- listening --------------------------------------------------------------------------------------

def test_listening_beyond_loopback_needs_a_key_or_insecure():
    for host in ("127.0.0.1", "localhost", "127.0.0.2"):
        auth.check_listen(host, None, False)
    for host in ("0.0.0.0", ""):
        with pytest.raises(UsageError, match="--api-key KEY.*--insecure"):
            auth.check_listen(host, None, False)
        auth.check_listen(host, KEY, False)
        auth.check_listen(host, None, True)
    with pytest.raises(UsageError, match="beyond loopback"):  # the library refuses too, before it binds
        RolloutServer(SpyEngine(), host="0.0.0.0", port=0)
    with pytest.raises(UsageError, match="visible ASCII"):
        RolloutServer(SpyEngine(), api_key="two words")


def test_tsrl_serve_refuses_an_open_port_before_loading_anything(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)
    missing = str(tmp_path / "nomodel")
    res = CliRunner().invoke(app, ["serve", "--model", missing, "--host", "0.0.0.0", "--port", "0"])
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0, res.output
    assert "--api-key" in res.stderr and "--insecure" in res.stderr and "not a model directory" not in res.stderr
    # positive controls: with --insecure, or a key in TSRL_API_KEY, the start gets as far as the model folder
    for args, env in ((["--insecure"], {}), ([], {auth.API_KEY_ENV: KEY})):
        res = CliRunner().invoke(app, ["serve", "--model", missing, "--host", "0.0.0.0", "--port", "0", *args], env=env)
        assert res.exit_code == 2 and "not a model directory" in res.stderr, res.output


# ---- how much is read -------------------------------------------------------------------------------

def test_an_oversized_body_is_413_unread(spied):
    srv, eng, _ = spied
    pad = json.dumps({**COMPLETION, "pad": "x" * (1 << 20)}).encode()  # 1 MiB against a 64 KiB cap
    status, reply, _ = raw(srv.url, post_head("/v1/completions", len(pad)) + pad)
    assert status == 413
    assert "cap of 65536" in reply["error"]["message"] and "--max-body-mb" in reply["error"]["message"]
    status, _, elapsed = raw(srv.url, post_head("/v1/completions", 10**12))  # declared, never sent: no wait
    assert status == 413 and elapsed < 5
    assert eng.calls == []
    under = json.dumps({**COMPLETION, "pad": "x" * (60 << 10)}).encode()  # positive control: under the cap
    assert raw(srv.url, post_head("/v1/completions", len(under)) + under)[0] == 200 and len(eng.calls) == 1


def test_the_body_is_read_by_its_content_length_and_no_further(spied):
    srv, eng, _ = spied
    body = json.dumps(COMPLETION).encode()
    # a Content-Length that lies low: only the declared bytes are read (a torn JSON object), never the MiB after
    status, reply, _ = raw(srv.url, post_head("/v1/completions", 12) + body + b" " * (1 << 20))
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    # one that lies high: the body stops arriving and the server gives up after read_timeout_s (0.5 s)
    status, reply, elapsed = raw(srv.url, post_head("/v1/completions", len(body) + 100) + body)
    assert status == 408 and 0.4 < elapsed < 10
    for length in ("-5", "ten"):
        assert raw(srv.url, post_head("/v1/completions", length))[0] == 411
    status, reply, _ = raw(srv.url, post_head("/v1/completions", 0, "Transfer-Encoding: chunked\r\n").replace(
        b"Content-Length: 0\r\n", b"") + b"5\r\nhello\r\n0\r\n\r\n")
    assert status == 411 and "Content-Length" in reply["error"]["message"]
    assert eng.calls == []
    assert raw(srv.url, post_head("/v1/completions", len(body)) + body)[0] == 200  # the honest request is served


# ---- the client -------------------------------------------------------------------------------------

def test_the_client_sends_its_key_on_every_request(spied):
    srv, eng, bus = spied
    req = TurnRequest([3, 4], SamplingParams(max_tokens=2, seed=1))
    client = OpenAIEngine([srv.url], api_key=KEY)
    assert asyncio.run(client.generate(req)).token_ids == [5, 2]  # /v1/models (the name), /v1/completions
    client.join_bus("127.0.0.1", 1, first_rank=1, world=2)
    assert client.weights_status()[0]["weight_bus"] and bus.joins[0]["rank"] == 1  # the join and the status
    assert client.sync()[0]["version"] is None and bus.receives == 1
    client.close()
    for key, said in ((None, "no API key sent"), ("wrong", "refused our API key")):
        other = OpenAIEngine([srv.url], api_key=key)
        with pytest.raises(Unauthorized, match=f"{said}.*rollout.server_api_key or TSRL_API_KEY"):
            asyncio.run(other.generate(req))
        assert other.dead == {}  # a 401 is the run's fault, not the server's: no failover
        with pytest.raises(Unauthorized):
            other.join_bus("127.0.0.1", 1, first_rank=1, world=2)
        other.close()
    assert len(eng.calls) == 1 and len(bus.joins) == 1


def test_the_client_key_comes_from_the_config_first_then_the_environment(monkeypatch):
    monkeypatch.delenv(auth.API_KEY_ENV, raising=False)
    assert auth.client_api_key("") is None
    monkeypatch.setenv(auth.API_KEY_ENV, "from-env")
    assert auth.client_api_key("") == "from-env"
    assert auth.client_api_key("from-config") == "from-config"  # the run's own key wins
    with pytest.raises(UsageError, match="rollout.server_api_key: an API key is visible ASCII"):
        auth.client_api_key("a\nb")
    monkeypatch.setenv(auth.API_KEY_ENV, "é")
    with pytest.raises(UsageError, match="TSRL_API_KEY"):
        auth.client_api_key("")


def test_doctor_asks_with_the_key_and_says_which_to_fix(spied):
    from tsrl_cli.doctor import _server_check

    srv, _, _ = spied
    missing = _server_check(srv.url)
    assert not missing.ok and "no API key sent" in missing.detail and "TSRL_API_KEY" in missing.fix
    wrong = _server_check(srv.url, api_key="nope")
    assert not wrong.ok and "refused our API key" in wrong.detail
    assert _server_check(srv.url, api_key=KEY).ok


def test_the_saved_config_never_holds_the_key():
    cfg = load_config(sets=["rollout.engine=openai", "rollout.servers=[http://127.0.0.1:8000]",
                            f"rollout.server_api_key={KEY}"])
    assert cfg.rollout.server_api_key == KEY  # the run itself has it
    text = dump_config(cfg)  # what train writes as config.yaml (and config_to_dict gives the trackers)
    assert KEY not in text and yaml.safe_load(text)["rollout"]["server_api_key"] == ""
    other = load_config(sets=["rollout.engine=openai", "rollout.servers=[http://127.0.0.1:8000]"])
    assert config_diff(cfg, other) == []  # a run resumed with another key (or from TSRL_API_KEY) is the same run
    assert "http://127.0.0.1:8000" in text  # positive control: the saved config does hold the other strings
