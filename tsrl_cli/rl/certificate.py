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

The recomputation has a round learner of its own (rl/learner.StreamLearner), so the step's gradient is
untouched: the extra memory is one gradient-sized buffer set (its round buffer R, in the buffers'
dtype, 1/N of the trainable parameters per rank), plus, for the per-item recomputation, the open
groups' buffers that stream would hold. Its seconds (verify_s) fall inside the round's step span
(stream) or batch span (sync, async), so learner_busy_s includes them.
"""

from __future__ import annotations

import time

from tsrl_cli.core.graddiff import tolerance
from tsrl_cli.errors import OperationFailed
from tsrl_cli.policy import TORCH_DTYPES
from tsrl_cli.rl.faults import BREAK_FOLD_ENV  # noqa: F401 - the hook the certificate tests set
from tsrl_cli.rl.learner import StreamLearner
from tsrl_cli.rl.reports import Certificate
from tsrl_cli.rl.schedules import RoundWork, feed_complete
from tsrl_cli.rl.types import RoundPlan

now = time.monotonic

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


def certify(learner, plan: RoundPlan, work: RoundWork, sl: StreamLearner, grads: list) -> Certificate:
    """Recompute round `plan.round`'s gradient the other way and compare it with `grads`, the step's
    (per parameter, or this rank's shards on a group; not modified). Every rank of a group calls this.
    Returns the Certificate (verify_rel_diff, verify_s); raises CertificateFailed above the tolerance."""
    t0 = now()
    cfg = learner.cfg
    padded_step = step_is_padded(cfg)
    other = learner.round_learner(plan, recompute=True, token_weights=sl.token_weights,
                           max_items=1 if padded_step else None)
    # per item: the round's arrival order (groups open and close as they did); padded: key order, as sync
    rollouts = work.rollouts if padded_step else sorted(work.rollouts, key=lambda r: r.key)
    feed_complete(other, rollouts, per_item=padded_step)
    again = other.close_round()  # never handed to FSDP: the step's gradient stays where it is
    lazy, candidate = (grads, again) if padded_step else (again, grads)
    cmp = learner.ranks.compare(learner.policy, lazy, candidate)  # a group: each rank its shards, maxima reduced
    del again, other
    rel, tol = cmp["max_rel_diff"], tolerance_of(cfg)
    if not rel <= tol:  # NaN fails too
        what = "per-item streamed" if padded_step else ("streamed" if cfg.schedule == "stream" else "per-item")
        raise CertificateFailed(
            f"round {plan.round}: exactness certificate failed: the {what} gradient differs from the lazy one by "
            f"{rel:.3e} (max |difference| / max |lazy|), above run.verify_tol {tol:.1e}; worst {cmp['worst_param']} "
            f"({cmp['worst_param_rel_diff']:.3e}); the step was not taken")
    return Certificate(verify_rel_diff=rel, verify_s=now() - t0)
