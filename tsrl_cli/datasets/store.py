"""Prepared datasets on disk: find one by name or path, open it, list them.

`open_dataset` is the one dataset loader: training (rl.tasks), evaluation, the probe, the
default policy's demonstrations and `tsrl env` all read prepared datasets through it. A name is
a folder path, or a folder under data/; a missing one is a usage error that says which
`tsrl prepare-data` command makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tsrl_cli.datasets.records import MANIFEST, load_dataset_dir, read_manifest
from tsrl_cli.errors import UsageError

DATA_ROOT = Path("data")
# the four datasets `tsrl prepare-data embedded` writes, evaluation sets first
EMBEDDED_SETS = ("embedded_repair_heldout", "embedded_terminal_heldout", "embedded_repair_train",
                 "embedded_terminal_train")


@dataclass(frozen=True)
class Dataset:
    name: str  # the folder's name: what summaries, metrics and task keys call it
    path: Path
    manifest: dict
    tasks: list  # RepairTask | TerminalTask records, in file order

    @property
    def pairs(self) -> list[tuple[Path, object]]:
        """(dataset folder, task) per task: what an environment needs to start."""
        return [(self.path, t) for t in self.tasks]


def prepare_hint(name: str | Path) -> str:
    """The command that makes dataset `name`."""
    base = Path(name).name
    if base in EMBEDDED_SETS:
        return "run `tsrl prepare-data embedded` first"
    source = {"swebench_verified": "swebench-verified", "swe_smith": "swe-smith", "seta_env": "seta-env",
              "terminal_bench": "terminal-bench --from DIR"}.get(base)
    return f"run `tsrl prepare-data {source}` first" if source else "prepare it with `tsrl prepare-data SOURCE`"


def resolve(name: str | Path, hint: str | None = None) -> Path:
    """NAME is a path to a prepared dataset, or a name under data/."""
    for p in (Path(name), DATA_ROOT / name):
        if p.is_dir():
            return p
    raise UsageError(f"{name}: no such dataset (neither {name} nor {DATA_ROOT / name} is a folder); "
                     f"{hint or prepare_hint(name)}")


def open_dataset(name: str | Path, limit: int | None = None, hint: str | None = None) -> Dataset:
    """The prepared dataset `name` (its first `limit` tasks when given)."""
    d = resolve(name, hint)
    m, tasks = load_dataset_dir(d)
    return Dataset(d.name, d, m, tasks[:limit] if limit else tasks)


def list_datasets(root: str | Path = DATA_ROOT) -> list[dict]:
    """Prepared datasets under `root` (folders with a manifest), with their kind and task count."""
    out = []
    for f in sorted(Path(root).glob(f"*/{MANIFEST}")):
        try:
            m = read_manifest(f.parent)
        except UsageError:
            continue
        out.append({"name": f.parent.name, "path": str(f.parent), "kind": m.get("kind"), "source": m.get("source"),
                    "tasks": m.get("written")})
    return out
