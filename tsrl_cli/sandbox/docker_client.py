"""The Docker daemon, reached in one place: the SDK client, the check that a daemon answers, image pulls.

    docker_client(timeout_s, what)   the Docker SDK's client after a ping; UsageError naming `what` and why
                                     there is none (the package missing, no daemon, no permission)
    docker_unavailable_reason()      None when a daemon answers a ping, else that reason in one line
    image_exists(client, image)      whether the daemon holds `image`
    ensure_image(client, image)      `image` on the daemon, pulled when missing; a failed pull is one line
                                     naming the image and the cause (pull_error)

Every check runs when it is called, never at import: a daemon can come up or go away while a
process (a test session, a long run) lives. Nothing else in tsrl constructs a Docker client
(tests/test_layering.py).

Pull failures, as the Docker Engine API reports them (docker.errors, docker SDK 7), by the daemon's
status and words: a reference that is no image name (InvalidRepository from the SDK, HTTP 400
"invalid reference format" from the daemon) and an image its registry does not know (HTTP 404,
NotFound or ImageNotFound, "repository does not exist", which Docker Hub also answers for a private
one; dockerd 20.10 answers a tag a registry lacks with HTTP 500 "manifest unknown") are bad input,
UsageError (exit 2). A registry that refuses the credentials (401, 403, "no basic auth
credentials"), one that cannot be reached (500: "dial tcp", "no such host", an offline node, a
mirror down), any other error of the pull or its progress stream, and a daemon that stops answering
are failed operations, OperationFailed (exit 1).
"""

from __future__ import annotations

import re

from tsrl_cli.errors import OperationFailed, UsageError

PING_TIMEOUT_S = 5.0  # a daemon that does not answer a ping within this is "not reachable"

_I = re.IGNORECASE
_BAD_NAME = re.compile(r"invalid reference format", _I)
_NOT_FOUND = re.compile(r"manifest unknown|repository does not exist|name unknown|not found", _I)
_AUTH = re.compile(r"unauthorized|authentication required|denied|forbidden|no basic auth credentials", _I)
_UNREACHABLE = re.compile(r"dial tcp|no such host|i/o timeout|connection refused|network is unreachable|"
                          r"timeout exceeded|tls handshake|server misbehaving|temporary failure", _I)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _connect(timeout_s: float):
    """(client, None) when a daemon answers a ping, else (None, why not)."""
    try:
        import docker
    except ImportError:
        return None, "the docker package is not installed (pip install 'tsrl[docker]')"
    try:
        # the SDK asks the daemon its API version on construction: a short timeout for that and the
        # ping, so that a daemon that hangs is "not reachable" in seconds, then the caller's
        client = docker.from_env(timeout=min(timeout_s, PING_TIMEOUT_S))
        client.ping()
    except Exception as e:  # noqa: BLE001  DockerException, connection or permission errors
        return None, f"no Docker daemon reachable: {type(e).__name__}: {_first_line(e)}"
    client.api.timeout = timeout_s  # what every later call of this client may take
    return client, None


def docker_client(timeout_s: float, what: str):
    """The Docker SDK's client (close it when done), or UsageError "<what> needs Docker: <why>".

    timeout_s: seconds any one API call may take; a sandbox whose command is silent for hours needs
    a long one, a query of the image list a short one.
    """
    client, reason = _connect(timeout_s)
    if client is None:
        fix = ("; start a Docker daemon this user may reach (`docker info` answers), or run where one does"
               if reason.startswith("no Docker daemon") else "")
        raise UsageError(f"{what} needs Docker: {reason}{fix}")
    return client


def docker_unavailable_reason() -> str | None:
    """None when a Docker daemon answers a ping, else why not (one line)."""
    client, reason = _connect(PING_TIMEOUT_S)
    if client is not None:
        client.close()
    return reason


def image_exists(client, image: str) -> bool:
    """Whether the daemon holds `image`; a name that is no image reference is a UsageError."""
    import docker

    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as e:
        if e.status_code == 400:
            raise pull_error(image, e) from None
        raise


def ensure_image(client, image: str) -> None:
    """`image` on the daemon: nothing when it is there, else a pull; a failed pull raises pull_error."""
    import docker

    if image_exists(client, image):
        return
    repository, tag = docker.utils.parse_repository_tag(image)
    try:
        # the low-level stream: an error after the pull started comes as an {"error": ...} item, which
        # the SDK's images.pull() skips (the image is then just missing)
        for item in client.api.pull(repository, tag=tag or "latest", stream=True, decode=True):
            if isinstance(item, dict) and item.get("error"):
                raise _failure(image, _first_line(item["error"]))
    except (UsageError, OperationFailed):
        raise
    except Exception as e:  # noqa: BLE001  mapped to one line; anything unknown is an OperationFailed
        raise pull_error(image, e) from None
    if not image_exists(client, image):
        raise OperationFailed(f"docker: pulling image {image} ended without that image on this daemon")


def pull_error(image: str, e: BaseException) -> UsageError | OperationFailed:
    """The one-line error for a failed pull (or lookup) of `image` (the classes of the module doc)."""
    import docker

    if isinstance(e, docker.errors.InvalidRepository):
        return UsageError(f"image {image!r}: not an image name ({_first_line(e)}); give NAME[:TAG] or NAME@DIGEST")
    if isinstance(e, docker.errors.APIError):
        return _failure(image, _first_line(e.explanation or e), e.status_code)
    if isinstance(e, OSError):  # requests' connection errors and timeouts: the daemon went away mid-pull
        return OperationFailed(f"docker: pulling image {image} failed: the Docker daemon stopped answering "
                               f"({type(e).__name__}: {_first_line(e)})")
    return _failure(image, f"{type(e).__name__}: {_first_line(e)}")


def _failure(image: str, cause: str, status: int | None = None) -> UsageError | OperationFailed:
    """By the daemon's status and words: dockerd 20.10 answers a tag a registry lacks with HTTP 500
    "manifest unknown", Docker Hub a missing repository with 404 "repository does not exist"."""
    if status == 400 or _BAD_NAME.search(cause):
        return UsageError(f"image {image!r}: not an image name (Docker: {cause}); give NAME[:TAG] or NAME@DIGEST")
    if status == 404 or _NOT_FOUND.search(cause):
        return UsageError(f"docker: image {image} was not found (Docker: {cause}); check its name and tag "
                          "(a private image needs `docker login` first)")
    if _AUTH.search(cause):
        fix = "the registry refused the credentials: `docker login` to it, then rerun"
    elif _UNREACHABLE.search(cause):
        fix = ("its registry cannot be reached from this machine: `docker pull` it where one can be reached "
               "and `docker save` / `docker load` it here, or build it locally")
    else:
        fix = "`docker pull` it by hand to see the daemon's full answer"
    return OperationFailed(f"docker: pulling image {image} failed: "
                           f"{cause}{f' (HTTP {status})' if status else ''}; {fix}")
