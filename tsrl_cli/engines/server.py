"""`tsrl serve`: an OpenAI-compatible server over any PolicyEngine, plus weight-bus endpoints.

    POST /v1/completions      vLLM's token-id subset (prompt = token ids); replies with token ids,
                              log-probs and our `policy_version`
    POST /v1/chat/completions OpenAI chat (non-streaming), rendered in the served model's chat format
    GET  /health, /v1/models  readiness; the served model name
    POST /tsrl/weights/join   {"host","port","rank","world","backend"}: join the weight bus (background)
    GET  /tsrl/weights/status {"joined","joining","error",...}
    POST /tsrl/weights/sync   take one sync from the bus; blocks until applied, then
                              {"version","start","end","bytes","published_at"} (time.time() seconds)

Concurrent HTTP requests (one thread each) meet in one batcher (engines/batching.py make_batcher;
`batching` continuous by default: a turn joins the engine's running batch at its next step). When a
sync's first bucket arrives it pauses the batcher, which admits nothing more and waits until every
running turn has returned, and resumes it once the new version is set: a turn runs wholly on the old
weights or wholly on the new ones. The weight bus lives in tsrl_cli/rl (which imports the engines),
so the server is handed its join function (`join_bus`, e.g. WeightBus.join) instead of importing it;
without one the weight endpoints answer 501.
The chat format comes the same way (`chat`, an api.ChatFormat; the agent's renderer for tsrl serve).

Who may ask (engines/auth.py): with `api_key`, every endpoint but GET /health needs `Authorization:
Bearer KEY` (401 otherwise, before the body is read); without one the server listens on loopback
only, unless `insecure`. A body is read by its Content-Length, never beyond it and never beyond
`max_body_bytes` (413); a body that stops arriving is dropped after `read_timeout_s` (408). Every
reply closes its connection (HTTP/1.0), so unread bytes are never taken for a next request
(engines/http_handler.py reads and answers the requests).

Library use: `serve(engine, host, port, model_name)` blocks; `start_server(engine)` runs in a
background thread and returns the server (`.url`, `.shutdown()`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path

from tsrl_cli.devices import engine_device
from tsrl_cli.engines.api import (
    ApiError,
    ChatFormat,
    chat_reply,
    completion_reply,
    int_field,
    parse_chat,
    parse_completion,
)
from tsrl_cli.engines.auth import MAX_BODY_MB, check_api_key, check_listen, key_digest
from tsrl_cli.engines.batching import make_batcher
from tsrl_cli.engines.http_handler import RequestHandler
from tsrl_cli.engines.load import ENGINE_DTYPES, ENGINES, open_engine
from tsrl_cli.engines.protocol import TurnOutput, TurnRequest, can_step
from tsrl_cli.engines.weight_sync import apply_sync
from tsrl_cli.errors import UsageError

# ---- the server ---------------------------------------------------------------------------------

class _Guarded:
    """The engine as the batcher sees it: refused once closing (turns still queued or running are answered
    503, not computed)."""

    def __init__(self, engine):
        self.engine, self.closing = engine, False

    def _check(self) -> None:
        if self.closing:
            raise RuntimeError("server is shutting down")

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        self._check()
        return self.engine.generate(requests)


class _GuardedSteps(_Guarded):
    """_Guarded for an engine that batches continuously (engines/protocol.py SteppingEngine)."""

    def add(self, rid: int, request: TurnRequest) -> None:
        self._check()
        self.engine.add(rid, request)

    def step(self) -> list[tuple[int, TurnOutput]]:
        self._check()
        return self.engine.step()

    def running(self) -> int:
        return self.engine.running()


class RolloutServer:
    """An HTTP server over one engine. `join_bus(host=, port=, rank=, world=, backend=)` forms the weight
    bus (e.g. functools.partial(WeightBus.join, device=...)); None disables the weight endpoints.
    `chat` (a ChatFormat) enables /v1/chat/completions. `api_key`, `insecure`, `max_body_bytes` and
    `read_timeout_s` decide who may ask and how much is read (the module's docstring)."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, model_name: str = "tsrl",
                 join_bus: Callable | None = None, max_batch: int = 8, *, batching: str = "continuous",
                 api_key: str | None = None,
                 insecure: bool = False, chat: ChatFormat | None = None, max_body_bytes: int = MAX_BODY_MB << 20,
                 read_timeout_s: float = 60.0):
        self.engine, self.model_name, self.join_fn, self.chat = engine, model_name, join_bus, chat
        if max_body_bytes < 1:
            raise UsageError(f"--max-body-mb: must be positive, got {max_body_bytes} bytes")
        check_listen(host, api_key, insecure)
        # only the key's digest is kept: bearer_ok compares digests (engines/auth.py)
        self.key_digest = key_digest(check_api_key(api_key, "--api-key")) if api_key else None
        self.max_body_bytes, self.read_timeout_s = max_body_bytes, read_timeout_s
        try:
            self.httpd = ThreadingHTTPServer((host, port), RequestHandler)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port") from None
        self.httpd.app = self
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._guarded = (_GuardedSteps if can_step(engine) else _Guarded)(engine)
        self.batcher = make_batcher(self._guarded, max_batch, batching)
        self._loop = asyncio.new_event_loop()  # only to drive the batcher's futures from the handler threads
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
        """Stop accepting, answer in-flight completions with 503 (clients fail over), stop the batcher's thread."""
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
        return completion_reply(self._generate(request, opts), request.context_ids, self.model_name, opts)

    def chat_complete(self, body) -> dict:
        if self.chat is None:
            raise ApiError(None, "this server has no chat format (its policy's tokenizer is not ChatML); use "
                                 "/v1/completions with token ids", status=501)
        request, opts = parse_chat(body, self.chat)
        return chat_reply(self._generate(request, opts), request.context_ids, self.model_name, opts, self.chat)

    def _generate(self, request: TurnRequest, opts: dict) -> TurnOutput:
        """One turn through the batcher; 404 for another model's name, 503 while broken or shutting down."""
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
            if getattr(self.batcher, "error", None) is not None:  # the engine is unusable: clients go elsewhere
                self.broken = f"the engine failed ({type(e).__name__}: {e}); restart this server"
            raise ApiError(None, f"engine error: {type(e).__name__}: {e}", status=500) from None
        finally:
            with self._state:
                self._inflight.discard(fut)
        return out

    # -- weights
    def join(self, body) -> dict:
        if self.join_fn is None:
            raise ApiError(None, "this server has no weight bus (start it with tsrl serve, or pass join_bus=)", 501)
        if not isinstance(body, dict):
            raise ApiError(None, "request body: expected a JSON object")
        args = {"host": body.get("host"), "port": int_field(body, "port", None, lo=1),
                "rank": int_field(body, "rank", None, lo=1), "world": int_field(body, "world", None, lo=2),
                "backend": body.get("backend", "gloo"),
                "epoch": int_field(body, "epoch", 0, lo=0)}
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
        """Take one sync from the bus (engines/weight_sync.py apply_sync), the batcher paused from its first
        bucket on."""
        if self._join_thread is None:
            raise ApiError(None, "not on a weight bus: POST /tsrl/weights/join first", status=409)
        self._join_thread.join()
        if self.bus is None:
            raise ApiError(None, f"joining the weight bus failed: {self.join_status['error']}", status=500)
        with self._sync_lock:
            start = time.time()
            locked = False

            def lock() -> None:  # from the first bucket on, no turn may run until the version is set
                nonlocal locked
                self.batcher.pause()
                locked = True

            try:
                info = apply_sync(self.engine, self.bus.receive, first_bucket=lock)
            except Exception as e:  # noqa: BLE001 - the engine may now hold some buckets of each version
                if locked:
                    self.broken = f"a weight sync failed half-way ({type(e).__name__}: {e}); restart this server"
                raise ApiError(None, f"weight sync failed: {type(e).__name__}: {e}", status=500) from None
            finally:
                if locked:
                    self.batcher.resume()
        return {"version": info["version"], "published_at": info.get("published_at"), "bytes": info["bytes"],
                "start": start, "end": time.time()}


