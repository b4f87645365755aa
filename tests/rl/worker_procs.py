"""The worker processes of a `tsrl train` run, as the fault tests watch them (processes.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def pids(out: Path) -> dict[str, int]:
    """{main, rollout, learner[-r], teacher: pid} while the workers run; {} before and after."""
    try:
        return json.loads((Path(out) / "processes.json").read_text())
    except (OSError, ValueError):
        return {}


def held_at(round_: int, marker: Path) -> dict[str, str]:
    """The environment of a run whose rollout process holds at round_'s start (rl/rollout_worker.py's
    HOLD_ENV): it creates `marker`, then waits while `marker` exists. A test that kills or stops the run
    once `marker` exists strikes mid-round on any machine load, since the run cannot finish first."""
    from tsrl_cli.rl.faults import HOLD_ENV

    return dict(os.environ, **{HOLD_ENV: f"{round_}:{marker}"})


def held_after(round_: int, ended: int, marker: Path) -> dict[str, str]:
    """The environment of a run whose rollout process holds in round_ once `ended` of its trajectories have
    ended (in the journal, on their way to the learner; HOLD_AFTER_ENV): a strike while `marker` exists lands
    mid-round with exactly that many of the round's trajectories done."""
    from tsrl_cli.rl.faults import HOLD_AFTER_ENV

    return dict(os.environ, **{HOLD_AFTER_ENV: f"{round_}:{ended}:{marker}"})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def run_ranks(target, args_of, world: int, timeout_s: float) -> dict[int, object]:
    """Spawn `world` processes target(*args_of(rank), q), each putting ("ok" | "error", rank, payload) on q; their
    payloads by rank once every rank has reported (an error's payload is its traceback), the processes joined."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            status, rank, payload = q.get(timeout=timeout_s)
            assert status == "ok", payload
            got[rank] = payload
        return got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
