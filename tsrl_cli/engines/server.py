"""`tsrl serve`: an OpenAI-compatible completions server over any PolicyEngine, plus weight-bus endpoints.

    POST /v1/completions      vLLM's token-id subset (prompt = token ids); replies with token ids,
                              log-probs and our `policy_version`
    GET  /health, /v1/models  readiness; the served model name
    POST /tsrl/weights/join   {"host","port","rank","world","backend"}: join the weight bus (background)
    GET  /tsrl/weights/status {"joined","joining","error",...}
    POST /tsrl/weights/sync   take one sync from the bus; blocks until applied, then
                              {"version","start","end","bytes","published_at"} (time.time() seconds)

Concurrent HTTP requests (one thread each) meet in one TurnBatcher, so many agent sessions share
batched engine calls. A sync takes the weights lock when its first bucket arrives and holds it until
the new version is set: a batch runs wholly on the old weights or wholly on the new ones. The weight
bus lives in tsrl_cli/rl (which imports the engines), so the server is handed its join function
(`join_bus`, e.g. WeightBus.join) instead of importing it; without one the weight endpoints answer 501.

Library use: `serve(engine, host, port, model_name)` blocks; `start_server(engine)` runs in a
background thread and returns the server (`.url`, `.shutdown()`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tsrl_cli.devices import engine_device
from tsrl_cli.engines.base import SamplingParams, TurnBatcher, TurnOutput, TurnRequest, apply_sync
from tsrl_cli.engines.load import ENGINE_DTYPES, ENGINES, open_engine
from tsrl_cli.errors import UsageError

SEED_RANGE = (-(2**63), 2**63 - 1)  # vLLM's bound (a torch long)


class ApiError(Exception):
    """An error reply: HTTP `status` (400: a bad request, whose `param` names the field)."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


# ---- request parsing ----------------------------------------------------------------------------

def _int(body: dict, key: str, default, lo: int | None = None):
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


