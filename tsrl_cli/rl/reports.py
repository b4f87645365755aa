"""What the worker processes report to the orchestrator, round by round (rl/record.py reads it).

Every message on the report queue is a tuple (kind, who, payload): kind a Report; who the sender's
name, the round (a round's report) or the weights' version (weights_applied); payload one of the
dataclasses below. Field names are the metrics.jsonl / events.jsonl keys they become, where they
carry over (docs/run-directory.md). Times are absolute time.monotonic() seconds; the record makes
them relative to the round's start. Plain picklable dataclasses, like rl/types.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum


class Report(StrEnum):
    """The kind of a report message. processes.guarded (a lower layer) sends done and error as these strings."""

    ready = "ready"  # who: the process; payload None. Every process ready: round 1 starts
    done = "done"  # who: the process, which returned; payload None
    progress = "progress"  # who: rollout | learner; payload: a dict, the progress callback's event (tsrl train's bars)
    log = "log"  # who: the process; payload: a line for the user (a remote server marked dead, ...)
    error = "error"  # who: the process; payload: its traceback. The run stops
    weights_applied = "weights_applied"  # who: the version; payload: WeightSync, the rollout side took those weights
    rollout_round = "rollout_round"  # who: the round; payload: RolloutReport
    learner_round = "learner_round"  # who: the round; payload: LearnerReport
    teacher_round = "teacher_round"  # who: the round; payload: TeacherReport (OPD)


class ByName:
    """A record whose fields also read by name, row["id"], like the JSON row it becomes."""

    def __getitem__(self, key: str):
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


# ---- the learner's items (built by rl/schedules.py RoundWork as they arrive and run) ---------------
@dataclass(kw_only=True)
class Item(ByName):
    """One learner item, events.jsonl `item`: a GRPO trajectory (TrajectoryItem) or an OPD turn (TurnItem).
    backward_start/end: when it was backwarded (None until then; an item without loss tokens: its arrival)."""

    id: str  # "<group_id>/<sample_index>" (GRPO), "<group_id>/<sample_index>/t<turn>" (OPD)
    group_id: str
    sample_index: int
    turn: int | None  # OPD: the model turn; GRPO: None
    finished_at: float  # arrival at the learner
    backward_start: float | None
    backward_end: float | None
    tokens: int  # GRPO: the trajectory's; OPD: the turn's span
    loss_tokens: int
    staleness: int
    reward: float | None  # None on an OPD turn
    share: float = 1.0  # stream: its share (by loss tokens) of the micro-batch it was backwarded in
    deferred: bool | None = None  # stream: loss.max_open_groups held it back to its close; None elsewhere


@dataclass(kw_only=True)
class TrajectoryItem(Item):
    """GRPO: the trajectory is the item; its model turns and why it ended (the exit reason's kind)."""

    turns: int
    exit: str


@dataclass(kw_only=True)
class TurnItem(Item):
    """OPD: a teacher-scored turn. Where its time went before the learner: rollout close -> teacher start ->
    scores (finished_at); the prefix its backward row covers; whether it was known to be its trajectory's last."""

    closed_at: float
    teacher_start: float | None
    prefix_tokens: int
    last: bool


@dataclass
class TrajectoryEnd(ByName):
    """OPD: a trajectory's end as the learner received it (events.jsonl `trajectory`; its turns are the items)."""

    id: str
    group_id: str
    sample_index: int
    finished_at: float
    tokens: int  # the whole trajectory
    loss_tokens: int
    staleness: int
    reward: float
    turns: int
    exit: str


@dataclass
class GroupClose:
    """A GRPO group's (or OPD prompt's) last trajectory reached the learner at `at`."""

    group_id: str
    at: float


@dataclass
class Span:
    start: float
    end: float


@dataclass
class BatchSpan:
    """sync / async: the lazy computation after the last arrival (events.jsonl `batch_backward`)."""

    start: float
    end: float
    items: int
    padded: bool  # False under sync_batching per_item
    loss_tokens: int


@dataclass
class Published:
    """The learner's offer of new weights to the weight bus; bytes: what one engine receives."""

    start: float
    end: float
    bytes: int


@dataclass
class LearnerWork(ByName):
    """The round's learner work in token positions (rows x width per backward, padding included), beside the
    two trajectory-level references: every trajectory once (sum T_i) and the lazy padded batch (B x T_max)."""

    positions: int
    trajectory_tokens: int
    padded_tokens: int
    busy_cpu_s: float  # the learner's CPU seconds inside its busy spans
    real_positions: int = 0  # the backwards' rows' own lengths: positions without padding (= positions packed)


@dataclass
class RankFigures:
    """One learner rank's figures of a round (gathered on rank 0)."""

    peak_rss: int
    peak_device: int | None  # None on CPU
    accumulator_peak_bytes: int
    accumulator_set_bytes: int  # one parameter-sized buffer set on this rank
    backwards: int
    loss: float | None  # this rank's part of the lazy loss; stream never forms it


@dataclass
class PerRank:
    """Every rank's figures in rank order (one entry on a single-device learner)."""

    peak_rss: list[int]
    peak_device: list[int | None]
    accumulator_peak_bytes: list[int]
    accumulator_set_bytes: list[int]
    backwards: list[int]
    loss: list[float | None]

    @classmethod
    def gathered(cls, ranks: list[RankFigures]) -> PerRank:
        return cls(*([getattr(r, f.name) for r in ranks] for f in fields(RankFigures)))

    @property
    def round_loss(self) -> float | None:
        """The lazy loss of the round, the ranks' parts summed; None where a rank formed none."""
        return None if any(x is None for x in self.loss) else sum(self.loss)


@dataclass
class Certificate:
    """A certified round's result (run.verify_every, rl/certificate.py)."""

    verify_rel_diff: float  # max |lazy - other| / max |lazy| over the round's gradient
    verify_s: float  # the recomputation and comparison


@dataclass
class LearnerReport:
    """Learner rank 0's round: its items, spans and figures."""

    version: int  # the weights after this round's step
    items: list[Item]
    group_close: list[GroupClose]
    batch: BatchSpan | None  # sync / async; None under stream
    trajectories: list[TrajectoryEnd]  # OPD; empty under GRPO
    last_arrival: float  # the round's last message at the learner
    busy_s: float  # forward + backward + optimizer step
    step: Span  # the gradient's final assembly and the optimizer step
    publish: Published
    grad_norm: float
    model_bytes: int | None
    trainable_bytes: int | None
    opd_reverse_kl: float | None  # OPD; None under GRPO
    microbatches: int  # all ranks'
    learners: int  # ranks
    work: LearnerWork
    ranks: PerRank
    verify: Certificate | None = None  # a certified round's
    checkpoint: str | None = None  # the round's checkpoint, where the plan saves one
    checkpoint_s: float | None = None


# ---- the rollout side --------------------------------------------------------------------------
@dataclass
class Sampled:
    """What the rollout side sampled (events.jsonl `sampled`, the bias audit's reference)."""

    tasks: dict[str, int]  # task -> trajectories
    tokens: list[int]  # per trajectory, in (group_id, sample_index) order
    turns: list[int]


# each batcher's take_stats() figure (engines/batching_stats.py) -> its metrics.jsonl key, a list over replicas
BATCHING_METRICS = {"generated_tokens": "replica_generated_tokens", "tokens_per_s": "replica_tokens_per_s",
                    "queue_wait_mean_s": "replica_queue_wait_mean_s", "queue_wait_p95_s": "replica_queue_wait_p95_s",
                    "running_mean": "replica_running_mean", "steps": "replica_engine_steps"}


@dataclass
class Batching:
    """The round's batching metrics: `rollout_batching` (continuous | static) and one list per figure, an entry
    per replica in replica order; all None for remote servers (rollout.engine openai), which batch for themselves."""

    rollout_batching: str | None = None
    replica_generated_tokens: list[int] | None = None
    replica_tokens_per_s: list[float] | None = None
    replica_queue_wait_mean_s: list[float] | None = None
    replica_queue_wait_p95_s: list[float] | None = None
    replica_running_mean: list[float] | None = None
    replica_engine_steps: list[int] | None = None

    @classmethod
    def of(cls, per_replica: list[dict] | None) -> Batching:
        """From each replica's take_stats() figures (None: remote servers)."""
        if per_replica is None:
            return cls()
        return cls(per_replica[0]["batching"],
                   **{key: [r[figure] for r in per_replica] for figure, key in BATCHING_METRICS.items()})


@dataclass
class RolloutReport(ByName):
    """The rollout process's round: the frozen version, the generation span, and the round's tally."""

    version: int  # the weights that generated the round
    gen_start: float
    gen_end: float
    last_finished: float
    trajectories: int
    tokens: int
    loss_tokens: int
    reward_mean: float
    reward_std: float  # population std; 0.0 for one trajectory
    turns_mean: float
    exit_reasons: dict[str, int]  # reason kind -> trajectories
    env_errors: int  # trajectories whose environment did not start (masked)
    resumed_trajectories: int  # read back from the round's journal instead of generated (rl/journal.py)
    tool_call_errors: int  # model turns whose tool call could not be run
    tool_call_error_kinds: dict[str, int]
    sampled: Sampled
    tool_s: float  # real tool seconds, summed over trajectories
    injected_s: float  # injected tool latency, summed
    engine: str  # the engine's class name
    replicas: int
    batching: Batching
    replica_requests: list[int] | None = None  # requests each replica or server served; None: one local engine
    peak_rss_replicas: list[int] | None = None  # replica processes only
    peak_device_replicas: list[int | None] | None = None
    rollouts: list[dict] | None = None  # run.save_rollouts: rollouts.jsonl's rows, in key order
    peak_rss: int | None = None  # this process's, set when the round is over
    peak_device: int | None = None
    masked_trajectories: int = 0  # infrastructure failures (env_error, engine_error): out of their groups and the loss


@dataclass
class WeightSync:
    """A weight sync: weights_applied's payload (the rollout side's load span) and the round's sync in the
    record (the learner's publish start to that load's end; async: the publish span). bytes: what the bus
    delivered to all engines; hosts: the engines that took it (both None under async)."""

    start: float
    end: float
    bytes: int | None = None
    hosts: int | None = None


@dataclass
class TeacherReport:
    """OPD's teacher process: its scoring time and work in the round."""

    busy_s: float
    busy_cpu_s: float  # against busy_s: how much of the scoring wall time this process had a core
    turns: int
    positions: int  # token positions its forwards covered
    peak_rss: int | None = None  # set when the round is over
    peak_device: int | None = None


@dataclass
class RoundReports:
    """One round's reports as they reach the orchestrator (the teacher's under OPD only)."""

    rollout: RolloutReport | None = None
    learner: LearnerReport | None = None
    teacher: TeacherReport | None = None

    def complete(self, opd: bool) -> bool:
        return self.rollout is not None and self.learner is not None and (self.teacher is not None or not opd)
