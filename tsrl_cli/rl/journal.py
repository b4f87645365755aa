"""The trajectory journal: every trajectory of a round durable the moment it ends, so that a run killed in
the middle of that round resumes it instead of generating it again (docs/run-directory.md).

    journal/round-<k>.jsonl   one row per ended trajectory of round k, appended and fsynced by the rollout
                              process (RunLog.append, durable) before the trajectory leaves for the learner

A row is the trajectory's rollout record (tsrl_cli/rollouts.py: group_id, sample_index, input_ids,
loss_mask, turn_spans, behavior_logprobs, reward) plus `round`, `policy_version` (the weights that
generated it), `task_key`, `exit_reason`, `num_turns`, `tool_s` and `injected_s` (the round's metrics
read them). JSON floats round-trip exactly, so a replayed trajectory is the generated one, bit for bit.

Which rounds: those right after a checkpoint (RoundPlan.journal). `tsrl train --resume` starts from the
last checkpoint k, and round k+1 alone is replayed: its trajectories came from checkpoint k's weights,
which the resumed run holds (under `async`, from one of the max_staleness versions before, as in the
uninterrupted round). A later round's came from weights the resume recomputes, so it is generated again.
With `--save-every K` that is every K-th round, and the orchestrator removes a round's journal once a
checkpoint covers it: on disk, at most the trajectories of the round being generated.

OPD: the teacher's scores are not journaled but computed again. A replayed trajectory goes to the
teacher as its closed turns, then its end, exactly as it did when generated (closed_turns). The teacher
is a fixed model whose log-probs are a function of the token ids (the same forwards over the same
tokens, per trajectory, give the same numbers), one forward over the trajectory costs little beside its
rollout, and the journal keeps one writer that writes the moment a trajectory ends, before any score of
its last turn exists in another process.
"""

from __future__ import annotations

from tsrl_cli.errors import UsageError
from tsrl_cli.rl.runlog import RunLog
from tsrl_cli.rl.types import RoundPlan, TrajectoryDone, TurnClosed
from tsrl_cli.rollouts import parse_rollout

# the fields beside the rollout record, with their JSON types
META = {"round": int, "policy_version": int, "task_key": str, "exit_reason": str, "num_turns": int,
        "tool_s": float, "injected_s": float}
_WHAT = {int: "an integer", float: "a number", str: "a string"}


def journal_row(msg: TrajectoryDone) -> dict:
    return {"round": msg.round, "policy_version": msg.policy_version, "task_key": msg.task_key,
            "exit_reason": msg.exit_reason, "num_turns": msg.num_turns, "tool_s": msg.tool_s,
            "injected_s": msg.injected_s, **msg.rollout.to_json()}


def _is(value, kind) -> bool:
    if kind is int:
        return type(value) is int
    if kind is float:
        return type(value) in (int, float)
    return isinstance(value, str)


def trajectory_of(row: dict, where: str) -> TrajectoryDone:
    """A journal row as the message the rollout process sent; finished_at is set when it is sent again."""
    for key, kind in META.items():
        if not _is(row.get(key), kind):
            raise UsageError(f"{where}: field {key!r} must be {_WHAT[kind]}, got {row.get(key)!r}; a journal row is "
                             "what the rollout process wrote (rl/journal.py): repair it, or delete the file")
    rollout = parse_rollout({k: v for k, v in row.items() if k not in META}, where)
    return TrajectoryDone(row["round"], row["policy_version"], rollout, row["task_key"], row["exit_reason"],
                          row["num_turns"], 0.0, float(row["tool_s"]), float(row["injected_s"]))


def replay_of(run: RunLog, plan: RoundPlan, version: int, max_staleness: int) -> list[TrajectoryDone]:
    """Resume from the checkpoint of policy version `version` (its round): the journal's trajectories of
    plan.round, the round after it, each checked against the plan; every other round's journal is removed
    and a torn last line (a trajectory cut mid-write) is left out, so that trajectory is generated again.
    max_staleness: 0 under sync and stream, async's bound under async."""
    got = run.keep_journal_of(plan.round)
    tasks = {g.group_id: g for g in plan.groups}
    fix = f"delete {got.path} to generate round {plan.round} again"
    out: dict[tuple[str, int], TrajectoryDone] = {}
    for n, row in got.numbered():
        where = f"{got.path}:{n}"
        msg = trajectory_of(row, where)
        gid, i = key = msg.rollout.key
        g = tasks.get(gid)
        if msg.round != plan.round or g is None or g.task_key != msg.task_key or not i < g.size:
            raise UsageError(f"{where}: trajectory {gid}/{i} (task {msg.task_key}, round {msg.round}) is not in "
                             f"round {plan.round}'s plan; {fix}")
        if key in out:
            raise UsageError(f"{where}: trajectory {gid}/{i} is in the journal twice; {fix}")
        if not version - max_staleness <= msg.policy_version <= version:
            allowed = f"{version}" if not max_staleness else f"{version - max_staleness}..{version}"
            raise UsageError(f"{where}: trajectory {gid}/{i} was generated by policy version {msg.policy_version}, "
                             f"but a resume from checkpoint round-{version} replays versions {allowed} only; {fix}")
        out[key] = msg
    return list(out.values())


def closed_turns(msg: TrajectoryDone, at: float) -> list[TurnClosed]:
    """OPD: a replayed trajectory's turns as the rollout process sent them to the teacher when each closed
    (turn k: the tokens up to its end, the spans of turns 0..k), stamped `at`. Its last turn is marked last
    whatever ended it: the trajectory is complete."""
    r = msg.rollout
    n = len(r.turn_spans)
    return [TurnClosed(msg.round, msg.policy_version, r.group_id, r.sample_index, k, r.input_ids[:e],
                       r.loss_mask[:e], list(r.turn_spans[:k + 1]), at, k == n - 1)
            for k, (_, e) in enumerate(r.turn_spans)]


class Journal:
    """The rollout process's writer: each trajectory of a journaled round, fsynced before it leaves."""

    def __init__(self, run_dir: str):
        self.run = RunLog(run_dir)

    def write(self, msg: TrajectoryDone) -> None:
        self.run.append(self.run.journal_name(msg.round), [journal_row(msg)], durable=True)
