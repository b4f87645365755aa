"""Container images without a registry: a local base image from Debian's packages, and task images
built from the tasks' own Dockerfiles through the Docker SDK.

Base image (`ensure_base_image`): `debootstrap --variant=minbase` of BASE_SUITE with BASE_PACKAGES,
this machine's CA bundle copied in (so pip inside a container trusts what the host trusts), then
`docker import`ed as `tsrl-base:<suite>-<content hash>`. The hash covers the suite, the packages,
the recipe and the CA bundle: a machine that has the tag skips the build (about 40 s cold here).
Needs root and Debian's `debootstrap`.

Harbor image (`ensure_harbor_image`): the same from Debian HARBOR_SUITE (Python 3.13, the Docker CLI
and compose plugin), then `pip install harbor==HARBOR_VERSION` in a build, for `--via-harbor` on
machines whose Python is older than harbor's 3.12.

Task images (`build_image`): the context folder and its Dockerfile, built by the daemon, tagged by
the caller (tasks: `task_image_tag`, from the task directory's sha256) and reused when the tag
exists. The build's output is kept in a log file; a failed build raises ImageBuildFailed, one line
naming what was built and the log. `base_images` ({FROM image: local image}) builds a Dockerfile
whose FROM names a key from the local image instead, for machines that cannot pull: the Dockerfile
on disk is untouched (the daemon gets a rewritten copy), and the mapping used is returned so the
caller prints and records it. The mapping is part of the tag, so a mapped build never passes for
an unmapped one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.sandbox.docker_client import docker_client, image_exists

BASE_SUITE = "bookworm"
BASE_MIRROR = "http://deb.debian.org/debian"
# what task Dockerfiles and verifiers here expect: bash and coreutils (minbase), Python with pytest,
# git (repair tasks), patch, CA certificates
BASE_PACKAGES = ("python3", "python3-pytest", "python3-venv", "git", "patch", "ca-certificates", "procps")
BASE_RECIPE = "1"  # bump when the way the root is made changes
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# `tsrl eval tbench --via-harbor --harbor-in-docker`: harbor needs Python >= 3.12 (Debian trixie has 3.13),
# and talks to the host's daemon through the Docker CLI and its compose plugin
HARBOR_VERSION = "0.26.0"
HARBOR_SUITE = "trixie"
HARBOR_PACKAGES = ("python3", "python3-venv", "ca-certificates", "docker-cli", "docker-compose", "git")
_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)


# the daemon's words when a FROM image had to be pulled and could not be (no registry, no network)
_PULL_FAILED = re.compile(r"registry|no such host|pull access denied|manifest unknown|dial tcp|not found",
                          re.IGNORECASE)


BUILD_TIMEOUT_S = 24 * 3600  # a build step may print nothing for a long time


class ImageBuildFailed(OperationFailed):
    """An image build ran and failed; the message names the image and its build log (exit 1)."""


def _ca_digest() -> str:
    p = Path(HOST_CA_BUNDLE)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "none"


def _root_tag(repo: str, suite: str, packages: tuple[str, ...], *extra: str) -> str:
    """`<repo>:<suite>-<12 hex>`: a content tag over the suite, packages, recipe, CA bundle and `extra`."""
    h = hashlib.sha256(json.dumps([suite, sorted(packages), BASE_RECIPE, _ca_digest(), *extra]).encode())
    return f"{repo}:{suite}-{h.hexdigest()[:12]}"


def base_image_tag() -> str:
    """`tsrl-base:<suite>-<12 hex>`: the content tag of the base image this machine would build."""
    return _root_tag("tsrl-base", BASE_SUITE, BASE_PACKAGES)


def ensure_base_image(progress: Callable[[str], None] = lambda m: None) -> str:
    """The base image's tag, built first when this machine lacks it (see the module doc)."""
    return _ensure_root_image(base_image_tag(), BASE_SUITE, BASE_PACKAGES, "the base image", progress)


