"""CPU seconds per round of each process of a running `tsrl train` (Linux /proc), rounds 2 to the last.

    tsrl train EXP.yaml --schedule stream --out RUN &  python experiments/opd_breakdown_cpu.py RUN

It waits for RUN/processes.json, samples each worker's utime + stime every 10 ms and prints one JSON
line: per-round CPU seconds of the rollout, learner and (OPD) teacher processes, from the first
sample after round 1's metrics row to the first after the last one seen. With C cores shared by
the processes, a stream round cannot be shorter than (sum of their CPU seconds) / C, nor than the
rollout's makespan: on the 2-core CPU machine that bound, not the event model's ceiling, is what
stream meets first (results/LOG.md, 2026-12-03). events.jsonl holds the learner's and the teacher's
CPU seconds inside their work spans, not the rollout's; this covers every process whole.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, None once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    run = Path((argv or sys.argv[1:])[0])
    while not (run / "processes.json").is_file():
        time.sleep(0.02)
    pids = {k: v for k, v in json.loads((run / "processes.json").read_text()).items() if k != "main"}
    metrics = run / "metrics.jsonl"
    marks: dict[int, tuple[float, dict]] = {}  # rounds written -> first sample after
    while True:
        rounds = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        now = {k: cpu_seconds(p) for k, p in pids.items()}
        if any(v is None for v in now.values()):  # a worker exited: the run is over
            break
        marks.setdefault(rounds, (time.monotonic(), now))
        time.sleep(0.01)
    if 1 not in marks or max(marks) < 2:
        print(f"{run}: fewer than two rounds sampled", file=sys.stderr)
        return 1
    (t0, a), (t1, b) = marks[1], marks[max(marks)]
    n = max(marks) - 1
    print(json.dumps({"rounds": f"2-{max(marks)}", "wall_per_round_s": round((t1 - t0) / n, 3),
                      **{f"{k}_cpu_s": round((b[k] - a[k]) / n, 3) for k in a}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
