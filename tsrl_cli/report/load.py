"""Find run directories under a results tree and read them (docs/run-directory.md).

A run is `<root>/<experiment>/<schedule>/seed<k>/` holding metrics.jsonl (+ events.jsonl,
config.yaml, DONE). The experiment may be a nested path (`spread/sigma1`). Runs without DONE are
partial: left out unless asked for, and listed either way.

What comes out: the runs (with each run's setup, read from its own config.yaml) and one tidy frame
of rounds, one row per (experiment, schedule, seed, round) with every metric as a column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from tsrl_cli.config import ConfigError
from tsrl_cli.devices import parse_devices
from tsrl_cli.errors import UsageError
from tsrl_cli.rundir import EVENTS, METRICS, SKIP, RunDir, runs_under

RUN = ["experiment", "schedule", "seed"]
_SEED_DIR = re.compile(r"seed(-?\d+)$")


@dataclass(frozen=True)
class Setup:
    """Where and on what a run ran, from its resolved config.yaml: the report's "ours" label.

    devices: how many devices of `device_kind` the run's processes held while it ran, so that
    device-seconds = wall seconds x devices. On cpu each process is one device (every worker runs one
    OpenMP thread, tsrl_cli/processes.py); a CUDA device shared by two sides counts once.
    """

    device_kind: str | None  # "cuda" when any side ran on a GPU, else "cpu" (or "mps"); None: unknown
    devices: int | None  # devices of that kind held; None when the config does not say
    placement: str  # e.g. "rollout cpu, learner cpu:2"
    model: str  # the policy the config names
    tasks: str  # data.train, comma-joined

    @property
    def label(self) -> str:
        """e.g. '2 cpu devices (rollout cpu, learner cpu); model builtin:toy; tasks builtin:echo'."""
        where = f"{self.devices} {self.device_kind} device{'s' * (self.devices != 1)}" if self.devices else \
            "devices unknown"
        return f"{where} ({self.placement}); model {self.model}; tasks {self.tasks}"


@dataclass
class Run:
    experiment: str
    schedule: str
    seed: int
    path: Path
    done: bool
    config: dict = field(default_factory=dict)
    setup: Setup | None = None

    @property
    def dir(self) -> RunDir:
        return RunDir(self.path)

    @property
    def events_path(self) -> Path:
        return self.dir.file(EVENTS)

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.schedule}/seed{self.seed}"


@dataclass
class Results:
    runs: list[Run]  # sorted by (experiment, schedule, seed)
    rounds: pd.DataFrame  # RUN + round + every metrics.jsonl key, plus device_s (wall_s x the run's devices)
    notes: list[str]


def load_results(root: str | Path, include_partial: bool = False) -> Results:
    """Every run under root, its rounds as one frame, and notes on what was left out."""
    root = Path(root)
    runs, records, notes = [], [], []
    for rd in runs_under(root):
        d, metrics = rd.root, rd.file(METRICS)
        m = _SEED_DIR.match(d.name)
        rel = d.relative_to(root).parts
        if m is None or len(rel) < 3:
            notes.append(f"{d}: not <experiment>/<schedule>/seed<k>/, skipped")
            continue
        done = rd.done()
        if not done and not include_partial:
            notes.append(f"{d.relative_to(root)}: no DONE (unfinished run), skipped; --include-partial counts it")
            continue
        run = Run("/".join(rel[:-2]), rel[-2], int(m.group(1)), d, done)
        rounds, bad = _merged_rounds(rd)
        if bad:
            notes.append(f"{metrics.relative_to(root)}: {bad} unreadable line(s) ignored")
        run.config = _read_config(rd, run.name, notes)
        run.setup = run_setup(run.config)
        if run.setup.devices is None:
            notes.append(f"{run.name}: {run.setup.placement}, so no device-hours")
        if not done:
            notes.append(f"{d.relative_to(root)}: no DONE, counted as partial ({len(rounds)} rounds)")
        runs.append(run)
        # the directory names the run: a row's own experiment/schedule/seed keys do not override it
        records += [{"experiment": run.experiment, "schedule": run.schedule, "seed": run.seed, "round": k,
                     "devices": run.setup.devices, **{c: v for c, v in row.items() if c not in RUN}}
                    for k, row in rounds.items()]
    runs.sort(key=lambda r: (r.experiment, r.schedule, r.seed))
    frame = pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=[*RUN, "round", "devices"])
    # device-seconds: the devices the run's processes held, times its wall time (cumulative, like wall_s)
    frame["device_s"] = numeric(frame, "wall_s") * numeric(frame, "devices")
    return Results(runs, frame.drop(columns="devices"), notes)


def numeric(frame: pd.DataFrame, key: str) -> pd.Series:
    """One column as float, NaN where a value is missing, not a number, or infinite."""
    if key not in frame:
        return pd.Series(float("nan"), index=frame.index, dtype="float64")
    col = frame[key].map(lambda v: v if isinstance(v, (int, float, str)) else None)  # lists, dicts: no number
    return pd.to_numeric(col, errors="coerce").astype("float64").replace([float("inf"), float("-inf")], float("nan"))


def run_setup(config: dict) -> Setup:
    """The run's devices, model and tasks as its resolved config names them."""
    model = config_value(config, "model.policy") or config_value(config, "model.name") or config_value(config, "model")
    model = str(model) if isinstance(model, (str, int)) else "unknown model"
    train = config_value(config, "data.train")
    tasks = ", ".join(map(str, train)) if isinstance(train, list) else str(train) if train else "unknown tasks"
    dev = config.get("devices") if isinstance(config.get("devices"), dict) else None
    if dev is None:
        return Setup(None, None, "no devices in config.yaml", model, tasks)
    remote = config_value(config, "rollout.engine") == "openai"  # rollouts served elsewhere (tsrl serve)
    try:
        rollout = [] if remote else list(parse_devices(dev.get("rollout", "cpu"), "devices.rollout"))
        learner = list(parse_devices(dev.get("learner", "cpu"), "devices.learner"))
        teacher = []
        if config.get("objective") == "opd":  # the teacher defaults to the rollout side's first device
            teacher = list(parse_devices(dev["teacher"], "devices.teacher")) if dev.get("teacher") is not None \
                else rollout[:1] or ["cpu"]
    except UsageError as e:
        return Setup(None, None, f"unreadable devices ({e})", model, tasks)
    held = rollout + learner + teacher
    gpus = {d for d in held if d.startswith("cuda")}
    kind = "cuda" if gpus else "mps" if "mps" in held else "cpu"
    n = len(gpus) if gpus else 1 if kind == "mps" else held.count("cpu")
    teacher_part = f", teacher {teacher[0]}" if teacher else ""
    placement = f"rollout {'remote' if remote else dev.get('rollout', 'cpu')}, learner {dev.get('learner', 'cpu')}"
    return Setup(kind, n, placement + teacher_part, model, tasks)


