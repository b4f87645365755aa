"""The run directory, written: what `tsrl train` appends and rewrites (docs/run-directory.md).

    RunLog(root)                     a RunDir (tsrl_cli/rundir.py: the names and every reader) that writes
      .write_config(text)            config.yaml, before round 1 (and again on resume)
      .append(name, rows)            JSON rows onto metrics.jsonl / events.jsonl / rollouts.jsonl
      .rewrite(name, rows)           a whole JSON-lines file replaced (a round's row gains its eval metrics)
      .keep_rounds_up_to(k)          resume: the rows of rounds after checkpoint k go, and a torn last line
      .append(journal_name(k), rows, durable=True)   a trajectory onto round k's journal (the rollout process)
      .keep_journal_of(k)            resume: round k's journal without a torn last line; every other round's goes
      .forget_journal(upto)          the journals of rounds up to a checkpoint go (all of them: upto None)
      .write_done(summary), .remove_done()

Whole files (config.yaml, DONE, a rewrite) go through a temporary file and a rename; JSONL rows are
appended one whole line per write, so a kill mid-append tears at most the last line, which every
reader of the run drops (rundir.DROP_LAST) and resume removes. Checkpoints are the learner's.
A durable append is fsynced before it returns (and the folder too when it created the file): the
journal's row survives the machine, not only the process.
"""

from __future__ import annotations

import json
import os

from tsrl_cli.files import write_atomic, write_json_atomic, write_jsonl_atomic
from tsrl_cli.rundir import DROP_LAST, JOURNAL, LOGS, Rows, RunDir


class RunLog(RunDir):
    def write_config(self, text: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config_path, text)

    def append(self, name: str, rows: list[dict], durable: bool = False) -> None:
        """Rows onto root/name (its folder made when missing); durable: fsynced before this returns."""
        if not rows:
            return
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows)
        path = self.root / name
        new = not path.exists()
        if new:
            path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if durable and new:  # the file's name in its folder is durable too
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def rewrite(self, name: str, rows: list[dict]) -> None:
        write_jsonl_atomic(self.root / name, rows)

    def keep_rounds_up_to(self, k: int) -> None:
        """Resume: drop rows of rounds after the last checkpoint (they will be run again), and a torn last line."""
        for name in LOGS:
            got = self.read(name, DROP_LAST)
            kept = [r for r in got.rows if r.get("round", 0) <= k]
            if len(kept) != len(got.rows) or got.torn:
                self.rewrite(name, kept)

    def keep_journal_of(self, round_: int) -> Rows:
        """Resume: round_'s journal (rl/journal.py) under DROP_LAST, rewritten without a torn last line so that
        new rows append after whole ones; the journals of every other round are removed."""
        self.forget_journal(exclude=round_)
        got = self.read(self.journal_name(round_), DROP_LAST)
        if got.torn:
            self.rewrite(self.journal_name(round_), got.rows)
        return got

    def forget_journal(self, upto: int | None = None, exclude: int | None = None) -> None:
        """Remove the journals of rounds <= upto except `exclude`. With neither (every journal: called while no
        worker runs) the folder goes too; during a run it stays, since the rollout process may be creating a
        later round's file in it."""
        for k in self.journal_rounds():
            if (upto is None or k <= upto) and k != exclude:
                (self.root / self.journal_name(k)).unlink(missing_ok=True)
        folder = self.root / JOURNAL
        if upto is None and exclude is None and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()

    def write_done(self, summary: dict) -> None:
        write_json_atomic(self.done_path, summary)

    def remove_done(self) -> None:
        self.done_path.unlink(missing_ok=True)
