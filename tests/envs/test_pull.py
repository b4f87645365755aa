"""`tsrl env pull`: every image the tasks run in, sized by its registry, checked against the disk, pulled once.

- names normalise as Docker's reference grammar does (Docker Hub, library/, a host with a port)
- the download size is the config blob plus the layers of this platform's manifest, through an
  index and a Bearer challenge (a stub registry in this process); the wrong platform and a registry
  that wants credentials are errors naming the registry, and their sizes are reported unknown
- which images: a SWE-smith task's image, none for a task run from a local folder, a terminal task's
  FROM images unless --base-image maps them
- a disk that cannot hold the download is refused in one line before anything is pulled
- against a real registry (Debian's docker-registry, started here on 127.0.0.1) and the real daemon:
  images pushed, removed, then `tsrl env pull` brings them back two at a time; the size it reports is
  the registry's blob files on disk (less the manifests); a second run pulls nothing; require_images
  refuses while one is missing, and names `tsrl env pull`
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.envs.pull import DISK_FACTOR, GIB, PullPlan, check_disk, needed_images
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.sandbox import registry
from tsrl_cli.sandbox.registry import Ref, RegistryError, download_bytes, image_ref

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PAYLOAD = 64 * 1024  # bytes of the first test image's one file


@pytest.mark.parametrize("image,ref", [
    ("ubuntu", ("registry-1.docker.io", "library/ubuntu", "latest")),
    ("ubuntu:24.04", ("registry-1.docker.io", "library/ubuntu", "24.04")),
    ("swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
     ("registry-1.docker.io", "swebench/sweb.eval.x86_64.django_1776_django-11099", "latest")),
    ("127.0.0.1:5000/team/tiny:1", ("127.0.0.1:5000", "team/tiny", "1")),
    ("localhost/tiny", ("localhost", "tiny", "latest")),
    ("ghcr.io/org/img@sha256:" + "a" * 64, ("ghcr.io", "org/img", "sha256:" + "a" * 64)),
])
def test_names_normalise_as_docker_does(image, ref):
    assert image_ref(image) == Ref(*ref)


def test_loopback_registries_speak_http_and_the_rest_https():
    assert image_ref("127.0.0.1:5000/a").base_url == "http://127.0.0.1:5000/v2/a"
    assert image_ref("ubuntu").base_url == "https://registry-1.docker.io/v2/library/ubuntu"


@pytest.mark.parametrize("bad", ["Upper/Case", "a//b", ""])
def test_a_bad_name_is_refused(bad):
    with pytest.raises(ValueError, match="not an image name"):
        image_ref(bad)


# ---- a stub registry: an index, two platform manifests, a Bearer challenge ------------------------------------
class Stub(http.server.BaseHTTPRequestHandler):
    token = "t0ken"
    want_credentials = False

    def log_message(self, *a):
        pass

    def _json(self, code, doc, ctype="application/json", headers=()):
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        if self.path.startswith("/token"):
            return self._json(200, {"token": self.token})
        if self.headers.get("Authorization") != f"Bearer {self.token}" or self.want_credentials:
            challenge = f'Bearer realm="http://127.0.0.1:{port}/token",service="stub",scope="repository:team/app:pull"'
            return self._json(401, {}, headers=[("WWW-Authenticate", challenge)])
        os_, arch = registry.this_platform()
        if self.path == "/v2/team/app/manifests/1":
            return self._json(200, {"mediaType": registry.INDEX_TYPES[0], "manifests": [
                {"digest": "sha256:other", "platform": {"os": os_, "architecture": "nonesuch"}},
                {"digest": "sha256:mine", "platform": {"os": os_, "architecture": arch}}]},
                ctype=registry.INDEX_TYPES[0])
        if self.path == "/v2/team/app/manifests/sha256:mine":
            return self._json(200, {"mediaType": registry.MANIFEST_TYPES[2], "config": {"size": 1000},
                                    "layers": [{"size": 30_000_000}, {"size": 4_000}]})
        if self.path == "/v2/team/flat/manifests/latest":  # a single-platform image: no index
            return self._json(200, {"config": {"size": 7}, "layers": [{"size": 5}]}, ctype=registry.MANIFEST_TYPES[3])
        if self.path == "/v2/team/foreign/manifests/1":
            return self._json(200, {"mediaType": registry.INDEX_TYPES[1], "manifests": [
                {"digest": "sha256:x", "platform": {"os": "windows", "architecture": "amd64"}}]})
        return self._json(404, {"errors": [{"code": "MANIFEST_UNKNOWN"}]})


@pytest.fixture
def stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Stub.want_credentials = False
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_size_is_this_platforms_config_and_layers_through_an_index_and_a_token(stub):
    assert download_bytes(image_ref(f"{stub}/team/app:1")) == 1000 + 30_000_000 + 4_000
    assert download_bytes(image_ref(f"{stub}/team/flat")) == 12


@pytest.mark.parametrize("image,words", [
    ("team/foreign:1", "has no linux/"),
    ("team/none:1", r"HTTP 404 \(no such image or tag\)"),
])
def test_what_the_registry_cannot_size_is_an_error_naming_it(stub, image, words):
    with pytest.raises(RegistryError, match=words):
        download_bytes(image_ref(f"{stub}/{image}"))


def test_a_registry_that_wants_credentials_leaves_the_size_unknown(stub):
    Stub.want_credentials = True
    with pytest.raises(RegistryError, match="HTTP 401 \\(the registry wants credentials\\)"):
        download_bytes(image_ref(f"{stub}/team/app:1"))


def test_an_unreachable_registry_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    with pytest.raises(RegistryError, match=f"127.0.0.1:{port} cannot be reached"):
        download_bytes(image_ref(f"127.0.0.1:{port}/a/b"), timeout_s=5)


# ---- which images ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smith(tmp_path_factory, prepare_fixture):
    return prepare_fixture("swe-smith", FIXTURES / "swe_smith" / "train.jsonl", tmp_path_factory.mktemp("ds") / "smith")


@pytest.fixture(scope="module")
def seta(tmp_path_factory, prepare_fixture):
    return prepare_fixture("seta-env", FIXTURES / "seta_env", tmp_path_factory.mktemp("ds") / "seta")


def test_which_images_each_task_needs(smith, seta):
    from tsrl_cli.datasets.store import open_dataset

    s = open_dataset(smith)
    # the fixture's image_name where a row has one; the last row has none, and gets the name SWE-smith's
    # harness gives its repository's image (swebench/swesmith.<arch>.<owner>_1776_<repo>.<commit>)
    assert needed_images(s.pairs) == {
        "jyangballin/swesmith.x86_64.pandas-dev_1776_pandas.95280573": ["smith/pandas-dev__pandas.95280573.pr_53652"],
        "jyangballin/swesmith.x86_64.django_1776_django.4a72da71": ["smith/django__django.4a72da71.func_basic__abc123"],
        "jyangballin/swesmith.x86_64.gin-gonic_1776_gin.3c12d2a8": ["smith/gin-gonic__gin.3c12d2a8.lm_rewrite__q1w2e3"],
        "swebench/swesmith.x86_64.psf_1776_requests.0e322af8": ["smith/psf__requests.0e322af8.func_pm__r5"]}
    two = needed_images([*s.pairs[:1], *s.pairs[:1]])
    assert list(two.values()) == [["smith/pandas-dev__pandas.95280573.pr_53652"] * 2]  # one image, each task named
    t = open_dataset(seta)
    assert needed_images(t.pairs) == {"ubuntu:24.04": [f"seta/{x.task_id}" for x in t.tasks]}  # their FROM
    assert needed_images(t.pairs, {"ubuntu:24.04": "tsrl-base:x"}) == {}  # built from a local image: nothing to pull
    assert needed_images(t.pairs, from_lines=False) == {}  # what train requires: prebuilt images only
    from tsrl_cli.datasets.store import EMBEDDED_SETS

    local = [p for n in EMBEDDED_SETS if Path("data", n).is_dir() for p in open_dataset(n).pairs]
    assert needed_images([p for p in local if p[1].kind == "repair"]) == {}  # run from local folders


def test_a_disk_too_small_is_refused_before_any_pull():
    plan = PullPlan({"a": ["d/t"]}, [], ["a"], sizes={"a": 4 * GIB}, root="/var/lib/docker", free_bytes=20 * GIB)
    check_disk(plan, min_free_gib=20 - DISK_FACTOR * 4 - 0.5)  # fits with half a GiB to spare
    with pytest.raises(OperationFailed, match=r"download 4\.0 GiB, about 12\.0 GiB unpacked, but /var/lib/docker "
                                              r"has 20\.0 GiB free \(keeping 10 GiB free\)"):
        check_disk(plan, min_free_gib=10)


# ---- a real registry and the real daemon ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_registry(tmp_path_factory):
    """Debian's docker-registry on a free loopback port, storing under a temporary folder."""
    from tsrl_cli.sandbox.docker_client import docker_unavailable_reason

    reason = docker_unavailable_reason() or (None if shutil.which("docker-registry") else
                                             "Debian's docker-registry is not installed (.ci/run installs it)")
    if reason:
        if os.environ.get("TSRL_REQUIRE_DOCKER") == "1":
            pytest.fail(f"TSRL_REQUIRE_DOCKER=1 but {reason}")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("registry")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (root / "config.yml").write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                                     f"    rootdirectory: {root / 'store'}\nhttp:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")], stdout=subprocess.DEVNULL,
                            stderr=open(root / "log", "w"))  # noqa: SIM115 - the process keeps it
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (root / "log").read_text()
            time.sleep(0.1)
    yield f"127.0.0.1:{port}", root / "store"
    proc.terminate()
    proc.wait(timeout=10)


