"""What flows between the processes of a run. Plain picklable dataclasses; times are
time.monotonic() seconds (one system-wide clock on Linux, so processes' stamps compare).

A trajectory's life, one name per stage:
  TokenTrajectory (agent/renderer.py)   grows turn by turn in the agent loop: tokens, loss mask, turn spans
  Rollout (rollouts.py)                 the finished record: tokens, mask, reward, spans, per-token scores (JSONL)
  TurnClosed / TurnScored / TrajectoryDone (here)
                                        the messages that carry it between processes: a closed model turn to the
                                        teacher, its scores to the learner (OPD); the ended trajectory with its
                                        reward (GRPO's learner input; OPD's end of a trajectory)
  Arrival (rl/arrivals.py)              the round learner's queued unit of backward work: a trajectory, a turn
  Item (rl/reports.py)                  its timing row in events.jsonl (finished, backward start and end)
"""

from __future__ import annotations

from dataclasses import dataclass

from tsrl_cli.rollouts import Rollout


@dataclass(frozen=True)
class GroupSpec:
    group_id: str  # unique in the round: the task key (suffixed #k if a task is drawn twice)
    task_key: str  # "<dataset>/<task_id>"
    size: int  # samples of this prompt (GRPO group size)


@dataclass(frozen=True)
class RoundPlan:
    round: int  # 1-based
    groups: tuple[GroupSpec, ...]
    save_checkpoint: bool = False
    # its trajectories go to the run directory's journal as they end (rl/journal.py): a checkpoint precedes
    # the round, so a resume from that checkpoint replays them
    journal: bool = False

    @property
    def num_trajectories(self) -> int:
        return sum(g.size for g in self.groups)

    def group_sizes(self) -> dict[str, int]:
        return {g.group_id: g.size for g in self.groups}


@dataclass
class TrajectoryDone:
    """A finished trajectory with its reward. GRPO: the learner's item. OPD: ends the trajectory
    (its turns came before, as TurnScored); the teacher fills rollout.teacher_logprobs."""

    round: int
    policy_version: int  # the weights that generated it
    rollout: Rollout
    task_key: str
    exit_reason: str
    num_turns: int
    finished_at: float  # when it left the rollout process (GRPO) or the teacher (OPD)
    tool_s: float = 0.0  # real tool time
    injected_s: float = 0.0  # injected tool latency
    tool_call_errors: tuple[str, ...] = ()  # the kind of each turn whose tool call could not run (agent/toolcalls.py)


@dataclass
class TurnClosed:
    """OPD, rollout -> teacher: model turn `turn` just closed; the token prefix up to its end."""

    round: int
    policy_version: int
    group_id: str
    sample_index: int
    turn: int
    input_ids: list[int]  # prefix: input_ids[:end of this turn]
    loss_mask: list[int]
    turn_spans: list[tuple[int, int]]  # spans of turns 0..turn
    closed_at: float
    # no model turn follows (the turn submitted, or it was rollout.max_turns' last): the learner may take the
    # trajectory's turns as complete now, before its reward. False where the end is learned later (a token or
    # wall-clock limit, a submit seen in a tool's output): the TrajectoryDone then says it.
    last: bool = False


@dataclass
class TurnScored:
    """OPD, teacher -> learner: one teacher-scored turn, the learner's item.

    `rollout` is the trajectory so far (input_ids up to the turn's end) with teacher_logprobs
    aligned. Its turn_spans end with an empty placeholder span [end, end) standing for the turns
    still to come: StreamLearner.on_turn ends a trajectory when it has seen len(turn_spans) turns.
    A turn known to be the last (TurnClosed.last) has no placeholder, so its trajectory's turns are
    complete at its scores, before the reward; otherwise the end comes with TrajectoryDone.
    """

    round: int
    policy_version: int
    rollout: Rollout
    turn: int
    closed_at: float  # turn close in the rollout process
    finished_at: float  # scores ready (arrival at the learner's queue)
    teacher_start: float | None = None  # the teacher started scoring it (after waiting in the teacher's queue)
    last: bool = False  # TurnClosed.last: the rollout has no placeholder span
