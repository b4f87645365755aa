"""`openai` engine: model turns from remote OpenAI-compatible servers (`tsrl serve`, or `vllm serve`).

`await engine.generate(TurnRequest)` has TurnBatcher.generate's face, so a rollout process uses it in
place of a local batcher. Each request goes to the live server with the fewest requests in flight
(ties: the lowest index) as one POST /v1/completions with token ids in and out (vLLM's
`return_token_ids`, >= 0.10.2; `return_tokens_as_token_ids` covers older vLLM) and the sampled
tokens' log-probs (`logprobs: 0`).

Failover: a server that refuses the connection, answers 5xx or times out is marked dead (one line to
`log`) and the request is re-sent to another live one. Requests carry their seed, so the answer is the
same wherever it is computed (for servers on the same weights). A 4xx is the request's fault and is
raised at once (a 401, Unauthorized, says which key setting to fix). When no server is left, the error
names every URL and its cause. Dead servers stay dead for the engine's lifetime.

Every request carries `Authorization: Bearer KEY` when the engine has an API key (engines/auth.py).

Weights: join_bus() asks each server to join the run's weight bus (rl/weightbus.py) and sync() has
every live server take one sync; the learner's bus.send runs alongside (the servers block until it does).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tsrl_cli.engines.auth import API_KEY_ENV
from tsrl_cli.engines.protocol import TurnOutput, TurnRequest
from tsrl_cli.errors import OperationFailed, UsageError

# No proxy: rollout servers sit beside the run, and an http_proxy meant for the internet must not
# route (or refuse) requests to them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerDown(Exception):
    """The server is unreachable or failing (connection refused, timeout, 5xx, a reply that is not JSON)."""


class Unauthorized(OperationFailed):
    """HTTP 401: the server wants an API key that this client did not send, or another one."""


def _error_text(e: urllib.error.HTTPError) -> str:
    """The server's message from an error reply (OpenAI/vLLM {"error": {"message"}}, older vLLM {"message"})."""
    try:
        body = json.loads(e.read() or b"{}")
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    except Exception:  # noqa: BLE001 - not JSON: the status line says enough
        return e.reason or ""


