"""What an image costs to pull, asked of its registry before pulling: the distribution API's manifests.

    image_ref("swebench/sweb.eval.x86_64.django_1776_django-11099:latest")
        -> Ref(registry "registry-1.docker.io", repository "swebench/sweb.eval...", reference "latest")
    download_bytes(ref)  the compressed bytes a pull downloads: the config blob and every layer of the
                         manifest for this machine's platform (an index or manifest list is resolved to it)

Names are normalised as Docker does (distribution's reference grammar): a first component with a dot
or a colon, or `localhost`, is a registry host; otherwise Docker Hub, and a one-component name is under
`library/`. Loopback registries are spoken to over http, as the daemon treats 127.0.0.0/8 as insecure
by default; every other over https. A 401 with a Bearer challenge gets an anonymous token from the
realm it names (Docker Hub's public images); a registry that wants credentials answers 401 again, and
the size is then unknown (RegistryError): the pull itself goes through the daemon, which has the
credentials `docker login` stored.

Only the standard library: the size check works where the docker SDK is not installed.
"""

from __future__ import annotations

import json
import platform
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

DOCKER_HUB = "registry-1.docker.io"
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = MANIFEST_TYPES[:2]
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le",
         "s390x": "s390x"}
_LOOPBACK = ("localhost", "127.", "[::1]")


class RegistryError(Exception):
    """The registry could not say what a pull costs (unreachable, credentials wanted, no such manifest)."""


@dataclass(frozen=True)
class Ref:
    registry: str  # host[:port]
    repository: str
    reference: str  # a tag or a digest (sha256:...)

    @property
    def base_url(self) -> str:
        scheme = "http" if self.registry.startswith(_LOOPBACK) else "https"
        return f"{scheme}://{self.registry}/v2/{self.repository}"


def image_ref(image: str) -> Ref:
    """The registry, repository and tag or digest an image name means (Docker's normalisation)."""
    name, digest = (image.split("@", 1) + [""])[:2]
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, name
    tag = ""
    if ":" in path.rsplit("/", 1)[-1]:
        path, tag = path.rsplit(":", 1)
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not path or not re.fullmatch(r"[a-z0-9]+(?:[._-]+[a-z0-9]+|__)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*", path):
        raise ValueError(f"image {image!r}: not an image name; give NAME[:TAG] or NAME@DIGEST")
    return Ref(registry, path, digest or tag or "latest")


def this_platform() -> tuple[str, str]:
    """(os, architecture) as image indexes name them."""
    m = platform.machine().lower()
    return "linux", _ARCH.get(m, m)


def _get(url: str, accept: str, timeout_s: float, token: str | None = None) -> tuple[bytes, str]:
    headers = {"Accept": accept}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
        return r.read(), r.headers.get("Content-Type", "")


def _anonymous_token(challenge: str, timeout_s: float) -> str | None:
    """The token a `Bearer realm=...,service=...,scope=...` challenge grants without credentials."""
    if not challenge.lower().startswith("bearer "):
        return None
    fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    if "realm" not in fields:
        return None
    query = urllib.parse.urlencode({k: v for k, v in fields.items() if k in ("service", "scope")})
    body, _ = _get(f"{fields['realm']}?{query}", "application/json", timeout_s)
    doc = json.loads(body)
    return doc.get("token") or doc.get("access_token")


def _manifest(ref: Ref, reference: str, timeout_s: float, token: list) -> tuple[dict, str]:
    url = f"{ref.base_url}/manifests/{reference}"
    accept = ", ".join(MANIFEST_TYPES)
    try:
        try:
            body, ctype = _get(url, accept, timeout_s, token[0])
        except urllib.error.HTTPError as e:
            if e.code != 401 or token[0] is not None:
                raise
            token[0] = _anonymous_token(e.headers.get("WWW-Authenticate", ""), timeout_s)
            if token[0] is None:
                raise
            body, ctype = _get(url, accept, timeout_s, token[0])
    except urllib.error.HTTPError as e:
        why = {401: "the registry wants credentials", 403: "access denied", 404: "no such image or tag"}
        raise RegistryError(f"{ref.registry}: HTTP {e.code} ({why.get(e.code, e.reason)})") from None
    except (urllib.error.URLError, OSError) as e:
        raise RegistryError(f"{ref.registry} cannot be reached ({getattr(e, 'reason', e)})") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise RegistryError(f"{ref.registry}: the manifest of {ref.repository}:{reference} is not JSON") from None
    return doc, doc.get("mediaType") or ctype.split(";")[0].strip()


def download_bytes(ref: Ref, timeout_s: float = 30.0) -> int:
    """Compressed bytes a pull of `ref` downloads on this platform: config blob plus layers."""
    token: list = [None]
    doc, mtype = _manifest(ref, ref.reference, timeout_s, token)
    if mtype in INDEX_TYPES or "manifests" in doc:
        os_, arch = this_platform()
        match = [m for m in doc.get("manifests", [])
                 if (m.get("platform") or {}).get("os") == os_
                 and (m.get("platform") or {}).get("architecture") == arch]
        if not match:
            raise RegistryError(f"{ref.registry}/{ref.repository}:{ref.reference} has no {os_}/{arch} image")
        doc, _ = _manifest(ref, match[0]["digest"], timeout_s, token)
    try:
        return int(doc["config"]["size"]) + sum(int(layer["size"]) for layer in doc["layers"])
    except (KeyError, TypeError, ValueError):
        raise RegistryError(f"{ref.registry}: the manifest of {ref.repository}:{ref.reference} lists no layer "
                            "sizes (schema 1?)") from None
