"""The exactness certificate of a training run (`run.verify_every: K`, docs/streaming.md).

After every K-th round, before the optimizer step, the learner computes the round's gradient a
second time from the same trajectories and the same weights, by the other decomposition, and
compares the two with core.graddiff.compare (the measure `tsrl verify` prints):

    the step's gradient (schedule)         recomputed as                     agreement shows
    stream: the streamed sums              the lazy padded batch (sync's)    streaming changed nothing
    sync / async, sync_batching per_item   the lazy padded batch             the same, after the last arrival
    sync / async, sync_batching padded     per item, in arrival order        streaming these items gives this step

verify_rel_diff = max |lazy - other| / max |lazy| over every element of the gradient (LoRA: the
adapters); on a learner group each rank compares its own shards and the maxima are reduced over
ranks. Above the tolerance (run.verify_tol, else the model dtype's default) the run stops with exit
1 before the step, so a wrong gradient is never applied.

The recomputation has an engine of its own (rl/learner.StreamLearner), so the step's gradient is
untouched: the extra memory is one gradient-sized buffer set (its round buffer R, in the buffers'
dtype, 1/N of the trainable parameters per rank), plus, for the per-item recomputation, the open
groups' buffers that stream would hold. Its seconds (verify_s) fall inside the round's step span
(stream) or batch span (sync, async), so learner_busy_s includes them.
"""

from __future__ import annotations

import os
import time

from tsrl_cli.core.graddiff import combine, compare, tolerance
from tsrl_cli.errors import OperationFailed, UsageError
from tsrl_cli.policy import TORCH_DTYPES
from tsrl_cli.rl.learner import StreamLearner
from tsrl_cli.rl.schedules import RoundWork, feed_complete
from tsrl_cli.rl.types import RoundPlan

now = time.monotonic

# Tests that break the streaming on purpose (tests/rl/test_certificate.py) set TSRL_BREAK_FOLD_AT_ROUND=K:drop
# (or K:twice): in round K the first fold into the round buffer R of the step's engine on each rank is dropped
# (or added twice). The certificate must then stop the run in round K. Unset in every other use.
BREAK_FOLD_ENV = "TSRL_BREAK_FOLD_AT_ROUND"
BREAKS = ("drop", "twice")


class CertificateFailed(OperationFailed):
    """The round's gradient and its recomputation differ by more than run.verify_tol (exit 1)."""


def due(cfg, round_: int) -> bool:
    return cfg.run.verify_every > 0 and round_ % cfg.run.verify_every == 0


def tolerance_of(cfg) -> float:
    """run.verify_tol, else tsrl verify's tolerance for the model's dtype (bf16 buffers: bf16's)."""
    if cfg.run.verify_tol is not None:
        return cfg.run.verify_tol
    return tolerance(TORCH_DTYPES[cfg.model.dtype], bf16_buffers=cfg.loss.buffer_dtype == "bfloat16")


def step_is_padded(cfg) -> bool:
    """Whether the step's own gradient is the lazy padded batch (then the certificate streams per item)."""
    return cfg.schedule != "stream" and cfg.sync_batching == "padded"


def certify(learner, plan: RoundPlan, work: RoundWork, sl: StreamLearner, grads: list) -> dict:
    """Recompute round `plan.round`'s gradient the other way and compare it with `grads`, the step's
    (per parameter, or this rank's shards on a group; not modified). Every rank of a group calls this.
    Returns {"verify_rel_diff", "verify_s"}; raises CertificateFailed above the tolerance."""
    t0 = now()
    cfg = learner.cfg
    padded_step = step_is_padded(cfg)
    other = learner.engine(plan, recompute=True, token_weights=sl.token_weights,
                           max_items=1 if padded_step else None)
    # per item: the round's arrival order (groups open and close as they did); padded: key order, as sync
    rollouts = work.rollouts if padded_step else sorted(work.rollouts, key=lambda r: r.key)
    feed_complete(other, rollouts, per_item=padded_step)
    again = other.close_round()  # never handed to FSDP: the step's gradient stays where it is
    lazy, candidate = (grads, again) if padded_step else (again, grads)
    if learner.group is None:
        names = [n for n, p in learner.model.named_parameters() if p.requires_grad]
        cmp = compare(names, lazy, candidate)
    else:  # each rank's shards (FSDP's flat unit layout, padding rows zero on both sides)
        names = [f"FSDP unit {i}, rank {learner.rank}'s shard" for i in range(len(lazy))]
        parts = learner.group.gather(compare(names, lazy, candidate))
        cmp = learner.group.broadcast(combine(parts) if parts is not None else None)
    del again, other
    rel, tol = cmp["max_rel_diff"], tolerance_of(cfg)
    if not rel <= tol:  # NaN fails too
        what = "per-item streamed" if padded_step else ("streamed" if cfg.schedule == "stream" else "per-item")
        raise CertificateFailed(
            f"round {plan.round}: exactness certificate failed: the {what} gradient differs from the lazy one by "
            f"{rel:.3e} (max |difference| / max |lazy|), above run.verify_tol {tol:.1e}; worst {cmp['worst_param']} "
            f"({cmp['worst_param_rel_diff']:.3e}); the step was not taken")
    return {"verify_rel_diff": rel, "verify_s": now() - t0}


def break_fold_if_asked(sl: StreamLearner, round_: int) -> None:
    """The test fault of BREAK_FOLD_ENV: in round K, engine `sl`'s first fold into R dropped or added twice.
    (A fold into R carries a known scalar: with an entropy term its gradient is never zero, whatever the rewards.)"""
    spec = os.environ.get(BREAK_FOLD_ENV)
    if not spec:
        return
    k, _, how = spec.partition(":")
    if not (k.isdigit() and how in BREAKS):
        raise UsageError(f"{BREAK_FOLD_ENV}={spec!r}: expected ROUND:drop or ROUND:twice, e.g. 2:drop")
    if int(k) != round_:
        return
    apply, broken = sl._apply, []

    def faulty(fold, grads):
        if not broken and fold[0] == "round":
            broken.append(fold)
            if how == "drop":
                return
            apply(fold, grads)
        apply(fold, grads)

    sl._apply = faulty
