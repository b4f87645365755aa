"""The learner process (or each rank of a learner group): the model being trained, its optimizer, one step per round.

    for each round:
        work = SCHEDULES[schedule](learner, plan)   # sync | stream | async: the round's gradient
        optimizer step (grad clip), version += 1
        publish the weights: the rollout side takes them over the weight bus (rl/weightbus.py)
        checkpoint when the plan says so

On a group of N ranks (rl/group.py) every rank runs this loop; rank 0 alone reads the arrivals
(and broadcasts them), publishes, writes checkpoints and reports. Parameters, gradients, the
optimizer state and the streaming buffers are sharded; rank 0 publishes the gathered weights and keeps a
host copy of the policy, refreshed from the shards for each checkpoint it writes.
The reference model for a KL term is the initial policy (frozen), sharded like the policy.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import learner_devices
from tsrl_cli.policy import param_bytes, save_policy
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
)
from tsrl_cli.rl.certificate import certify, due
from tsrl_cli.rl.faults import fold_fault, hold_checkpoint_if_asked
from tsrl_cli.rl.group import LearnerGroup
from tsrl_cli.rl.learner import Objective, StreamLearner, packs
from tsrl_cli.rl.masters import master_dtype
from tsrl_cli.rl.placement import Placement
from tsrl_cli.rl.ranks import LearnerRanks, ranks_of
from tsrl_cli.rl.reports import LearnerReport, PerRank, Published, RankFigures, Report, Span
from tsrl_cli.rl.schedules import SCHEDULES, RoundWork
from tsrl_cli.rl.types import RoundPlan
from tsrl_cli.rl.weightbus import Bus, Publisher
from tsrl_cli.rollouts import Rollout
from tsrl_cli.rundir import CHECKPOINT_STATE, RunDir

now = time.monotonic


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)


class Learner:
    def __init__(self, cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, run_dir: str,
                 inbox, want_q, report_q, ranks: LearnerRanks | None = None, device: str | None = None,
                 bus: Bus | None = None):
        self.cfg, self.inbox, self.report_q = cfg, inbox, report_q
        self.run_dir = Path(run_dir)
        self.ranks = ranks if ranks is not None else ranks_of(None)
        self.rank, self.world = self.ranks.rank, self.ranks.world
        self.device = device or learner_devices(cfg)[0]
        self.master_dtype = master_dtype(cfg)  # None: the optimizer steps the parameters in their own dtype
        load = {"dtype": cfg.model.dtype, "lora": cfg.lora, "seed": cfg.seed, "base": policy_dir}
        self.policy = self.ranks.load(init_dir, load, self.device, cfg.learner.activation_checkpointing,
                                      self.master_dtype)
        self.model, self.tok = self.policy.model, self.policy.tokenizer
        self.params, self.opt_params, self.masters = self.policy.params, self.policy.opt_params, self.policy.masters
        self.model_bytes = param_bytes(self.policy.full) if self.ranks.leader else None
        self.trainable_bytes = param_bytes(self.policy.full, trainable_only=True) if self.ranks.leader else None
        self.obj = Objective(cfg.objective, cfg.loss)
        self.sync_batching, self.offpolicy = cfg.sync_batching, cfg.offpolicy  # what the schedules read
        self.opt = make_optimizer(self.opt_params, cfg)
        opt_state = Path(init_dir) / "optimizer.pt"
        if opt_state.is_file():  # resuming: the optimizer continues exactly where it stopped (on any N)
            # memory-mapped: a rank of a group reads only its own rows of each tensor, not the whole file
            sd = torch.load(opt_state, map_location="cpu", mmap=True, weights_only=True)
            self.ranks.load_optimizer(self.opt, sd, self.policy)
            del sd
        self.ref = None  # the reference model of a KL term: the initial policy, frozen (sharded like the policy)
        if cfg.loss.kl_coef:
            self.ref = self.ranks.load_reference(policy_dir, cfg.model.dtype, self.device)
        self.version = start_version
        self.publisher = None  # rank 0: the weight bus's sender (rank 0 of the bus)
        if self.rank == 0 and bus is not None:
            self.publisher = Publisher(bus.join(0, self.device), want_q, start_version, report_q,
                                       rejoin=lambda epoch, world: bus.join(0, self.device, epoch, world))
        if cfg.rollout.engine == "openai":  # remote servers start from the run's weights (a resume's too)
            self.publish()  # a collective on a group: every rank
        self._last_progress = 0.0
        # stream's micro-batching (learner.microbatch): auto = where a backward has a fixed cost to amortize
        mb = cfg.learner.microbatch
        self.microbatch = mb == "on" or (mb == "auto" and (self.world > 1 or self.device.startswith("cuda")))
        # OPD under auto without micro-batching (one CPU process): no padded batches across trajectories, but
        # a trajectory's turns queued together still share one row, whose longest prefix scores them all:
        # one prefix forward instead of one per turn (results/LOG.md, 2026-12-03)
        self.coalesce_turns = self.microbatch or (mb == "auto" and cfg.objective == "opd")
        self.packed = packs(cfg.learner.packing, self.device, self.model)

    # ---- what the schedules use ---------------------------------------------------------------
    def round_learner(self, plan: RoundPlan, *, recompute: bool = False, **kw) -> StreamLearner:
        """The round's learner (StreamLearner) on this rank (schedules choose when it runs). recompute: the
        exactness certificate's second engine (rl/certificate.py), which a test's fold fault never reaches."""
        lc = self.cfg.learner
        opts = {"max_tokens": lc.max_microbatch_tokens, "max_items": lc.max_microbatch_items if self.microbatch else 1,
                "ref_model": self.ref, "chunk_tokens": lc.logits_chunk_tokens, "opd_unit": lc.opd_unit,
                "granularity": lc.granularity, "packed": self.packed, "prefix_cut": lc.prefix_cut}
        opts.update(self.ranks.engine_options(), grads=self.policy.grads, **kw)
        return StreamLearner(self.model, self.obj, plan.group_sizes(), **opts,
                             fold_fault=None if recompute else fold_fault(plan.round))

    def receive(self, plan: RoundPlan, block: bool, limit: int | None = None) -> list:
        """The round's messages that have arrived (rank 0 reads the queue; a group broadcasts them).
        block: wait for at least one (nothing else to do); else only take what is there (at most `limit`)."""
        msgs = []
        if self.ranks.leader:
            if block:
                msgs.append(self.inbox.get())
            while limit is None or len(msgs) < limit:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for m in msgs:
                if m.round != plan.round:
                    raise RuntimeError(f"learner: a round {m.round} item arrived during round {plan.round}")
        return self.ranks.broadcast(msgs)

    def finish(self, sl: StreamLearner, plan: RoundPlan, work: RoundWork):
        """Round close: the gradient per parameter (one rank), or None on a group, where FSDP now holds
        the sharded p.grad of R. In a certified round (run.verify_every) the gradient is recomputed and
        compared first (rl/certificate.py): work.verify, or the run stops before the step."""
        grads = sl.close_round()
        if due(self.cfg, plan.round):
            work.verify = certify(self, plan, work, sl, grads)
        return self.ranks.hand_over(self.policy, grads, sl.zero_loss)

    def progress(self, round_: int, work: RoundWork) -> None:
        if self.rank != 0:
            return
        t = now()
        if t - self._last_progress > 0.2:  # a few messages per second at most
            self._last_progress = t
            self.report_q.put((Report.progress, "learner", {"round": round_, "busy_s": work.busy_s,
                                                            "items": len(work.items)}))

    # ---- step, weights, checkpoints -----------------------------------------------------------
    def apply_step(self, grads) -> float:
        """One optimizer step. grads None: p.grad is already set (the sharded gradient of a group)."""
        if grads is not None:  # with masters: the float32 sums reach the float32 masters unrounded
            for p, g in zip(self.opt_params, grads, strict=True):
                p.grad = None if g is None else g.to(p.dtype)
        present = [p.grad for p in self.opt_params if p.grad is not None]
        if self.cfg.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.opt_params, self.cfg.optim.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))
        if hasattr(norm, "full_tensor"):  # a group: the norm over every rank's shard
            norm = norm.full_tensor()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.copy_to_params()  # the forward, the engines and checkpoints: the masters' cast
        return float(norm)

    def trained_state(self) -> dict[str, torch.Tensor] | None:
        """The trained parameters by name, full, on the CPU (rank 0; a collective on a group)."""
        return self.ranks.trained_state(self.policy)

    def publish(self) -> Published:
        """Offer the new weights to the weight bus's publisher: the trained parameters only (every
        parameter, or the LoRA adapters), on the learner's device. On-policy schedules offer the live
        tensors (nothing trains until the rollout side has them); async offers a copy in the bus's buffers,
        since its next step may come first (a group gathers into them). The bytes are those one engine receives."""
        t0 = now()
        into = self.publisher.buffers if self.publisher is not None else None
        state = self.ranks.live_state(self.policy, copy=self.cfg.schedule == "async", into=into)
        if state is None:
            return Published(t0, now(), 0)
        self.publisher.offer(self.version, state, t0)
        return Published(t0, now(), sum(t.numel() * t.element_size() for t in state.values()))

    def save_checkpoint(self, round_: int) -> str | None:
        """checkpoints/round-<k>/: the policy (save_pretrained + tokenizer; with LoRA the merged model plus
        adapter/, which --resume loads), optimizer.pt and state.json, written atomically (policy.save_policy).
        optimizer.pt is the single-process format on any number of ranks, so a run resumes on any N.
        On a group the state is gathered to rank 0 alone, which writes; the other ranks wait for the write on
        the control group (no timeout, however long a write of the full state takes), not in a collective."""
        if self.world > 1:  # the leader's host copy, refreshed from the shards (a collective): what it writes
            self.trained_state()
        opt_state = self.ranks.optimizer_state(self.opt, self.policy, self.master_dtype is not None)
        path = self._write_checkpoint(round_, opt_state) if self.ranks.leader else None
        del opt_state
        self.ranks.barrier()
        return path

    def _write_checkpoint(self, round_: int, opt_state: dict) -> str:
        model = self.policy.full

        def extra(d: Path) -> None:
            hold_checkpoint_if_asked(round_)
            torch.save(opt_state, d / "optimizer.pt")
            (d / CHECKPOINT_STATE).write_text(json.dumps({"round": round_, "policy_version": self.version,
                                                           "schedule": self.cfg.schedule, "seed": self.cfg.seed,
                                                           "learner_ranks": self.world}))

        try:
            return str(save_policy(model, self.tok, RunDir(self.run_dir).checkpoint_path(round_), extra=extra))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise OSError(errno.ENOSPC, f"no space left on the disk of {self.run_dir} while writing checkpoint "
                                        f"round-{round_} (nothing of it was kept; the earlier checkpoints are intact): "
                                        "free space, then `tsrl train --resume`") from None

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, plans: list[RoundPlan], save_initial: bool) -> None:
        if save_initial:
            self.save_checkpoint(0)
        learn = SCHEDULES[self.cfg.schedule]
        for plan in plans:
            reset_peak_rss()
            reset_peak_device(self.device)
            work = learn(self, plan)
            grad_norm = self.apply_step(work.grads)
            step = Span(work.step_start, now())
            self.version += 1
            published = self.publish()
            ranks = self._per_rank(work)
            checkpoint = checkpoint_s = None
            if plan.save_checkpoint:
                t0 = now()
                checkpoint = self.save_checkpoint(plan.round)
                checkpoint_s = now() - t0
            if self.rank != 0:
                continue
            report = LearnerReport(
                version=self.version, items=work.items, group_close=work.group_close, batch=work.batch,
                trajectories=work.trajectories, last_arrival=work.last_arrival,
                busy_s=work.busy_s + (step.end - step.start), step=step, publish=published, grad_norm=grad_norm,
                model_bytes=self.model_bytes, trainable_bytes=self.trainable_bytes,
                opd_reverse_kl=_reverse_kl(work.rollouts), microbatches=work.microbatches, learners=self.world,
                work=work.work(), ranks=ranks, verify=work.verify, checkpoint=checkpoint, checkpoint_s=checkpoint_s)
            self.report_q.put((Report.learner_round, plan.round, report))

    def _per_rank(self, work: RoundWork) -> PerRank | None:
        """This round's per-rank figures, gathered on rank 0 (None elsewhere): peaks, buffer bytes, backward
        passes, loss."""
        mine = RankFigures(peak_rss=peak_rss_bytes(), peak_device=peak_device_bytes(self.device),
                           accumulator_peak_bytes=work.accumulator_peak_bytes,
                           accumulator_set_bytes=work.buffer_set_bytes, backwards=work.backwards, loss=work.loss)
        ranks = self.ranks.gather(mine)
        return None if ranks is None else PerRank.gathered(ranks)

    def close(self, serve_last_sync: bool = True) -> None:
        if self.publisher is not None and serve_last_sync:  # the rollout side may still take the last weights
            self.publisher.close()
        self.ranks.close()


def _reverse_kl(rollouts: list[Rollout]) -> float | None:
    """OPD: mean over loss tokens of log pi_student - log pi_teacher on the sampled tokens
    (student = the rollout engine's log-probs); None for GRPO."""
    tot, n = 0.0, 0
    for r in rollouts:
        if r.teacher_logprobs is None or r.behavior_logprobs is None:
            return None
        for m, b, t in zip(r.loss_mask, r.behavior_logprobs, r.teacher_logprobs, strict=False):
            if m:
                tot, n = tot + (b - t), n + 1
    return tot / n if n else None


@dataclass(frozen=True)
class LearnerArgs:
    """What learner rank `rank` of `world` starts from (rl/train.py Workers). Under torchrun the ranks other
    than 0 start from the config alone (for_torchrun_rank): the run's inputs reach them from rank 0."""

    cfg: TrainConfig
    placement: Placement
    rank: int = 0
    world: int = 1
    store: str | None = None  # the FileStore of ranks tsrl started; None under torchrun (env://)
    init_dir: str | None = None
    policy_dir: str | None = None
    start_version: int | None = None
    run_dir: str | None = None
    plans: list[RoundPlan] | None = None
    save_initial: bool | None = None
    inbox: object = None  # rank 0: trajectories (GRPO) or scored turns (OPD)
    want_q: object = None  # rank 0: the rollout side's sync requests
    report_q: object = None

    @classmethod
    def for_torchrun_rank(cls, cfg: TrainConfig, rank: int, world: int) -> LearnerArgs:
        return cls(cfg, Placement.of(cfg), rank, world)

    def run_inputs(self) -> tuple:
        return self.init_dir, self.policy_dir, self.start_version, self.run_dir, self.plans, self.save_initial


def learner_main(args: LearnerArgs) -> None:
    """One learner process: rank `args.rank` of `args.world`; rank 0 publishes over the placement's bus."""
    init_worker()
    cfg, rank, world = args.cfg, args.rank, args.world
    group = None
    local = rank
    inputs = args.run_inputs()
    if world > 1:
        if args.store is None:  # torchrun: this node's learner devices, indexed by LOCAL_RANK
            local = int(os.environ.get("LOCAL_RANK", rank))
        group = LearnerGroup.join(rank, world, args.placement.learner[local], args.store,
                                  cfg.learner.collective_timeout_s)
        if args.store is None:
            inputs = group.broadcast(inputs)
    init_dir, policy_dir, start_version, run_dir, plans, save_initial = inputs
    learner = Learner(cfg, init_dir, policy_dir, start_version, run_dir, args.inbox, args.want_q, args.report_q,
                      ranks_of(group), args.placement.learner[local], args.placement.bus if rank == 0 else None)
    if args.report_q is not None:
        args.report_q.put((Report.ready, "learner" if world == 1 else f"learner-{rank}", None))
    finished = False
    try:
        learner.run(plans, save_initial)
        finished = True
    finally:
        learner.close(serve_last_sync=finished)
