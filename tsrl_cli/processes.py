"""Per-process setup and measurements shared by the worker processes (the round engine, the policy build)."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import threading
import time
import traceback

THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
              "TOKENIZERS_PARALLELISM": "false"}


@contextlib.contextmanager
def sigterm_raises():
    """Inside: SIGTERM raises SystemExit(143) in the main thread, so `with Workers(...)` stops its worker
    processes. Without it a killed `tsrl train` or `tsrl sweep` died at once and left its rollout and
    learner processes running (found still busy 20 minutes after a `pkill`, results/LOG.md 2026-12-01)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def thread_env() -> None:
    """One OpenMP thread per process, set before torch starts its pool (measured on this 2-core
    machine: two OpenMP threads beside another busy process ran up to 37x slower than one)."""
    for k, v in THREAD_ENV.items():
        os.environ.setdefault(k, v)


# torch is imported inside the functions below, never at module level: OpenMP reads OMP_NUM_THREADS when
# torch's library loads, so thread_env() must run first (the one exception to module-level imports).


def init_worker() -> None:
    thread_env()
    import torch

    torch.set_num_threads(1)


def peak_rss_bytes() -> int | None:
    """Peak resident memory of this process since the last reset (VmHWM), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # not Linux: peak since the process started (kB on Linux, bytes on macOS)
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024
    except Exception:  # noqa: BLE001
        return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs), so peaks are per round."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def reset_peak_device(device: str) -> None:
    """Start a new peak of accelerator memory (CUDA); nothing on CPU."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_device_bytes(device: str) -> int | None:
    """Peak bytes allocated by torch on a CUDA device since the last reset; None on CPU (see peak_rss)."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.max_memory_allocated(device))


def exit_with(main_pid: int, period_s: float = 0.5) -> None:
    """A daemon thread that ends this process when `main_pid` is gone.

    A worker is a child of the forkserver, not of the main process, and a main process killed with
    SIGKILL runs no cleanup: without this its workers would live on, blocked on their queues.
    """
    parent = os.getppid()  # the forkserver (or, under spawn, main): it ends when main does

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:  # re-parented: robust where main's pid has been reused
                os._exit(1)
            try:
                os.kill(main_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # a pid owned by someone else now: main is gone
                os._exit(1)

    threading.Thread(target=watch, name="tsrl-exit-with-main", daemon=True).start()


def guarded(name: str, report_q, main_pid: int, fn, *args) -> None:
    """Run a worker's main, ending with the main process; on failure report ("error", name, traceback)
    instead of dying silently."""
    exit_with(main_pid)
    try:
        fn(*args)
        report_q.put(("done", name, None))
    except BaseException:  # noqa: BLE001 - the orchestrator shows it and stops the run
        report_q.put(("error", name, traceback.format_exc()))
        raise SystemExit(1) from None
