"""The `docker` executor: the task's image through the Docker Engine API (`pip install tsrl[docker]`).

One container per trajectory, started idle (`sleep infinity`) with no network, a memory cap
(swap included), a pids cap, CPU-time and file-size ulimits, every capability dropped and
no-new-privileges. The task directory is copied into /workdir; each command is a `docker exec`
of `bash -c` there, wrapped in coreutils `timeout -s KILL` (the image must have bash and
coreutils), with output capped while it streams. `close()` removes the container.

Mounts: the sandbox's own (`open_sandbox(mounts=)`) are Docker bind mounts, fixed when the
container starts. A running container cannot take new ones, so `run(mounts=)` copies each host
path in (a fresh copy at the target, removed after the command) and, for a read-write one,
copies the target back onto the host path afterwards; `read_only` is not enforced on those
copies (the copy is thrown away, the host path is untouched).

Tested against dockerd 20.10 on this project's machines (tests/sandbox/test_docker.py, in the local
base image of sandbox/images.py).
"""

from __future__ import annotations

import io
import os
import shlex
import shutil
import socket
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterable

from tsrl_cli.errors import UsageError
from tsrl_cli.sandbox.base import ExecResult, Limits, Mount, Sandbox, check_mounts
from tsrl_cli.sandbox.docker_client import docker_client, ensure_image

WORKDIR = "/workdir"


class DockerSandbox(Sandbox):
    executor = "docker"

    def __init__(self, task_dir: str | os.PathLike | None, *, image: str, limits: Limits | None = None,
                 mounts: Iterable[Mount] | None = None):
        self._closed = True
        self.mounts = self._check_mounts(mounts)
        self.limits = lim = limits or Limits()
        self.image = image
        self.workdir = WORKDIR  # inside the container
        self._client = docker_client(24 * 3600, "the docker executor")  # a silent command must not hit a read timeout
        try:
            ensure_image(self._client, image)  # a failed pull: one line naming the image and the cause
        except BaseException:
            self._client.close()
            raise
        import docker

        self._container = self._client.containers.run(
            image, command=["sleep", "infinity"], detach=True, working_dir="/",
            network_mode="none",
            mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes, pids_limit=lim.processes + 8,
            ulimits=[docker.types.Ulimit(name="cpu", soft=lim.cpu_time_s, hard=lim.cpu_time_s + 1),
                     docker.types.Ulimit(name="fsize", soft=lim.file_size_bytes, hard=lim.file_size_bytes),
                     docker.types.Ulimit(name="core", soft=0, hard=0)],
            cap_drop=["ALL"], security_opt=["no-new-privileges"], init=True,
            environment={"HOME": WORKDIR, "LANG": "C.UTF-8", "TERM": "dumb"},
            volumes=[f"{m.host}:{m.target}:{'ro' if m.read_only else 'rw'}" for m in self.mounts],
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

    @property
    def visible_roots(self) -> list[str]:
        return [f"/ (the image {self.image}'s own filesystem; nothing of the host)"] + [
            f"{m.target} (read-{'only' if m.read_only else 'write'}: {m.host})" for m in self.mounts]

    def _check_mounts(self, mounts: Iterable[Mount] | None, base: Iterable[Mount] = ()) -> tuple[Mount, ...]:
        checked = check_mounts([*base, *(mounts or ())], WORKDIR)
        for m in checked:
            if ":" in m.host or ":" in m.target:
                raise UsageError(f"mount {m.host} -> {m.target}: docker mounts cannot have ':' in their paths")
        return checked

    def _copy_in(self, m: Mount) -> None:
        """A fresh copy of the host path at the target (whatever the command left there is removed first)."""
        t = shlex.quote(m.target)
        parent = os.path.dirname(m.target)
        self._container.exec_run(["sh", "-c", f"rm -rf {t} && mkdir -p {shlex.quote(parent)}"], user="0")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(m.host, arcname=os.path.basename(m.target))
        if not self._container.put_archive(parent, buf.getvalue()):
            raise UsageError(f"mount {m.host} -> {m.target}: docker could not copy it into the container")

    def _copy_out(self, m: Mount) -> None:
        """The target's contents back onto the host path (read-write mounts), then the target removed."""
        try:
            if not m.read_only:
                self._copy_back(m)
        finally:
            self._container.exec_run(["rm", "-rf", m.target], user="0")

    def _copy_back(self, m: Mount) -> None:
        try:
            stream, _ = self._container.get_archive(m.target)
            with tempfile.TemporaryDirectory() as tmp:
                with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                    tar.extractall(tmp, filter="data")  # no absolute paths, links out, devices
                got = os.path.join(tmp, os.path.basename(m.target))
                if os.path.isdir(got) and os.path.isdir(m.host):
                    shutil.copytree(got, m.host, symlinks=True, dirs_exist_ok=True)
                elif os.path.isfile(got) and os.path.isfile(m.host):
                    shutil.copyfile(got, m.host)
        except Exception:  # noqa: BLE001, S110  e.g. a link out of the target: nothing (more) is copied back
            pass

    def run(self, command: str, timeout_s: float, *, mounts: Iterable[Mount] | None = None) -> ExecResult:
        if self._closed:
            return ExecResult("", "sandbox is closed", 126, 0.0)
        if "\x00" in command:  # no argv can carry it (a model can emit one): a tool error, not a crash
            return ExecResult("", "sandbox: the command contains a NUL byte, which a shell cannot receive", 126, 0.0)
        extra = list(mounts or ())
        if not extra:
            return self._run(command, timeout_s)
        extra = list(self._check_mounts(extra, self.mounts)[len(self.mounts):])
        done: list[Mount] = []
        try:
            for m in extra:
                done.append(m)
                self._copy_in(m)
            return self._run(command, timeout_s)
        finally:
            for m in done:
                self._copy_out(m)

    def _run(self, command: str, timeout_s: float) -> ExecResult:
        from docker.utils.socket import frames_iter

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
            # the raw socket, read frame by frame, so it can be shut when the output cap fires: an open,
            # unread exec stream stalls the daemon's later calls on this container (its removal too)
            sock = api.exec_start(ex["Id"], socket=True)
            bufs, total, truncated, limit = [bytearray(), bytearray()], 0, False, None
            try:
                for stream_id, data in frames_iter(sock, tty=False):
                    if stream_id not in (1, 2) or not data:
                        continue
                    i = stream_id - 1
                    total += len(data)
                    room = lim.output_bytes - len(bufs[i])
                    if room > 0:
                        bufs[i] += data[:room]
                    truncated |= len(data) > room
                    if total > lim.output_kill_bytes:
                        limit = "output"
                        break
            finally:
                raw = getattr(sock, "_sock", sock)
                try:
                    raw.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
                raw.close()
            # detached: an attached exec can wait on the daemon while the first one's unread output
            # stream is still open (seen with an output-capped command); the exit code is polled instead
            self._container.exec_run(["sh", "-c", f'kill -9 -"$(cat {pgid_file})" 2>/dev/null; rm -f {pgid_file}'],
                                     detach=True)
            rc = self._exit_code(api, ex["Id"])
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

    @staticmethod
    def _exit_code(api, exec_id: str, wait_s: float = 10.0) -> int | None:
        """The exec's exit code once it stopped running (None when it still runs after wait_s)."""
        deadline = time.monotonic() + wait_s
        while True:
            info = api.exec_inspect(exec_id)
            if not info.get("Running") or time.monotonic() > deadline:
                return info.get("ExitCode")
            time.sleep(0.02)

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