def push_tiny_images(client, host: str, tmp: Path, n: int) -> tuple[list[str], set[str]]:
    """n small distinct images pushed to the registry and removed here; (names, digests of their manifests)."""
    names, manifests = [], set()
    for k in range(n):
        d = tmp / f"img{k}"
        d.mkdir()
        (d / "payload").write_bytes(os.urandom(PAYLOAD * (k + 1)))  # random: gzip cannot shrink it
        with tarfile.open(tmp / f"img{k}.tar", "w") as tar:
            tar.add(d / "payload", arcname="payload")
        name = f"{host}/tsrl-test/tiny{k}:1"
        client.api.import_image(src=str(tmp / f"img{k}.tar"), repository=name.rsplit(":", 1)[0], tag="1")
        for item in client.api.push(name.rsplit(":", 1)[0], tag="1", stream=True, decode=True):
            assert "error" not in item, item
            if "aux" in item:
                manifests.add(item["aux"]["Digest"])
        client.images.remove(name, force=True)
        names.append(name)
    return names, manifests


def smith_with_images(tmp: Path, images: list[str], prepare_fixture) -> Path:
    lines = [json.loads(x) for x in (FIXTURES / "swe_smith" / "train.jsonl").read_text().splitlines()][:len(images)]
    for r, image in zip(lines, images, strict=True):
        r["image_name"] = image
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return prepare_fixture("swe-smith", tmp / "train.jsonl", tmp / "ds_pull")