def _ensure_root_image(tag: str, suite: str, packages: tuple[str, ...], what: str,
                       progress: Callable[[str], None]) -> str:
    """`tag` from `debootstrap --variant=minbase suite` with `packages` and the host's CA bundle, unless present."""
    client = docker_client(BUILD_TIMEOUT_S, "building images")
    try:
        if image_exists(client, tag):
            return tag
        exe = shutil.which("debootstrap")
        if exe is None:
            raise UsageError(f"{what} {tag} is not here and `debootstrap` is missing: "
                             "apt-get install debootstrap (Debian), then rerun")
        if os.geteuid() != 0:
            raise UsageError(f"{what} {tag} is not here, and debootstrap needs root: rerun as root once")
        t0 = time.monotonic()
        progress(f"building {what} {tag} from Debian {suite} packages (debootstrap, about a minute)")
        with tempfile.TemporaryDirectory(prefix="tsrl-base-") as tmp:
            root, log = Path(tmp) / "root", Path(tmp) / "debootstrap.log"
            with open(log, "wb") as f:
                rc = subprocess.run([exe, "--variant=minbase", f"--include={','.join(packages)}", suite,
                                     str(root), BASE_MIRROR], stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, check=False).returncode
            if rc != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                raise ImageBuildFailed(f"debootstrap of {suite} failed (exit {rc}): {tail[0]}")
            if Path(HOST_CA_BUNDLE).is_file():  # trust what the host trusts (a proxy's CA included)
                shutil.copyfile(HOST_CA_BUNDLE, root / HOST_CA_BUNDLE.lstrip("/"))
            shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
            archive = Path(tmp) / "root.tar"
            subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(archive), "."], check=True,
                           stdin=subprocess.DEVNULL)
            repo, _, version = tag.partition(":")
            client.api.import_image_from_file(str(archive), repository=repo, tag=version,
                                              changes=['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8"])
        if not image_exists(client, tag):
            raise ImageBuildFailed(f"docker import of {what} {tag} left no image")
        progress(f"{what} {tag} built in {time.monotonic() - t0:.0f} s")
        return tag
    finally:
        client.close()


def harbor_image_tag() -> str:
    """`tsrl-harbor:<version>-<12 hex>`: the image `--harbor-in-docker` runs harbor in."""
    root = _root_tag("tsrl-harbor-root", HARBOR_SUITE, HARBOR_PACKAGES)
    return f"tsrl-harbor:{HARBOR_VERSION}-{hashlib.sha256(root.encode()).hexdigest()[:12]}"


def ensure_harbor_image(log_dir: Path, progress: Callable[[str], None] = lambda m: None) -> str:
    """An image with harbor==HARBOR_VERSION in a Python >= 3.12 (Debian HARBOR_SUITE's), the Docker CLI
    and compose plugin, built here when absent: the Debian root by debootstrap, then pip from PyPI in
    a build (logs in log_dir/harbor-image.log)."""
    root = _ensure_root_image(_root_tag("tsrl-harbor-root", HARBOR_SUITE, HARBOR_PACKAGES), HARBOR_SUITE,
                              HARBOR_PACKAGES, "harbor's Debian root image", progress)
    tag = harbor_image_tag()
    with tempfile.TemporaryDirectory(prefix="tsrl-harbor-") as ctx:
        (Path(ctx) / "Dockerfile").write_text(
            f"FROM {root}\n"
            f"RUN python3 -m venv /opt/harbor && /opt/harbor/bin/pip install --no-cache-dir harbor=={HARBOR_VERSION}\n"
            "ENV PATH=/opt/harbor/bin:$PATH\n")
        build_image(ctx, tag=tag, what=f"harbor {HARBOR_VERSION}", log_path=Path(log_dir) / "harbor-image.log",
                    progress=progress)
    return tag


def map_from_lines(dockerfile: str, base_images: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The Dockerfile with each FROM that names a key of base_images built from its local image instead.

    Returns (text, {FROM image: local image} actually used). Stage names (`FROM x AS y`) and flags are kept.
    """
    used: dict[str, str] = {}
    lines = []
    for line in dockerfile.splitlines(keepends=True):
        m = _FROM.match(line.rstrip("\n"))
        if m and m.group(3) in base_images:
            used[m.group(3)] = base_images[m.group(3)]
            line = f"{m.group(1)}{m.group(2)}{base_images[m.group(3)]}{m.group(4)}\n"
        lines.append(line)
    return "".join(lines), used


def from_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's FROM lines name (stage references included)."""
    return [m.group(3) for line in dockerfile.splitlines() if (m := _FROM.match(line))]


def external_from_images(dockerfile: str) -> list[str]:
    """The FROM images a build must find or pull: neither an earlier stage's name (`FROM x AS y` ... `FROM y`)
    nor `scratch`; each once, in order."""
    stages, out = {"scratch"}, []
    for line in dockerfile.splitlines():
        m = _FROM.match(line)
        if not m:
            continue
        if m.group(3).lower() not in stages and m.group(3) not in out:
            out.append(m.group(3))
        alias = re.match(r"\s+AS\s+(\S+)", m.group(4), re.IGNORECASE)
        if alias:
            stages.add(alias.group(1).lower())
    return out


def task_image_tag(task_id: str, dir_sha256: str, base_images: dict[str, str] | None = None) -> str:
    """`tsrl-task-<id>:<dir sha 12>[-<mapping 8>]`, lower case and within Docker's name rules."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", task_id.lower()).strip("-._")[:100] or "task"
    tag = dir_sha256[:12]
    if base_images:
        tag += "-" + hashlib.sha256(json.dumps(sorted(base_images.items())).encode()).hexdigest()[:8]
    return f"tsrl-task-{name}:{tag}"


def build_image(context: str | Path, *, tag: str, what: str, log_path: str | Path, dockerfile: str = "Dockerfile",
                base_images: dict[str, str] | None = None, timeout_s: float | None = None,
                progress: Callable[[str], None] = lambda m: None) -> dict[str, str]:
    """Build `tag` from context/dockerfile unless it exists; returns the base-image mapping used.

    `what` names the image in messages ("task hello-world"). Raises ImageBuildFailed (one line, the
    log's path) when the daemon reports an error or the build outlasts timeout_s.
    """
    context, log_path = Path(context), Path(log_path)
    df = context / dockerfile
    if not df.is_file():
        raise UsageError(f"{what}: no {dockerfile} in {context}")
    text, used = map_from_lines(df.read_text(errors="replace"), base_images or {})
    client = docker_client(BUILD_TIMEOUT_S, "building images")
    try:
        if image_exists(client, tag):
            return used
        for src, dst in used.items():
            progress(f"{what}: FROM {src} built from the local image {dst} (--base-image)")
            if not image_exists(client, dst):
                raise UsageError(f"{what}: --base-image {src}={dst}: the local image {dst} does not exist "
                                 "(`docker images` lists them)")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        progress(f"{what}: building image {tag} (log: {log_path})")
        error = None
        with tempfile.TemporaryDirectory(prefix="tsrl-df-") as tmp, open(log_path, "w") as log:
            log.write(f"# {what}: docker build {context} -f {dockerfile} -t {tag}\n")
            if used:
                log.write(f"# FROM mapped to local images: {json.dumps(used, sort_keys=True)}\n")
            mapped = Path(tmp) / "Dockerfile"  # outside the context: the SDK sends it beside the context
            mapped.write_text(text)
            stream = client.api.build(path=str(context), dockerfile=str(mapped), tag=tag, rm=True, forcerm=True,
                                      decode=True, pull=False)
            for chunk in stream:
                if "stream" in chunk:
                    log.write(chunk["stream"])
                if "error" in chunk:
                    error = chunk["error"].strip()
                    log.write(f"ERROR: {error}\n")
                    break
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    error = f"the build ran past its {timeout_s:.0f} s limit"
                    log.write(f"ERROR: {error}\n")
                    break
            log.write(f"# {'failed' if error else 'built'} in {time.monotonic() - t0:.1f} s\n")
        if error is not None or not image_exists(client, tag):
            line = (error or "no image was tagged").splitlines()[-1][:200]
            hint = ""
            if _PULL_FAILED.search(line):  # a FROM image this machine lacks and cannot pull: name the way out
                missing = [m.group(3) for m in map(_FROM.match, text.splitlines()) if m
                           and m.group(3) not in used.values() and not image_exists(client, m.group(3))]
                if missing:
                    hint = (f"; {missing[0]} is not here and cannot be pulled: build it from a local image with "
                            f"--base-image {missing[0]}=LOCAL_IMAGE (`tsrl env base-image` makes one)")
            raise ImageBuildFailed(f"{what}: image build failed ({line}){hint}; build log: {log_path}")
        progress(f"{what}: image {tag} built in {time.monotonic() - t0:.1f} s")
        return used
    finally:
        client.close()
