"""The run directory, written: what `tsrl train` appends and rewrites (docs/run-directory.md).

    RunLog(root)                     a RunDir (tsrl_cli/rundir.py: the names and every reader) that writes
      .write_config(text)            config.yaml, before round 1 (and again on resume)
      .append(name, rows)            JSON rows onto metrics.jsonl / events.jsonl / rollouts.jsonl
      .rewrite(name, rows)           a whole JSON-lines file replaced (a round's row gains its eval metrics)
      .keep_rounds_up_to(k)          resume: the rows of rounds after checkpoint k go, and a torn last line
      .write_done(summary), .remove_done()

Whole files (config.yaml, DONE, a rewrite) go through a temporary file and a rename; JSONL rows are
appended one whole line per write, so a kill mid-append tears at most the last line, which every
reader of the run drops (rundir.DROP_LAST) and resume removes. Checkpoints are the learner's.
"""

from __future__ import annotations

import json

from tsrl_cli.files import write_atomic, write_json_atomic, write_jsonl_atomic
from tsrl_cli.rundir import DROP_LAST, LOGS, RunDir


class RunLog(RunDir):
    def write_config(self, text: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config_path, text)

    def append(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows)
        with open(self.root / name, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()

    def rewrite(self, name: str, rows: list[dict]) -> None:
        write_jsonl_atomic(self.root / name, rows)

    def keep_rounds_up_to(self, k: int) -> None:
        """Resume: drop rows of rounds after the last checkpoint (they will be run again), and a torn last line."""
        for name in LOGS:
            got = self.read(name, DROP_LAST)
            kept = [r for r in got.rows if r.get("round", 0) <= k]
            if len(kept) != len(got.rows) or got.torn:
                self.rewrite(name, kept)

    def write_done(self, summary: dict) -> None:
        write_json_atomic(self.done_path, summary)

    def remove_done(self) -> None:
        self.done_path.unlink(missing_ok=True)