def test_pull_from_a_real_registry_then_train_finds_them(real_registry, tmp_path, prepare_fixture):
    import docker

    host, store = real_registry
    client = docker.from_env()
    names, manifests = push_tiny_images(client, host, tmp_path, 3)
    ds = smith_with_images(tmp_path, names, prepare_fixture)
    blobs = {p.parent.name: p.stat().st_size for p in (store / "docker/registry/v2/blobs").rglob("data")}
    want = sum(size for digest, size in blobs.items() if f"sha256:{digest}" not in manifests)
    from tsrl_cli.datasets.store import open_dataset
    from tsrl_cli.envs.pull import require_images

    with pytest.raises(UsageError, match=f"and 2 more is not on this Docker daemon; .*tsrl env pull {ds}"):
        require_images(open_dataset(ds).pairs, [ds])  # before the pull: refused, naming the way

    res = CliRunner().invoke(app, ["env", "pull", str(ds), "--min-free-gib", "1e9"])  # the disk check: nothing pulled
    assert res.exit_code == 1 and "GiB free (keeping 1e+09 GiB free)" in res.stderr, res.output
    assert not any(i.tags for i in client.images.list(name=f"{host}/tsrl-test/tiny0"))

    res = CliRunner().invoke(app, ["env", "pull", str(ds), "--max-parallel-pulls", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert sorted(out["pulled"]) == sorted(names) and out["failed"] == {} and out["present"] == 0
    assert out["download_bytes"] == want > PAYLOAD * (1 + 2 + 3)  # the registry's blob files, manifests left out
    for name in names:
        client.images.get(name)  # on the daemon now

    again = json.loads(CliRunner().invoke(app, ["env", "pull", str(ds), "--json"]).stdout)
    assert (again["present"], again["pulled"], again["download_bytes"]) == (3, [], 0)

    require_images(open_dataset(ds).pairs, [ds])  # now nothing is missing

    # prepare-data --pull-images: the same pull right after the records are written
    client.images.remove(names[1], force=True)
    res = CliRunner().invoke(app, ["prepare-data", "swe-smith", "--from", str(tmp_path / "train.jsonl"), "--out",
                                   str(tmp_path / "ds_prep"), "--pull-images", "--max-parallel-pulls", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["written"] == 3 and out["pull"]["pulled"] == [names[1]] and out["pull"]["present"] == 2
    client.images.get(names[1])
    # control: an image the registry does not have fails the pull (exit 2, a name to fix), and the records stay
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()][:1]
    rows[0]["image_name"] = f"{host}/tsrl-test/absent:1"
    (tmp_path / "absent.jsonl").write_text(json.dumps(rows[0]) + "\n")
    res = CliRunner().invoke(app, ["prepare-data", "swe-smith", "--from", str(tmp_path / "absent.jsonl"), "--out",
                                   str(tmp_path / "ds_absent"), "--pull-images"])
    assert res.exit_code == 2 and f"{host}/tsrl-test/absent:1 was not found" in res.stderr, res.output
    assert f"tsrl env pull {tmp_path / 'ds_absent'}" in " ".join(res.stderr.split()), res.stderr
    assert open_dataset(tmp_path / "ds_absent").tasks  # written before the pull
    for name in names:
        client.images.remove(name, force=True)
    client.close()
