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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