def config_value(config: dict, dotted: str):
    """config['a']['b'] for 'a.b' (None when any part is missing)."""
    cur = config
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def flat_config(config: dict, prefix: str = "") -> dict[str, object]:
    """{'a.b': value} for every leaf."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        out.update(flat_config(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def _merged_rounds(rd: RunDir) -> tuple[dict[int, dict], int]:
    """Rows of the same round (the round row, an eval row) merged; a later non-null value wins. Lines
    that are no JSON object, or have no integer round, are counted (a run may be mid-write)."""
    got = rd.read(METRICS, SKIP)
    bad = got.skipped
    out: dict[int, dict] = {}
    for row in got.rows:
        k = row.get("round")
        if not isinstance(k, int) or isinstance(k, bool):
            bad += 1
            continue
        out.setdefault(k, {}).update({c: v for c, v in row.items() if v is not None and c != "round"})
    return dict(sorted(out.items())), bad


def _read_config(rd: RunDir, name: str, notes: list[str]) -> dict:
    """The run's config.yaml as written (the report reads keys by dotted path). A file that is no YAML
    mapping is ignored with a note; one this version's load_config refuses (a key since renamed or
    removed) is still read as written, with a note naming the key."""
    try:
        cfg = rd.config_dict()
    except ConfigError as e:
        notes.append(f"{e}; ignored")
        return {}
    if cfg:
        try:
            rd.config()
        except ConfigError as e:
            notes.append(f"{name}: config.yaml does not load in this version ({e}); its keys are read as written")
    return cfg
