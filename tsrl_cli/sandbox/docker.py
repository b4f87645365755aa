"""The `docker` executor: the task's image through the Docker Engine API (`pip install tsrl[docker]`).

One container per trajectory, started idle (`sleep infinity`) with no network, a memory cap
(swap included), a pids cap, CPU-time and file-size ulimits, every capability dropped and
no-new-privileges. The task directory is copied into /workdir; each command is a `docker exec`
of `bash -c` there, wrapped in coreutils `timeout -s KILL` (the image must have bash and
coreutils), with output capped while it streams. `close()` removes the container.

Not exercised on this project's machines (no Docker daemon); tests/sandbox skip with the reason.
"""

from __future__ import annotations

import io
import os
import shlex
import tarfile
import time
import uuid

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox.base import ExecResult, Limits, Sandbox

WORKDIR = "/workdir"


def docker_unavailable_reason() -> str | None:
    """None when a Docker daemon answers a ping, else why not (one line)."""
    try:
        import docker
    except ImportError:
        return "the docker package is not installed (pip install 'tsrl[docker]')"
    try:
        client = docker.from_env(timeout=5)
        client.ping()
        client.close()
    except Exception as e:  # noqa: BLE001  DockerException, connection or permission errors
        return f"no Docker daemon reachable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


class DockerSandbox(Sandbox):
    executor = "docker"

    def __init__(self, task_dir: str | os.PathLike | None, *, image: str, limits: Limits | None = None):
        self._closed = True
        reason = docker_unavailable_reason()
        if reason:
            raise UsageError(f"docker executor: {reason}")
        import docker

        self.limits = lim = limits or Limits()
        self.image = image
        self.workdir = WORKDIR  # inside the container
        self._client = docker.from_env(timeout=24 * 3600)  # a silent command must not hit a read timeout
        try:
            self._client.images.get(image)
        except docker.errors.ImageNotFound:
            self._client.images.pull(image)
        self._container = self._client.containers.run(
            image, command=["sleep", "infinity"], detach=True, working_dir="/",
            network_mode="none",
            mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes, pids_limit=lim.processes + 8,
            ulimits=[docker.types.Ulimit(name="cpu", soft=lim.cpu_time_s, hard=lim.cpu_time_s + 1),
                     docker.types.Ulimit(name="fsize", soft=lim.file_size_bytes, hard=lim.file_size_bytes),
                     docker.types.Ulimit(name="core", soft=0, hard=0)],
            cap_drop=["ALL"], security_opt=["no-new-privileges"], init=True,
            environment={"HOME": WORKDIR, "LANG": "C.UTF-8", "TERM": "dumb"},
        )
        self._closed = False
        self._container.exec_run(["mkdir", "-p", WORKDIR])
        if task_dir is not None:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(str(task_dir), arcname=".")
            self._container.put_archive(WORKDIR, buf.getvalue())

    @property
    def isolation(self) -> str:
        return "docker"

    @property
    def isolation_summary(self) -> str:
        return f"docker: image {self.image}, no network, caps dropped, memory/pids cgroup caps"

    def run(self, command: str, timeout_s: float) -> ExecResult:
        if self._closed:
            return ExecResult("", "sandbox is closed", 126, 0.0)
        lim = self.limits
        # timeout puts itself and the command in a new process group whose id is this shell's pid:
        # saved, so the whole group can be killed (output cap, strays) without stopping the container
        pgid_file = f"/tmp/.tsrl-pgid-{uuid.uuid4().hex[:8]}"
        wrapped = (f"echo $$ > {pgid_file}; exec timeout -s KILL {max(timeout_s, 0.001):.3f} "
                   f"bash -c {shlex.quote(command)}")
        api = self._client.api
        start = time.monotonic()
        try:
            ex = api.exec_create(self._container.id, ["bash", "-c", wrapped], workdir=WORKDIR)
            stream = api.exec_start(ex["Id"], stream=True, demux=True)
            bufs, total, truncated, limit = [bytearray(), bytearray()], 0, False, None
            for chunks in stream:
                for i, data in enumerate(chunks):
                    if not data:
                        continue
                    total += len(data)
                    room = lim.output_bytes - len(bufs[i])
                    if room > 0:
                        bufs[i] += data[:room]
                    truncated |= len(data) > room
                if total > lim.output_kill_bytes:
                    limit = "output"
                    break
            self._container.exec_run(["sh", "-c", f'kill -9 -"$(cat {pgid_file})" 2>/dev/null; rm -f {pgid_file}'])
            rc = api.exec_inspect(ex["Id"]).get("ExitCode")
        except Exception as e:  # noqa: BLE001  a daemon error must not crash the caller
            return ExecResult("", f"docker: {type(e).__name__}: {e}", 126, time.monotonic() - start)
        duration = time.monotonic() - start
        rc = 137 if rc is None else rc
        stderr = bufs[1].decode("utf-8", errors="replace")
        if limit is None:
            if rc == 137 and duration >= timeout_s:
                limit = "wall_clock"
            elif rc == 152 or "CPU time limit exceeded" in stderr:
                limit = "cpu_time"
            elif rc == 153 or "File size limit exceeded" in stderr:
                limit = "file_size"
            elif self._oom_killed():
                limit = "memory"
            elif "fork: " in stderr and "Resource temporarily unavailable" in stderr:
                limit = "processes"
        return ExecResult(bufs[0].decode("utf-8", errors="replace"), stderr, rc, round(duration, 4), limit, truncated)

    def _oom_killed(self) -> bool:
        try:
            self._container.reload()
            return bool(self._container.attrs.get("State", {}).get("OOMKilled"))
        except Exception:  # noqa: BLE001  only used to name the limit
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._container.remove(force=True)
        except Exception:  # noqa: BLE001, S110  already gone, or the daemon went away
            pass
        self._client.close()