def parse_completion(body) -> tuple[TurnRequest, dict]:
    """A /v1/completions body -> (TurnRequest, reply options). Raises ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError(None, "request body: expected a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise ApiError("prompt", "prompt: text prompts are not accepted; send token ids (this server does not "
                                   "tokenize)")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):  # [[ids]]: a batch of one
        if len(prompt) != 1:
            raise ApiError("prompt", f"prompt: {len(prompt)} prompts in one request; send one per request")
        prompt = prompt[0]
    prompt = _token_ids(prompt, "prompt")
    if not prompt:
        raise ApiError("prompt", "prompt: empty; a completion needs at least one context token")
    if _int(body, "n", 1, lo=1) != 1:
        raise ApiError("n", "n: only n=1 is served; send one request per sample (each with its own seed)")
    for flag in ("stream", "echo", "use_beam_search"):
        if body.get(flag):
            raise ApiError(flag, f"{flag}: not supported by tsrl serve")
    seed = _int(body, "seed", None)
    if seed is None:
        seed = secrets.randbits(63)  # OpenAI semantics: no seed, a fresh sample each time
    elif not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ApiError("seed", f"seed: {seed} does not fit in 64 bits")
    params = SamplingParams(
        temperature=_float(body, "temperature", 1.0, 0.0, 1e6),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        max_tokens=_int(body, "max_tokens", 16, lo=1),  # 16: the OpenAI and vLLM default
        stop_token_ids=tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids")),
        seed=seed,
    )
    logprobs = _int(body, "logprobs", None, lo=0)
    rti = body.get("return_token_ids")
    if rti is not None and not isinstance(rti, bool):
        raise ApiError("return_token_ids", f"return_token_ids: expected true or false, got {rti!r}")
    return TurnRequest(prompt, params), {"logprobs": logprobs, "return_token_ids": bool(rti),
                                         "model": body.get("model")}


def completion_reply(out: TurnOutput, prompt_ids: list[int], model_name: str, opts: dict) -> dict:
    """The OpenAI completions shape (vLLM's token-id fields) for one TurnOutput.

    `text` is empty (the server holds no tokenizer); `tokens` are "token_id:N" as vLLM writes them with
    return_tokens_as_token_ids. Only the sampled token's log-prob is reported: top_logprobs is null
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


# ---- the server ---------------------------------------------------------------------------------

class _Guarded:
    """The engine as the batcher sees it: generation holds the weights lock; refused once closing."""

    def __init__(self, engine, lock: threading.Lock):
        self.engine, self.lock, self.closing = engine, lock, False

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        if self.closing:  # shutting down: batches still queued are answered with 503, not computed
            raise RuntimeError("server is shutting down")
        with self.lock:
            return self.engine.generate(requests)


class RolloutServer:
    """An HTTP server over one engine. `join_bus(host=, port=, rank=, world=, backend=)` forms the weight
    bus (e.g. functools.partial(WeightBus.join, device=...)); None disables the weight endpoints."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, model_name: str = "tsrl",
                 join_bus: Callable | None = None, max_batch: int = 8):
        self.engine, self.model_name, self.join_fn = engine, model_name, join_bus
        try:
            self.httpd = ThreadingHTTPServer((host, port), _Handler)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port") from None
        self.httpd.app = self
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.weights_lock = threading.Lock()  # held by a batch, or by a sync from its first bucket to its end
        self._guarded = _Guarded(engine, self.weights_lock)
        self.batcher = TurnBatcher(self._guarded, max_batch=max_batch)
        self._loop = asyncio.new_event_loop()  # only to drive TurnBatcher's futures from the handler threads
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="tsrl-serve-loop", daemon=True)
        self._loop_thread.start()
        self._inflight: set[concurrent.futures.Future] = set()
        self._state = threading.Lock()
        self.aborted = 0  # requests in flight at shutdown, answered 503 (tests check the path ran)
        self.broken: str | None = None  # a sync failed half-way: the weights are neither version
        self.bus = None
        self.join_status: dict = {"joined": False, "joining": False, "error": None}
        self._join_thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()  # one sync at a time
        self._serving = False
        self._closed = False

    # -- lifecycle
    def serve_forever(self) -> None:
        self._serving = True
        self.httpd.serve_forever(poll_interval=0.1)

    def shutdown(self) -> None:
        """Stop accepting, answer in-flight completions with 503 (clients fail over), stop the engine thread."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._guarded.closing = True
            inflight, self._inflight = list(self._inflight), set()
        if self._serving:
            self.httpd.shutdown()
        self.httpd.server_close()  # new connections are refused from here on
        for fut in inflight:
            fut.cancel()
        self.batcher.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=30)

    @property
    def in_flight(self) -> int:
        """Completions accepted and not yet answered."""
        return len(self._inflight)

    def health(self) -> dict:
        if self.broken:
            raise ApiError(None, self.broken, status=503)
        return {"status": "ok", "model": self.model_name, "policy_version": self.engine.version}

    # -- completions
    def complete(self, body) -> dict:
        request, opts = parse_completion(body)
        if opts["model"] not in (None, self.model_name):
            raise ApiError("model", f"model: {opts['model']!r} is not served here (this server serves "
                                      f"{self.model_name!r})", status=404)
        if self.broken:
            raise ApiError(None, self.broken, status=503)
        with self._state:
            if self._closed:
                raise ApiError(None, "server is shutting down", status=503)
            fut = asyncio.run_coroutine_threadsafe(self.batcher.generate(request), self._loop)
            self._inflight.add(fut)
        try:
            out = fut.result()
        except Exception as e:  # noqa: BLE001 - cancelled at shutdown, or the engine failed on this batch
            if self._closed:
                with self._state:
                    self.aborted += 1
                raise ApiError(None, "server is shutting down", status=503) from None
            raise ApiError(None, f"engine error: {type(e).__name__}: {e}", status=500) from None
        finally:
            with self._state:
                self._inflight.discard(fut)
        return completion_reply(out, request.context_ids, self.model_name, opts)

    # -- weights
    def join(self, body) -> dict:
        if self.join_fn is None:
            raise ApiError(None, "this server has no weight bus (start it with tsrl serve, or pass join_bus=)", 501)
        if not isinstance(body, dict):
            raise ApiError(None, "request body: expected a JSON object")
        args = {"host": body.get("host"), "port": _int(body, "port", None, lo=1), "rank": _int(body, "rank", None, lo=1),
                "world": _int(body, "world", None, lo=2), "backend": body.get("backend", "gloo"),
                "epoch": _int(body, "epoch", 0, lo=0)}
        for k, v in args.items():
            if v is None:
                raise ApiError(k, f"{k}: missing")
        if not isinstance(args["host"], str):
            raise ApiError("host", f"host: expected a string, got {args['host']!r}")
        if args["backend"] not in ("gloo", "nccl"):
            raise ApiError("backend", f"backend: {args['backend']!r}; use gloo or nccl")
        if args["rank"] >= args["world"]:
            raise ApiError("rank", f"rank: {args['rank']} is not below world {args['world']}")
        with self._state:  # a later epoch replaces the bus (the run lost a server and re-forms it)
            if (self.join_status["joining"] or self.join_status["joined"]) and \
                    args["epoch"] <= self.join_status.get("epoch", 0):
                raise ApiError(None, "already joined (or joining) a weight bus", status=409)
            self.bus = None
            self.join_status = {"joined": False, "joining": True, "error": None, "rank": args["rank"],
                                "world": args["world"], "backend": args["backend"], "epoch": args["epoch"]}

        def run() -> None:  # blocks until every member joined
            try:
                self.bus = self.join_fn(**args)
                self.join_status.update(joined=True, joining=False)
            except Exception as e:  # noqa: BLE001 - reported through /tsrl/weights/status and /sync
                self.join_status.update(joining=False, error=f"{type(e).__name__}: {e}")

        self._join_thread = threading.Thread(target=run, name="tsrl-bus-join", daemon=True)
        self._join_thread.start()
        return {"joining": True}

    def status(self) -> dict:
        # weight_bus: whether this server can join one at all (started with a join function, as tsrl serve is)
        return {**self.join_status, "policy_version": self.engine.version, "weight_bus": self.join_fn is not None}

    def sync(self) -> dict:
        """Take one sync from the bus (engines/base.py apply_sync), batches held off from its first bucket on."""
        if self._join_thread is None:
            raise ApiError(None, "not on a weight bus: POST /tsrl/weights/join first", status=409)
        self._join_thread.join()
        if self.bus is None:
            raise ApiError(None, f"joining the weight bus failed: {self.join_status['error']}", status=500)
        with self._sync_lock:
            start = time.time()
            locked = False

            def lock() -> None:  # from the first bucket on, no batch may run until the version is set
                nonlocal locked
                self.weights_lock.acquire()
                locked = True

            try:
                info = apply_sync(self.engine, self.bus.receive, first_bucket=lock)
            except Exception as e:  # noqa: BLE001 - the engine may now hold some buckets of each version
                if locked:
                    self.broken = f"a weight sync failed half-way ({type(e).__name__}: {e}); restart this server"
                raise ApiError(None, f"weight sync failed: {type(e).__name__}: {e}", status=500) from None
            finally:
                if locked:
                    self.weights_lock.release()
        return {"version": info["version"], "published_at": info.get("published_at"), "bytes": info["bytes"],
                "start": start, "end": time.time()}


