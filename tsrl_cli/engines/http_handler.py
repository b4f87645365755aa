"""The HTTP side of `tsrl serve` (engines/server.py): one request routed to its RolloutServer, the API key
checked before the body is read, the body read by its Content-Length within the server's cap, and errors
answered in OpenAI's shape. Every reply closes its connection (HTTP/1.0).
"""

from __future__ import annotations

import json
import socket
import time
from http.server import BaseHTTPRequestHandler

from tsrl_cli.engines.api import ApiError
from tsrl_cli.engines.auth import bearer_ok


class RequestHandler(BaseHTTPRequestHandler):
    """One HTTP request to a RolloutServer: the handler's `self.server.app` (server.py sets it)."""

    server_version = "tsrl-serve"
    LINGER_S = 2.0  # after an error reply: how long the bytes the client still sends are read and dropped

    def setup(self) -> None:
        self.timeout = self.server.app.read_timeout_s  # every socket read: request line, headers, body
        super().setup()

    def log_message(self, format, *args) -> None:  # quiet: a line per request is noise
        pass

    def _send(self, status: int, obj, headers: tuple[tuple[str, str], ...] = ()) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
                409: "ConflictError", 411: "LengthRequiredError", 413: "RequestTooLargeError",
                501: "NotImplementedError", 503: "ServiceUnavailableError"}.get(e.status, "InternalServerError")
        self._send(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.status}},
                   (("WWW-Authenticate", "Bearer"),) if e.status == 401 else ())

    def _length(self) -> int | None:
        """The body's length as Content-Length declares it (0 when absent); None when it declares none
        that can be read: a chunked body, or a Content-Length that is not a byte count."""
        raw = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or (raw is not None and not raw.strip().isdigit()):
            return None
        return int(raw or 0)

    def _body(self):
        """The request's JSON body: exactly Content-Length bytes (the handler checked them against the cap)."""
        n, self._unread = self._unread, 0
        raw = self.rfile.read(n) if n else b""  # never more than declared, whatever the client sends after
        if len(raw) < n:
            raise ApiError(None, f"request body: the connection ended after {len(raw)} of {n} declared bytes")
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiError(None, f"request body: not valid JSON ({e})") from None

    def _linger(self) -> None:
        """After an error reply: end our side, then drop what the client still sends (at most about
        LINGER_S), so that closing does not reset the connection before the client has read the reply."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(self.LINGER_S)
            end = time.monotonic() + self.LINGER_S
            while time.monotonic() < end and self.rfile.read1(1 << 16):
                pass
        except OSError:  # reset, or the client sent nothing more within LINGER_S
            pass

    def _route(self, method: str) -> None:
        app = self.server.app  # the RolloutServer
        path = self.path.split("?", 1)[0].rstrip("/")
        routes = {
            ("GET", "/health"): lambda: app.health(),
            ("GET", "/v1/models"): lambda: {"object": "list", "data": [
                {"id": app.model_name, "object": "model", "created": 0, "owned_by": "tsrl"}]},
            ("POST", "/v1/completions"): lambda: app.complete(self._body()),
            ("POST", "/v1/chat/completions"): lambda: app.chat_complete(self._body()),
            ("POST", "/tsrl/weights/join"): lambda: app.join(self._body()),
            ("GET", "/tsrl/weights/status"): lambda: app.status(),
            ("POST", "/tsrl/weights/sync"): lambda: app.sync(),
        }
        n = self._length()
        self._unread = n or 0
        try:
            # the key first, unknown paths included: a request without it learns nothing and reads nothing
            if app.key_digest is not None and (method, path) != ("GET", "/health") and \
                    not bearer_ok(self.headers.get("Authorization"), app.key_digest):
                raise ApiError(None, "missing or wrong API key: send `Authorization: Bearer KEY` with the key "
                                     "this server was started with (--api-key or TSRL_API_KEY)", status=401)
            if n is None:
                raise ApiError(None, "request body: send it with a Content-Length (byte count); chunked bodies "
                                     "are not read", status=411)
            if n > app.max_body_bytes:
                raise ApiError(None, f"request body: {n} bytes is over this server's cap of {app.max_body_bytes} "
                                     "(tsrl serve --max-body-mb)", status=413)
            if (method, path) not in routes:
                raise ApiError(None, f"{method} {path}: no such endpoint", status=404)
            self._send(200, routes[(method, path)]())
        except ApiError as e:
            self._reply_error(e)
        except TimeoutError:  # the declared body stopped arriving
            self._reply_error(ApiError(None, f"request body: nothing arrived for {app.read_timeout_s:g} s", 408))
        except (BrokenPipeError, ConnectionResetError):  # the client went away
            pass

    def _reply_error(self, e: ApiError) -> None:
        try:
            self._error(e)
            self._linger()
        except OSError:  # the client went away
            pass

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

