"""Every image the tasks of some datasets run in, on this daemon before a run needs it (`tsrl env pull`).

    needed_images(datasets, base_images)  {image: [task keys]}: each repair task's image (SWE-bench's
                                          per-instance, SWE-smith's per-repo), each terminal task's
                                          docker_image, else the FROM images of the Dockerfile it is
                                          built from (those docker.base_images maps are local: not
                                          pulled; the build itself happens before round 1)
    pull_plan(client, needs)              which are missing here, what each costs to download (asked of
                                          its registry, sandbox/registry.py) and whether the disk of the
                                          daemon's root holds them
    pull_images(client, plan, parallel)   the missing ones, `parallel` pulls at once, one progress line
                                          per finished image
    require_images(pairs, datasets)       a UsageError naming the first missing prebuilt image and the pull

Tasks run from local folders (the embedded suite) need no image. Disk: a pull downloads compressed
layers and unpacks them; the check asks for DISK_FACTOR times the download on the disk of the
daemon's root (overlay2 unpacks gzip-compressed layers to about 2-3 times their size) plus
`min_free_gib` left over, and refuses in one line before anything is pulled.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.envs.images import build_context
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.sandbox.docker_client import docker_client, ensure_image, image_exists
from tsrl_cli.sandbox.images import external_from_images
from tsrl_cli.sandbox.registry import RegistryError, download_bytes, image_ref

DISK_FACTOR = 3.0  # bytes on disk per compressed byte downloaded, the upper end of gzip's ratio on layers
GIB = 1 << 30
PULL_CALL_TIMEOUT_S = 600.0  # one read of a pull's progress stream: unpacking a large layer can be silent a while


def needed_images(pairs: Iterable[tuple[Path, object]], base_images: dict[str, str] | None = None, *,
                  from_lines: bool = True) -> dict[str, list[str]]:
    """{image: ["<dataset>/<task id>", ...]} over (dataset folder, task) pairs: every image a task runs in
    (see the module doc); from_lines False leaves out the FROM images of Dockerfile builds (the build
    pulls those, and names the task and its log when it cannot)."""
    mapped = base_images or {}
    out: dict[str, list[str]] = {}
    for d, t in pairs:
        if t.kind == "repair":
            images = [t.image] if t.ref_kind in ("branch", "commit") else []  # else: a local folder
        elif t.docker_image:
            images = [t.docker_image]
        elif from_lines:
            ctx, dockerfile = build_context(Path(d) / t.task_dir / t.environment_dir, t.task_id)
            images = [i for i in external_from_images((ctx / dockerfile).read_text(errors="replace"))
                      if i not in mapped]
        else:
            images = []
        for image in images:
            out.setdefault(image, []).append(f"{Path(d).name}/{t.task_id}")
    return out


@dataclass
class PullPlan:
    needs: dict[str, list[str]]  # image -> task keys
    present: list[str]
    missing: list[str]
    sizes: dict[str, int] = field(default_factory=dict)  # image -> compressed bytes, where its registry said
    unknown: dict[str, str] = field(default_factory=dict)  # image -> why its size is unknown
    root: str | None = None  # the daemon's root folder (DockerRootDir)
    free_bytes: int | None = None

    @property
    def download_bytes(self) -> int:
        return sum(self.sizes.values())

    def to_dict(self) -> dict:
        return {"images": len(self.needs), "present": len(self.present), "missing": self.missing,
                "download_bytes": self.download_bytes, "sizes": self.sizes, "unknown_sizes": self.unknown,
                "docker_root": self.root, "free_bytes": self.free_bytes}


def _root_free(client) -> tuple[str | None, int | None]:
    try:
        root = client.info().get("DockerRootDir")
        return root, shutil.disk_usage(root).free if root else None
    except (OSError, KeyError):  # a remote daemon: its root is not on this machine's disks
        return None, None


def pull_plan(client, needs: dict[str, list[str]], *, lookups: int = 8) -> PullPlan:
    """What is missing and what each missing image downloads (asked of its registry, `lookups` at once)."""
    here = {i: image_exists(client, i) for i in needs}
    missing = [i for i in needs if not here[i]]
    plan = PullPlan(needs, [i for i in needs if here[i]], missing)

    with ThreadPoolExecutor(max(1, lookups)) as pool:
        futures = {pool.submit(lambda i: download_bytes(image_ref(i)), i): i for i in missing}
        for f in as_completed(futures):
            image = futures[f]
            try:
                plan.sizes[image] = f.result()
            except (RegistryError, ValueError) as e:
                plan.unknown[image] = str(e)
    plan.root, plan.free_bytes = _root_free(client)
    return plan


def check_disk(plan: PullPlan, min_free_gib: float) -> None:
    """OperationFailed, one line, when the daemon's disk cannot hold the missing images and min_free_gib."""
    if plan.free_bytes is None or not plan.sizes:
        return
    need = DISK_FACTOR * plan.download_bytes + min_free_gib * GIB
    if need > plan.free_bytes:
        raise OperationFailed(
            f"docker: the {len(plan.sizes)} missing images download {plan.download_bytes / GIB:.1f} GiB, about "
            f"{DISK_FACTOR * plan.download_bytes / GIB:.1f} GiB unpacked, but {plan.root} has "
            f"{plan.free_bytes / GIB:.1f} GiB free (keeping {min_free_gib:g} GiB free): free space there, "
            "or pull fewer datasets at once")