class _Handler(BaseHTTPRequestHandler):
    server_version = "tsrl-serve"

    def log_message(self, format, *args) -> None:  # quiet: a line per request is noise
        pass

    def _send(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        kind = {400: "ApiErrorError", 404: "NotFoundError", 409: "ConflictError", 501: "NotImplementedError",
                503: "ServiceUnavailableError"}.get(e.status, "InternalServerError")
        self._send(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.status}})

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiError(None, f"request body: not valid JSON ({e})") from None

    def _route(self, method: str) -> None:
        app: RolloutServer = self.server.app
        path = self.path.split("?", 1)[0].rstrip("/")
        routes = {
            ("GET", "/health"): lambda: app.health(),
            ("GET", "/v1/models"): lambda: {"object": "list", "data": [
                {"id": app.model_name, "object": "model", "created": 0, "owned_by": "tsrl"}]},
            ("POST", "/v1/completions"): lambda: app.complete(self._body()),
            ("POST", "/tsrl/weights/join"): lambda: app.join(self._body()),
            ("GET", "/tsrl/weights/status"): lambda: app.status(),
            ("POST", "/tsrl/weights/sync"): lambda: app.sync(),
        }
        try:
            if (method, path) not in routes:
                raise ApiError(None, f"{method} {path}: no such endpoint", status=404)
            self._send(200, routes[(method, path)]())
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):  # the client went away
            pass

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")


# ---- entry points -------------------------------------------------------------------------------

def start_server(engine, host: str = "127.0.0.1", port: int = 0, model_name: str = "tsrl",
                 join_bus: Callable | None = None, max_batch: int = 8) -> RolloutServer:
    """A RolloutServer answering from a background thread (port 0: the OS picks one; see `.url`)."""
    srv = RolloutServer(engine, host, port, model_name, join_bus=join_bus, max_batch=max_batch)
    srv._serving = True  # before the thread starts: a shutdown() right away must still stop it
    threading.Thread(target=srv.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="tsrl-serve",
                     daemon=True).start()
    return srv


def serve(engine, host: str, port: int, model_name: str, ready_cb: Callable[[str], None] | None = None,
          join_bus: Callable | None = None, max_batch: int = 8) -> None:
    """Serve `engine` until interrupted (Ctrl-C) or shut down; ready_cb(url) once it accepts requests."""
    srv = RolloutServer(engine, host, port, model_name, join_bus=join_bus, max_batch=max_batch)
    try:
        if ready_cb is not None:
            ready_cb(srv.url)
        srv.serve_forever()
    finally:
        srv.shutdown()


def open_served_engine(model: str, engine: str = "hf", device: str = "cpu", dtype: str = "auto",
                       batch_invariant: bool = False):
    """(engine, bus device) for `tsrl serve`: the policy in `model` (a save_pretrained folder) on `device`,
    every option checked before anything loads; the engine itself from engines/load.py open_engine.

    dtype auto: the hf engine loads bfloat16 on CUDA and float32 on CPU; vLLM reads the model's config.
    The bus device is where weight-bus buckets land (cuda:N lets an hf server join an NCCL bus).
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if dtype not in ENGINE_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use one of {', '.join(ENGINE_DTYPES)}")
    dev = engine_device(device, "--device")
    if not (Path(model) / "config.json").is_file():
        raise UsageError(f"--model {model}: not a model directory (no config.json); pass a folder written by "
                         "save_pretrained (model + tokenizer)")
    return open_engine(model, engine, (dev,), dtype, batch_invariant=batch_invariant)
