"""Who may steer a `tsrl serve` server: its API key, where it may listen, how much it reads.

- **The key.** A server given a key (`--api-key`, or the TSRL_API_KEY environment variable) answers
  every endpoint but `GET /health` only to a request carrying `Authorization: Bearer KEY`, as
  `vllm serve --api-key` does (the scheme matched case-insensitively, the key exactly). Any other
  request is answered 401 before its body is read, so it never reaches the engine or the weight bus.
  The comparison is hmac.compare_digest over SHA-256 digests: its time depends neither on how much of
  the key a guess got right nor on the key's length.
- **Listening.** A server without a key listens on loopback only; an address beyond it is refused
  unless the caller passes `insecure` (a trusted network), since whoever reaches the port could
  generate on its devices and push weights into the policy through /tsrl/weights/join.
- **The client** (engines/openai.py) sends `rollout.server_api_key`, or TSRL_API_KEY when that is
  empty (client_api_key): a key written for the run wins over the ambient one.

The key crosses the network in clear over plain HTTP: beyond a trusted network, put the servers behind
TLS (a reverse proxy, or an SSH tunnel to a loopback server).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket

from tsrl_cli.config import API_KEY_CHARS
from tsrl_cli.errors import UsageError

API_KEY_ENV = "TSRL_API_KEY"
# a request body larger than this is refused (413): /v1/completions with a 128k-token prompt as JSON
# token ids is about 1 MB, a chat request of the same length in text about as much
MAX_BODY_MB = 8


def check_api_key(key: str, where: str) -> str:
    """`key` itself, or UsageError naming `where` when an HTTP header cannot carry it."""
    if not API_KEY_CHARS.fullmatch(key):
        raise UsageError(f"{where}: an API key is visible ASCII without spaces (it travels in an HTTP header)")
    return key


def client_api_key(configured: str = "") -> str | None:
    """The key a client sends: `configured` (rollout.server_api_key) when set, else TSRL_API_KEY, else none."""
    if configured:
        return check_api_key(configured, "rollout.server_api_key")
    env = os.environ.get(API_KEY_ENV, "")
    return check_api_key(env, API_KEY_ENV) if env else None


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("latin-1")).digest()


def bearer_ok(header: str | None, digest: bytes) -> bool:
    """Whether an Authorization header value is `Bearer <the key whose SHA-256 is digest>`."""
    scheme, _, given = (header or "").partition(" ")
    # latin-1: http.server decodes header bytes as latin-1, so this gives back the bytes that were sent
    same = hmac.compare_digest(hashlib.sha256(given.encode("latin-1", "replace")).digest(), digest)
    return same and scheme.lower() == "bearer"


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback one (127.0.0.0/8, ::1). '' and 0.0.0.0
    mean every interface; a name that does not resolve counts as beyond loopback (fail closed)."""
    try:
        infos = socket.getaddrinfo(host or None, None, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_listen(host: str, api_key: str | None, insecure: bool) -> None:
    """UsageError when a server would listen beyond loopback with no key and no `insecure`."""
    if api_key or insecure or is_loopback(host):
        return
    raise UsageError(f"--host {host or '(every interface)'}: listening beyond loopback without an API key lets "
                     f"anyone who reaches the port generate and push weights; pass --api-key KEY (or set "
                     f"{API_KEY_ENV}), or --insecure on a trusted network")