def http_json(url: str, body: dict | None = None, timeout_s: float = 600.0, api_key: str | None = None) -> dict:
    """GET (body None) or POST JSON, with `Authorization: Bearer api_key` when given; the reply's JSON.
    Raises ServerDown, Unauthorized on a 401, or OperationFailed on another 4xx."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with _OPENER.open(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        if e.code >= 500:
            raise ServerDown(f"HTTP {e.code}: {_error_text(e)}") from None
        if e.code == 401:
            raise Unauthorized(f"{url}: HTTP 401 ({'the server refused our API key' if api_key else 'no API key sent'})"
                               f"; set rollout.server_api_key or {API_KEY_ENV} to the key the server was started "
                               "with") from None
        raise OperationFailed(f"{url}: HTTP {e.code}: {_error_text(e)}") from None
    except TimeoutError:
        raise ServerDown(f"no answer within {timeout_s:g} s") from None
    except urllib.error.URLError as e:
        why = e.reason
        raise ServerDown(f"no answer within {timeout_s:g} s" if isinstance(why, TimeoutError)
                         else f"cannot connect ({why})") from None
    except (OSError, http.client.HTTPException) as e:  # reset, closed mid-reply
        raise ServerDown(f"{type(e).__name__}: {e}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise ServerDown(f"the reply is not JSON ({raw[:80]!r})") from None


def turn_output(choice: dict, policy_version: int, url: str) -> TurnOutput:
    """One completions choice -> TurnOutput: token ids from `token_ids`, else from "token_id:N" tokens."""
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        toks = lp.get("tokens")
        if toks is None or not all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
            raise OperationFailed(f"{url}: the reply holds no token ids; the server needs return_token_ids "
                                  "(vLLM >= 0.10.2) or return_tokens_as_token_ids, or use tsrl serve")
        ids = [int(t.removeprefix("token_id:")) for t in toks]
    logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise OperationFailed(f"{url}: {len(ids)} tokens but {len(logprobs)} log-probs in the reply")
    ids = [int(t) for t in ids]
    reason = "stop" if choice.get("finish_reason") == "stop" else "length"
    stop = choice.get("stop_reason")
    if reason == "stop" and isinstance(stop, int) and (not ids or ids[-1] != stop):
        ids.append(stop)  # keep the stop token in the turn, as the hf engine does
        logprobs.append(0.0)  # not reported by the server
    return TurnOutput(ids, logprobs, reason, policy_version)


class OpenAIEngine:
    """Generate model turns on remote OpenAI-compatible servers, with least-loaded routing and failover.

    Args:
        servers: base URLs (http://host:port; a trailing /v1 is accepted).
        timeout_s: per HTTP request (connect and each read); a server that exceeds it is marked dead.
        log: one line per server marked dead.
        model: the `model` field to send (default: each server's first entry of /v1/models).
        api_key: sent as `Authorization: Bearer KEY` on every request (weight endpoints included);
            engines/auth.py client_api_key resolves it from rollout.server_api_key or TSRL_API_KEY.
        max_in_flight: HTTP requests at once (its own thread pool: asyncio's default executor stops at
            min(32, CPUs + 4) threads, fewer than a round's concurrent sessions).
    """

    def __init__(self, servers: list[str], timeout_s: float = 600.0, log: Callable[[str], None] = print,
                 model: str | None = None, max_in_flight: int = 256, api_key: str | None = None):
        if not servers:
            raise UsageError("the openai engine needs at least one server URL")
        self.servers = [s.rstrip("/").removesuffix("/v1") for s in servers]
        self.timeout_s, self.log, self.model, self.api_key = timeout_s, log, model, api_key
        self.inflight = [0] * len(self.servers)
        self.served = [0] * len(self.servers)  # answered per server (the load spread, for metrics and tests)
        self.dead: dict[str, str] = {}  # url -> cause
        self._models: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="tsrl-openai")

    def _http(self, url: str, body: dict | None = None) -> dict:
        return http_json(url, body, self.timeout_s, api_key=self.api_key)

    # ---- routing and failover
    def _acquire(self) -> int:
        with self._lock:
            live = [i for i, u in enumerate(self.servers) if u not in self.dead]
            if not live:
                causes = "; ".join(f"{u} ({self.dead[u]})" for u in self.servers)
                raise OperationFailed(f"no rollout server left: {causes}")
            k = min(live, key=lambda i: (self.inflight[i], i))
            self.inflight[k] += 1
            return k

    def _mark_dead(self, k: int, cause: str) -> None:
        url = self.servers[k]
        with self._lock:
            if url in self.dead:
                return
            self.dead[url] = cause
            left = len(self.servers) - len(self.dead)
        self.log(f"rollout server {url} is down ({cause}); {left} of {len(self.servers)} left")

    def _model_of(self, url: str) -> str:
        if self.model is not None:
            return self.model
        if url not in self._models:
            data = self._http(f"{url}/v1/models").get("data") or []
            if not data or "id" not in data[0]:
                raise ServerDown("/v1/models lists no model")
            self._models[url] = data[0]["id"]
        return self._models[url]

    def _complete(self, url: str, request: TurnRequest) -> TurnOutput:
        p = request.params
        body = {"model": self._model_of(url), "prompt": list(request.context_ids), "max_tokens": p.max_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed,
                "stop_token_ids": list(p.stop_token_ids), "n": 1, "stream": False,
                "logprobs": 0,  # vLLM: 0 = only the sampled token's log-prob
                "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                # vLLM: a turn ends at stop_token_ids or max_tokens only, as in tsrl's own engines, not also at the
                # tokenizer's end-of-sequence ids (tsrl serve ends turns that way whatever this says)
                "ignore_eos": True}
        reply = self._http(f"{url}/v1/completions", body)
        try:
            choice = reply["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise ServerDown(f"the reply has no choices ({str(reply)[:120]})") from None
        return turn_output(choice, int(reply.get("policy_version") or 0), url)

    async def generate(self, request: TurnRequest) -> TurnOutput:
        loop = asyncio.get_running_loop()
        while True:
            k = self._acquire()
            try:
                out = await loop.run_in_executor(self._pool, self._complete, self.servers[k], request)
            except ServerDown as e:
                self._mark_dead(k, str(e))
                continue  # seeded: any other server gives the same turn
            finally:
                with self._lock:
                    self.inflight[k] -= 1
            with self._lock:
                self.served[k] += 1
            return out

    # ---- weights
    def join_bus(self, host: str, port: int, first_rank: int, world: int, backend: str = "gloo",
                 epoch: int = 0) -> None:
        """Ask the i-th live server to join the weight bus at host:port as rank first_rank + i (returns at
        once; each server's join completes when every member, the learner included, has joined).
        A later `epoch` re-forms the bus without the servers marked dead."""
        for i, url in enumerate(u for u in self.servers if u not in self.dead):
            body = {"host": host, "port": int(port), "rank": first_rank + i, "world": world, "backend": backend,
                    "epoch": epoch}
            try:
                self._http(f"{url}/tsrl/weights/join", body)
            except ServerDown as e:
                raise OperationFailed(f"{url}: cannot join the weight bus ({e})") from None

    def weights_status(self) -> list[dict]:
        """GET /tsrl/weights/status of every server (joined, joining, error, policy_version)."""
        return [self._http(f"{url}/tsrl/weights/status") for url in self.servers]

    def sync(self) -> list[dict]:
        """Every live server takes one sync, concurrently; their replies {"version","start","end","bytes",...}
        in server order. Blocks until the learner has sent; a server that fails is marked dead and raises."""
        live = [u for u in self.servers if u not in self.dead]
        with ThreadPoolExecutor(max(1, len(live)), thread_name_prefix="tsrl-openai-sync") as ex:
            futs = [ex.submit(self._http, f"{u}/tsrl/weights/sync", {}) for u in live]
            replies, failed = [], []
            for u, f in zip(live, futs, strict=True):
                try:
                    replies.append(f.result())
                except (ServerDown, OperationFailed) as e:
                    failed.append(f"{u} ({e})")
                    if isinstance(e, ServerDown):
                        self._mark_dead(self.servers.index(u), str(e))
        if failed:
            raise OperationFailed(f"weight sync failed on {len(failed)} server(s): {'; '.join(failed)}")
        return replies

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
