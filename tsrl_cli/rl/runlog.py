"""The run directory, exactly as docs/run-directory.md describes it.

    config.yaml      the resolved config, written before round 1
    metrics.jsonl    one row per round
    events.jsonl     item / batch_backward / group_close / step / weight_sync / round_end rows
    rollouts.jsonl   with save_rollouts
    checkpoints/round-<k>/   written by the learner process
    DONE             JSON summary, written last

Whole files (config.yaml, DONE, a rewrite on resume) go through a temporary file and a rename;
JSONL rows are appended one whole line per write.
"""

from __future__ import annotations

import json
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.files import write_atomic, write_json_atomic, write_jsonl_atomic

FILES = ("metrics.jsonl", "events.jsonl", "rollouts.jsonl")


class RunLog:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def done_path(self) -> Path:
        return self.root / "DONE"

    def started(self) -> bool:
        return self.config_path.is_file()

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

    def rows(self, name: str) -> list[dict]:
        """The file's rows; a last line without its newline (the process was killed mid-append) is left out
        (resume drops it from the file too, with the rounds after the last checkpoint)."""
        p = self.root / name
        if not p.is_file():
            return []
        text = p.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            text = text[:text.rfind("\n") + 1]
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{p}:{n}: not a JSON row ({e.msg}); move the run directory away to start over") from None
        return out

    def checkpoints(self) -> dict[int, Path]:
        """Completed checkpoints (a state.json is the last file written before the rename)."""
        out = {}
        for d in (self.root / "checkpoints").glob("round-*"):
            if (d / "state.json").is_file() and d.name.removeprefix("round-").isdigit():
                out[int(d.name.removeprefix("round-"))] = d
        return dict(sorted(out.items()))

    def keep_rounds_up_to(self, k: int) -> None:
        """Resume: drop rows of rounds after the last checkpoint (they will be run again), and a torn last line."""
        for name in FILES:
            rows = self.rows(name)
            kept = [r for r in rows if r.get("round", 0) <= k]
            p = self.root / name
            torn = p.is_file() and p.stat().st_size and not p.read_bytes().endswith(b"\n")
            if len(kept) != len(rows) or torn:
                write_jsonl_atomic(self.root / name, kept)

    def write_done(self, summary: dict) -> None:
        write_json_atomic(self.done_path, summary)

    def remove_done(self) -> None:
        self.done_path.unlink(missing_ok=True)
