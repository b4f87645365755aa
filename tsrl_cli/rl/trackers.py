"""Each metrics row also to TensorBoard and/or Weights & Biases (`run.trackers`), beside metrics.jsonl.

    require_trackers(cfg.run.trackers)                  # exit 2 now if a backend is not installed
    trackers = open_trackers(run_dir, cfg, cfg.run.trackers, first_round=k)
    trackers.log(row, step=row["round"])                # the row just appended to metrics.jsonl
    trackers.close()

metrics.jsonl stays the record (reports read only it); a tracker is a view of the same numbers:
numeric scalars only, nested dicts flattened with `/`, everything else (strings, bools, lists,
nulls) left out. Each backend is imported only when a run asks for it.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import secrets
import urllib.parse
from pathlib import Path

from tsrl_cli.config import TrainConfig, config_to_dict
from tsrl_cli.errors import UsageError

# tracker -> (importable module, pip extra of this package); config.Tracker allows the same names
BACKENDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def scalars(row: dict, prefix: str = "") -> dict[str, int | float]:
    """The numeric leaves of `row`, keyed `a/b` for row["a"]["b"]; bools are flags, not numbers."""
    out: dict[str, int | float] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = value
    return out


def require_trackers(names: tuple[str, ...] | list[str]) -> None:
    """UsageError (exit 2) naming run.trackers and the pip extra, for the first tracker not installed."""
    for name in names:
        module, extra = BACKENDS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
            found = False
        if not found:
            raise UsageError(f"run.trackers: {name} is not installed; pip install -e '.[{extra}]' "
                             f"(or remove {name} from run.trackers)")


def run_name(cfg: TrainConfig) -> str:
    return f"{cfg.name}/{cfg.schedule}/seed{cfg.seed}"


class TensorBoard:
    """Event files in <run_dir>/tensorboard/ (torch's SummaryWriter).

    Values are written as float64 tensors (new_style, double_precision): TensorBoard's default
    float32 would round byte counts and times, and the values would no longer equal metrics.jsonl.
    """

    def __init__(self, run_dir: Path, cfg: TrainConfig, first_round: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run re-runs the rounds after its last checkpoint; TensorBoard hides
        # the interrupted attempt's events from that round on, so each round shows once
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_round)
        self.note = None

    def log(self, values: dict[str, int | float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)
        self.writer.flush()  # one flush per round: a crashed run keeps what it logged

    def close(self, failed: bool = False) -> None:
        self.writer.close()


def wandb_key_configured() -> bool:
    """An API key in the environment or in ~/.netrc (where `wandb login` writes it) for the W&B host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandB:
    """A W&B run in <run_dir>/wandb/, offline when WANDB_MODE is unset and no API key is configured.

    The x axis is the `round` value (define_metric), not wandb's own `_step`, which counts log
    calls: held-out evaluations reach round K after the last round, and a resumed run re-logs the
    rounds after its last checkpoint. The run id is kept in <run_dir>/wandb/run_id, so a resumed
    run continues the same W&B run (offline: a second offline-run-* folder with that id, which
    `wandb sync` joins).
    """

    def __init__(self, run_dir: Path, cfg: TrainConfig, first_round: int):
        import wandb

        self.note = None
        mode = os.environ.get("WANDB_MODE")
        if not mode and not wandb_key_configured():
            mode = "offline"
            self.note = (f"wandb logs offline to {run_dir / 'wandb'} (no API key configured, WANDB_MODE unset); "
                         "`wandb sync` uploads it later")
        id_file = run_dir / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4) + "\n", encoding="utf-8")  # 8 characters [0-9a-f]
        self.run = wandb.init(
            dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", "tsrl"), name=run_name(cfg),
            id=id_file.read_text(encoding="utf-8").strip(), resume="allow", config=config_to_dict(cfg), mode=mode,
            # console off: metrics go through log(); wandb does not wrap this process's stdout/stderr
            settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")

    def log(self, values: dict[str, int | float], step: int) -> None:
        self.run.log({**values, "round": step})

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)  # a run that stopped on an error shows as failed
        # finish() can return before wandb's service process has written the run's file (seen here: a
        # .wandb of 7 bytes right after finish, complete later); teardown waits for that process to exit,
        # so the file is complete before DONE is written. It ends this process's W&B session.
        wandb.teardown()


OPENERS = {"tensorboard": TensorBoard, "wandb": WandB}


class Trackers:
    """The trackers a run asked for (none: log and close do nothing)."""

    def __init__(self, backends: list):
        self.backends = backends

    @property
    def notes(self) -> list[str]:
        """One line each for the user (wandb chose offline)."""
        return [b.note for b in self.backends if b.note]

    def log(self, row: dict, step: int) -> None:
        values = scalars(row)
        for b in self.backends:
            b.log(values, step)

    def close(self, failed: bool = False) -> None:
        """Close every backend; `failed`: the run stopped on an error (W&B marks the run failed)."""
        for b in self.backends:
            b.close(failed)
        self.backends = []


def open_trackers(run_dir: str | Path, cfg: TrainConfig, names: tuple[str, ...] | list[str],
                  first_round: int = 1) -> Trackers:
    """Open each named tracker; `first_round` is the first round this invocation runs (resume: k+1)."""
    require_trackers(names)
    opened = Trackers([])
    for name in names:
        try:
            opened.backends.append(OPENERS[name](Path(run_dir), cfg, first_round))
        except BaseException as e:
            opened.close(failed=True)  # the ones already open
            if isinstance(e, ImportError):  # installed but broken (a dependency of the backend is missing)
                raise UsageError(f"run.trackers: {name} does not import ({e}); "
                                 f"pip install -e '.[{BACKENDS[name][1]}]'") from None
            raise
    return opened