def pull_images(client, plan: PullPlan, *, parallel: int, on_done: Callable[[str, float, int, int], None]) -> list:
    """Pull plan.missing, `parallel` at once. on_done(image, seconds, done, total) after each.
    Returns [(image, error)] of those that failed (UsageError or OperationFailed, one line each)."""
    failed = []
    total, done = len(plan.missing), 0

    def one(image: str) -> float:
        t0 = time.monotonic()
        ensure_image(client, image)
        return time.monotonic() - t0

    with ThreadPoolExecutor(max(1, parallel)) as pool:
        futures = {pool.submit(one, i): i for i in plan.missing}
        for f in as_completed(futures):
            image = futures[f]
            done += 1
            try:
                on_done(image, f.result(), done, total)
            except (UsageError, OperationFailed) as e:
                failed.append((image, e))
    return failed


def require_images(pairs: list[tuple[Path, object]], datasets: Iterable) -> None:
    """Every prebuilt image the tasks run in is on the daemon, else
    a UsageError naming the first missing one, its task and the `tsrl env pull` that fetches them all."""
    needs = needed_images(pairs, from_lines=False)
    if not needs:
        return
    client = docker_client(60.0, "rollout.executor docker")
    try:
        missing = [i for i in needs if not image_exists(client, i)]
    finally:
        client.close()
    if missing:
        first, more = missing[0], f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        names = " ".join(str(d) for d in datasets)
        raise UsageError(f"rollout.executor docker: image {first} (task {needs[first][0]}){more} is not on this "
                         f"Docker daemon; pull the images first: tsrl env pull {names}")


def check_parallel(parallel: int) -> None:
    """--max-parallel-pulls: a UsageError below 1 (tsrl env pull; prepare-data checks it before writing)."""
    if parallel < 1:
        raise UsageError(f"--max-parallel-pulls {parallel}: must be >= 1")


def pull_datasets(names: list[str], *, base_images: dict[str, str] | None = None, parallel: int = 4,
                  min_free_gib: float = 10.0, dry_run: bool = False,
                  progress: Callable[[str], None] = lambda m: None) -> dict:
    """`tsrl env pull`: open the datasets, plan, check the disk, pull what is missing. Returns the summary
    (PullPlan.to_dict plus pulled, failed, seconds); failures after the others finished: OperationFailed
    (or UsageError for a bad image name), one line naming the first and the count."""
    check_parallel(parallel)
    if min_free_gib < 0:
        raise UsageError(f"--min-free-gib {min_free_gib:g}: must be >= 0")
    datasets = [open_dataset(n) for n in names]  # a missing dataset fails before the daemon is asked
    needs = needed_images([p for d in datasets for p in d.pairs], base_images)
    client = docker_client(PULL_CALL_TIMEOUT_S, "tsrl env pull")
    t0 = time.monotonic()
    try:
        plan = pull_plan(client, needs)
        out = {"datasets": [str(d.path) for d in datasets], "tasks_with_images": sum(map(len, needs.values())),
               **plan.to_dict(), "pulled": [], "failed": {}, "dry_run": dry_run}
        unknown = f", {len(plan.unknown)} of unknown size" if plan.unknown else ""
        progress(f"{len(needs)} images for {out['tasks_with_images']} tasks: {len(plan.present)} on this daemon, "
                 f"{len(plan.missing)} to pull ({plan.download_bytes / GIB:.1f} GiB to download{unknown})"
                 + (f"; {plan.root} has {plan.free_bytes / GIB:.1f} GiB free" if plan.free_bytes is not None else ""))
        for image, why in plan.unknown.items():
            progress(f"size of {image} unknown: {why}")
        check_disk(plan, min_free_gib)
        if dry_run or not plan.missing:
            return {**out, "seconds": time.monotonic() - t0}

        def done(image: str, seconds: float, k: int, total: int) -> None:
            out["pulled"].append(image)
            progress(f"pulled {k}/{total} images: {image} ({seconds:.0f} s)")

        failed = pull_images(client, plan, parallel=parallel, on_done=done)
    finally:
        client.close()
    out["failed"] = {image: str(e) for image, e in failed}
    out["seconds"] = time.monotonic() - t0
    if failed:
        image, e = failed[0]
        more = (f" ({len(failed)} of {len(plan.missing)} images failed; the others were pulled)"
                if len(failed) > 1 else "")
        raise type(e)(f"{e}{more}")
    return out
