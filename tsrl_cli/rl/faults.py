"""Fault hooks for the tests that stop, kill or break a run on purpose: the one room that reads them.

Each hook is an environment variable, unset in every other use (then each function here does nothing):

  TSRL_HOLD_ROLLOUT_AT_ROUND=K:PATH       the rollout process, once it holds round K's weights and before
                                          its first trajectory, creates PATH and waits while PATH exists
  TSRL_HOLD_ROLLOUT_AFTER_TRAJECTORIES=K:N:PATH
                                          the same, once N trajectories of round K have ended (each in the
                                          journal and on its way to the learner); the hold stops the whole
                                          event loop, so a strike lands with exactly N of them done
  TSRL_FAIL_ENV_START=K:G:I               in round K the environment of sample I of the round's G-th group (0-based)
                                          fails to start, as a container that cannot be created would
  TSRL_HOLD_CHECKPOINT_AT_ROUND=K:SECONDS
                                          the learner (rank 0 of a group) sleeps SECONDS inside round K's
                                          checkpoint write, after the gathers and before optimizer.pt
  TSRL_BREAK_FOLD_AT_ROUND=K:drop|twice   in round K the first fold into the round buffer R of the step's
                                          round learner on each rank is dropped (or added twice): the
                                          exactness certificate must then stop the run in round K

A signal or kill then lands mid-round by construction, not by a poll that a loaded machine can make late
(tests/rl/test_faults.py, test_resume_mid_round.py, test_group.py, test_certificate.py); a held rollout or
checkpoint write is a wait the other learner ranks must survive (tests/rl/test_group_waits.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from tsrl_cli.errors import UsageError

HOLD_ENV = "TSRL_HOLD_ROLLOUT_AT_ROUND"
HOLD_AFTER_ENV = "TSRL_HOLD_ROLLOUT_AFTER_TRAJECTORIES"
HOLD_CHECKPOINT_ENV = "TSRL_HOLD_CHECKPOINT_AT_ROUND"
BREAK_FOLD_ENV = "TSRL_BREAK_FOLD_AT_ROUND"
FAIL_START_ENV = "TSRL_FAIL_ENV_START"
BREAKS = ("drop", "twice")


def _hold(env: str, at: tuple[int, ...], example: str) -> None:
    spec = os.environ.get(env)
    if not spec:
        return
    *numbers, path = spec.split(":", len(at))
    if not (len(numbers) == len(at) and all(n.isdigit() for n in numbers) and path):
        raise UsageError(f"{env}={spec!r}: expected {example}")
    if tuple(int(n) for n in numbers) == at:
        Path(path).touch()
        while os.path.exists(path):
            time.sleep(0.05)


def hold_if_asked(round_: int) -> None:
    """The rollout process at round `round_`'s start (HOLD_ENV)."""
    _hold(HOLD_ENV, (round_,), "ROUND:PATH, e.g. 2:/tmp/held")


def hold_after_if_asked(round_: int, ended: int) -> None:
    """The rollout process once `ended` trajectories of round `round_` have ended (HOLD_AFTER_ENV)."""
    _hold(HOLD_AFTER_ENV, (round_, ended), "ROUND:N:PATH, e.g. 3:3:PATH")


class InjectedStartFailure(RuntimeError):
    """FAIL_START_ENV: the environment start a test made fail."""


def fail_start_if_asked(round_: int, group_index: int, sample: int) -> None:
    """Raise InjectedStartFailure where FAIL_START_ENV names this (round, group, sample)."""
    spec = os.environ.get(FAIL_START_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise UsageError(f"{FAIL_START_ENV}={spec!r}: expected ROUND:GROUP:SAMPLE, e.g. 1:0:3")
    if tuple(int(p) for p in parts) == (round_, group_index, sample):
        raise InjectedStartFailure(f"injected container-start failure (round {round_}, group {group_index}, "
                                   f"sample {sample})")


def hold_checkpoint_if_asked(round_: int) -> None:
    """The checkpoint writer (the learner, rank 0 of a group) inside round `round_`'s write (HOLD_CHECKPOINT_ENV)."""
    spec = os.environ.get(HOLD_CHECKPOINT_ENV)
    if not spec:
        return
    k, _, seconds = spec.partition(":")
    try:
        wait = float(seconds)
    except ValueError:
        wait = -1.0
    if not (k.isdigit() and wait >= 0):
        raise UsageError(f"{HOLD_CHECKPOINT_ENV}={spec!r}: expected ROUND:SECONDS, e.g. 1:8")
    if int(k) == round_:
        time.sleep(wait)


Fold = Callable[[tuple, list], None]


def fold_fault(round_: int) -> Callable[[Fold], Fold] | None:
    """BREAK_FOLD_ENV for round `round_`: a wrapper of the round learner's fold that drops (or doubles) its first
    fold into R, or None. A fold into R carries a known scalar: with an entropy term its gradient is never zero,
    whatever the rewards."""
    spec = os.environ.get(BREAK_FOLD_ENV)
    if not spec:
        return None
    k, _, how = spec.partition(":")
    if not (k.isdigit() and how in BREAKS):
        raise UsageError(f"{BREAK_FOLD_ENV}={spec!r}: expected ROUND:drop or ROUND:twice, e.g. 2:drop")
    if int(k) != round_:
        return None

    def wrap(fold: Fold) -> Fold:
        broken: list = []

        def faulty(target: tuple, grads: list) -> None:
            if not broken and target[0] == "round":
                broken.append(target)
                if how == "drop":
                    return
                fold(target, grads)
            fold(target, grads)

        return faulty

    return wrap