# ---- entry points -------------------------------------------------------------------------------

def start_server(engine, host: str = "127.0.0.1", port: int = 0, model_name: str = "tsrl", **options) -> RolloutServer:
    """A RolloutServer answering from a background thread (port 0: the OS picks one; see `.url`).
    `options`: RolloutServer's (join_bus, max_batch, batching, api_key, insecure, chat, max_body_bytes,
    read_timeout_s)."""
    srv = RolloutServer(engine, host, port, model_name, **options)
    srv._serving = True  # before the thread starts: a shutdown() right away must still stop it
    threading.Thread(target=srv.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="tsrl-serve",
                     daemon=True).start()
    return srv


def serve(engine, host: str, port: int, model_name: str, ready_cb: Callable[[str], None] | None = None,
          **options) -> None:
    """Serve `engine` until interrupted (Ctrl-C) or shut down; ready_cb(url) once it accepts requests.
    `options`: as start_server's."""
    srv = RolloutServer(engine, host, port, model_name, **options)
    try:
        if ready_cb is not None:
            ready_cb(srv.url)
        srv.serve_forever()
    finally:
        srv.shutdown()


def open_served_engine(model: str, kind: str = "hf", device: str = "cpu", dtype: str = "auto",
                       batch_invariant: bool = False):
    """(engine, bus device) for `tsrl serve`: the policy in `model` (a save_pretrained folder) in a `kind`
    engine (hf, vllm) on `device`, every option checked before anything loads; the engine itself from
    engines/load.py open_engine.

    dtype auto: the hf engine loads bfloat16 on CUDA and float32 on CPU; vLLM reads the model's config.
    The bus device is where weight-bus buckets land (cuda:N lets an hf server join an NCCL bus).
    """
    if kind not in ENGINES:
        raise UsageError(f"--engine {kind!r}: use one of {', '.join(ENGINES)}")
    if dtype not in ENGINE_DTYPES:
        raise UsageError(f"--dtype {dtype!r}: use one of {', '.join(ENGINE_DTYPES)}")
    dev = engine_device(device, "--device")
    if not (Path(model) / "config.json").is_file():
        raise UsageError(f"--model {model}: not a model directory (no config.json); pass a folder written by "
                         "save_pretrained (model + tokenizer)")
    return open_engine(model, kind, (dev,), dtype, batch_invariant=batch_invariant)
