"""The streaming core as a library: the contract a trainer keeps to stream one round's gradient exactly.

    rnd = StreamingRound(params, estimator="group", std="unbiased")
    rnd.open_group(gid, size)                       a prompt's group: `size` members will close
    rnd.close_trajectory(gid, reward, loss=...)     a member is final, its reward known: its backward now
    rnd.mask_trajectory(gid)                        a member lost to its infrastructure: out of the group's statistics
    rnd.close_group(gid)                            every member closed: the advantages join the round's sum
    rnd.append_turn(unit, loss=...)                 OPD: a turn's backward; rnd.close_unit(unit, scale) at its end
    rnd.assert_safe_to_step()                       nothing open, the parameters unchanged since the round opened
    grads = rnd.finish(round_scale)                 Z * R, one tensor per parameter

A member's `loss` is its policy-gradient surrogate with advantage 1, e.g. -(logp_T * mask_T).sum() times
its per-sequence weight (the gradient of -ratio at ratio 1 is -grad logp); the group's advantages join at
close_group (core/accumulator.py, the two forms). `add(loss=..., scale=...)` takes any term whose scalar is
known now (a KL or entropy term, a member of a closed group with its advantage). The learner of `tsrl
train` (rl/learner.py) keeps the same contract with micro-batched gradients (`add_members`).

Safety rails, all raised (StreamingContractError subclasses), never repaired: a step while a group or
unit is open, a second close of a trajectory or group, a group closed before its members, a member for an
unknown or closed group, and parameters that changed in place between the round's start and its use
(an optimizer step inside the round would make the partial sums belong to two policies).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from tsrl_cli.core.accumulator import RoundGradAccumulator, Targets, fold_into
from tsrl_cli.core.advantages import ADVANTAGES, GRPO_EPS, STD_KINDS, Estimator, GroupStats

BUFFER_FORMS = ("auto", "affine", "buckets")


class StreamingContractError(RuntimeError):
    """A call out of the streaming contract's order: the round's gradient would no longer be exact."""


class GroupStillOpen(StreamingContractError):
    """An optimizer step (or finish) while a group or an OPD unit is open."""


class DoubleClose(StreamingContractError):
    """A trajectory or a group closed twice (or a group opened twice)."""


class GroupIncomplete(StreamingContractError):
    """close_group before every declared member closed."""


class UnknownGroup(StreamingContractError):
    """A member for a group that was never opened, is already closed, or already has all its members."""


class ParametersChanged(StreamingContractError):
    """A parameter changed in place after the round opened (e.g. an optimizer step mid-round)."""


class NotStreamable(StreamingContractError, ValueError):
    """An estimator whose advantage is not a function of the member's reward and its group's rewards,
    or an affine form asked of an estimator that has none."""


def resolve_estimator(estimator: str | Estimator, buffers: str = "auto") -> tuple[Estimator, str]:
    """(estimator, buffer form) or NotStreamable before any work. A name is a core.advantages.ADVANTAGES key;
    an Estimator is group-wise by construction (advantages from the group's rewards only)."""
    if isinstance(estimator, str):
        if estimator not in ADVANTAGES:
            raise NotStreamable(f"advantage estimator {estimator!r} is unknown; use one of {', '.join(ADVANTAGES)}, "
                                "or pass an Estimator (advantages from the group's rewards)")
        estimator = ADVANTAGES[estimator]
    if not isinstance(estimator, Estimator):
        raise NotStreamable(f"{estimator!r} is not an Estimator: streaming is exact for group-wise estimators, whose "
                            "advantage depends on a member only through its reward and its group's rewards")
    if buffers not in BUFFER_FORMS:
        raise NotStreamable(f"buffer form {buffers!r} is unknown; use one of {', '.join(BUFFER_FORMS)}")
    if buffers == "affine" and estimator.stats is None:
        raise NotStreamable("this estimator has no affine form A = (r - mean) * scale: stream it in reward-value "
                            "buckets (buffers='buckets' or 'auto')")
    form = buffers if buffers != "auto" else ("affine" if estimator.stats is not None else "buckets")
    return estimator, form


class _Group:
    def __init__(self, size: int):
        self.size = size
        self.rewards: list[float] = []  # the valid members' rewards
        self.masked = 0  # members lost to their infrastructure (mask_trajectory)
        self.ids: set = set()

    @property
    def closed(self) -> int:
        return len(self.rewards) + self.masked


class StreamingRound:
    """One round's exact gradient over `params` (or any tensors `grads` are aligned with), streamed.

    estimator: a core.advantages name (group, center, rloo) or an Estimator; std: unbiased | population (the
    `group` estimator's std); buffers: auto (affine where the estimator has that form, else reward-value
    buckets) | affine | buckets. dtype / device / fold / sync: the accumulator's (core/accumulator.py).
    watch: tensors whose in-place changes are refused (default: params; None for none).
    """

    def __init__(self, params: Sequence[torch.Tensor], *, estimator: str | Estimator = "group",
                 std: str = "unbiased", eps: float = GRPO_EPS, buffers: str = "auto",
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 fold: Callable[[Targets, Sequence], None] = fold_into, sync: Callable[[], None] = lambda: None,
                 watch: Sequence[torch.Tensor] | None | str = "params"):
        if std not in STD_KINDS:
            raise NotStreamable(f"std {std!r} is unknown; use one of {', '.join(STD_KINDS)}")
        self.estimator, self.form = resolve_estimator(estimator, buffers)
        self.std, self.eps = std, eps
        self.params = list(params)
        self.acc = RoundGradAccumulator(self.params, dtype=dtype, device=device, fold=fold, sync=sync)
        watched = self.params if watch == "params" else list(watch or [])
        self._watched = [(t, t._version) for t in watched]
        self._groups: dict[Hashable, _Group] = {}
        self._closed: set = set()
        self._units: set = set()
        self.stats: dict[Hashable, object] = {}  # closed groups: their GroupStats (affine) or {reward: A}

    # ---- the contract ----------------------------------------------------------------------------
    def open_group(self, group_id: Hashable, size: int) -> None:
        if group_id in self._groups or group_id in self._closed:
            raise DoubleClose(f"group {group_id!r} was already opened")
        if size < 1:
            raise ValueError(f"group {group_id!r}: size {size} must be >= 1")
        self._groups[group_id] = _Group(size)

    def close_trajectory(self, group_id: Hashable, reward: float, *, loss: torch.Tensor | None = None,
                         grads: Sequence[torch.Tensor | None] | None = None, trajectory_id: Hashable = None) -> None:
        """Member `trajectory_id` of `group_id` is final with `reward`; its gradient (of `loss`, or `grads`) is
        folded now. Without either, only its reward is recorded (its gradient comes later, by add_members, or
        into R with its advantage once the group closed)."""
        g = self._admit(group_id, trajectory_id)
        g.rewards.append(float(reward))
        if loss is not None or grads is not None:
            self.add_members(group_id, reward, self._grads(loss, grads))

    def mask_trajectory(self, group_id: Hashable, trajectory_id: Hashable = None) -> None:
        """Member `trajectory_id` of `group_id` failed for its infrastructure (a sandbox that did not start, an
        engine that failed), not the agent: it counts toward the group's declared members, but neither its
        reward nor its gradient enters the group. A group left with fewer than two valid members by masking
        contributes nothing (its advantages are 0): one sample against no baseline would be pushed by its raw
        reward, a bias the failure introduced."""
        self._admit(group_id, trajectory_id).masked += 1

    def _admit(self, group_id: Hashable, trajectory_id: Hashable) -> _Group:
        g = self._member_group(group_id)
        if trajectory_id is not None:
            if trajectory_id in g.ids:
                raise DoubleClose(f"group {group_id!r}: trajectory {trajectory_id!r} was already closed")
            g.ids.add(trajectory_id)
        if g.closed >= g.size:
            raise UnknownGroup(f"group {group_id!r} already has its {g.size} declared members")
        return g

    def add_members(self, group_id: Hashable, reward: float, grads: Sequence[torch.Tensor | None]) -> None:
        """The summed gradient (advantage 1) of members of an open group that share `reward`."""
        self._member_group(group_id)
        self._check_params()
        if self.form == "affine":
            self.acc.add_member(group_id, reward, grads, self.estimator.scale_at_close)
        else:
            self.acc.add_to_bucket(group_id, reward, grads)

    def close_group(self, group_id: Hashable):
        """Every member closed: fold the group's buffers into R with its advantages; returns its statistics
        (GroupStats for the affine form, else {reward: advantage})."""
        if group_id in self._closed:
            raise DoubleClose(f"group {group_id!r} was already closed")
        g = self._groups.get(group_id)
        if g is None:
            raise UnknownGroup(f"group {group_id!r} was never opened")
        if g.closed < g.size:
            raise GroupIncomplete(f"group {group_id!r}: {g.closed} of {g.size} members closed")
        self._check_params()
        rewards = torch.tensor(g.rewards, dtype=torch.float64)
        void = g.masked and len(g.rewards) < 2  # masking left no baseline: the group contributes nothing
        if self.form == "affine":
            # void: mean at the lone valid reward, so every member's A = 0 (with scale 1 where the scale is known at
            # arrival: Dr. GRPO's members folded (r - b) into R already, which this close cancels exactly)
            stats = (GroupStats(g.rewards[0] if g.rewards else 0.0, 0.0, 0.0 if self.estimator.scale_at_close else 1.0,
                                len(g.rewards)) if void else self.estimator.stats(rewards, self.eps, self.std))
            if self.acc.holds(group_id):
                self.acc.close_group(group_id, stats)
        else:
            stats = {float(v): 0.0 for v in g.rewards} if void else self.estimator.advantage_of(rewards, self.eps,
                                                                                                 self.std)
            self.acc.close_buckets(group_id, stats)
        del self._groups[group_id]
        self._closed.add(group_id)
        self.stats[group_id] = stats
        return stats

    def advantage(self, group_id: Hashable, reward: float) -> float:
        """A closed group's advantage of `reward` (what a later member of it is weighted by in R)."""
        stats = self.stats[group_id]
        return stats.advantage(reward) if hasattr(stats, "advantage") else stats[float(reward)]

    def append_turn(self, unit_id: Hashable, *, loss: torch.Tensor | None = None,
                    grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """OPD: a turn whose per-trajectory scalar (1/n_i) waits for the trajectory's end: into its unit buffer."""
        self._check_params()
        self._units.add(unit_id)
        self.acc.add_to_unit(unit_id, self._grads(loss, grads))

    def close_unit(self, unit_id: Hashable, scale: float) -> None:
        """OPD trajectory end: R += scale * S_u."""
        self._check_params()
        self._units.discard(unit_id)
        self.acc.close_unit(unit_id, scale)

    def add(self, *, loss: torch.Tensor | None = None, grads: Sequence[torch.Tensor | None] | None = None,
            scale: float = 1.0) -> None:
        """R += scale * gradient: a term whose scalar is known now."""
        self._check_params()
        self.acc.add(self._grads(loss, grads), scale)

    def assert_safe_to_step(self) -> None:
        """Raises unless every group and unit is closed and no watched tensor changed since the round opened."""
        if self._groups or self._units:
            raise GroupStillOpen(f"{len(self._groups)} group(s) ({', '.join(map(repr, list(self._groups)[:3]))}) and "
                                 f"{len(self._units)} unit(s) are still open: close them before the optimizer step")
        self._check_params()

    def finish(self, round_scale: float = 1.0) -> list[torch.Tensor]:
        """Z * R, one tensor per parameter in the buffer dtype (assert_safe_to_step first)."""
        self.assert_safe_to_step()
        return self.acc.finalize(round_scale)

    # ---- helpers ---------------------------------------------------------------------------------
    @property
    def open_groups(self) -> int:
        return len(self._groups)

    def is_open(self, group_id: Hashable) -> bool:
        return group_id in self._groups

    def members(self, group_id: Hashable) -> int:
        """Members of an open group closed so far (masked ones included)."""
        return self._groups[group_id].closed

    def _member_group(self, group_id: Hashable) -> _Group:
        if group_id in self._closed:
            raise UnknownGroup(f"group {group_id!r} is closed: a member after its close would miss its advantage")
        g = self._groups.get(group_id)
        if g is None:
            raise UnknownGroup(f"group {group_id!r} was never opened (open_group(group_id, size) first)")
        return g

    def _grads(self, loss, grads) -> list:
        if (loss is None) == (grads is None):
            raise ValueError("give one of loss= or grads=")
        if grads is not None:
            return list(grads)
        return list(torch.autograd.grad(loss, self.params, allow_unused=True))

    def _check_params(self) -> None:
        for t, v in self._watched:
            if t._version != v:
                raise ParametersChanged(f"a parameter of shape {tuple(t.shape)} changed in place since the round "
                                        "opened (an optimizer step mid-round?): the round's sums would mix policies")
