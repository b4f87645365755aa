"""The learner process (or each rank of a learner group): the model being trained, its optimizer, one step per round.

    for each round:
        work = SCHEDULES[schedule](learner, plan)   # sync | stream | async: the round's gradient
        optimizer step (grad clip), version += 1
        publish the weights: the rollout side takes them over the weight bus (rl/weightbus.py)
        checkpoint when the plan says so

On a group of N ranks (rl/group.py) every rank runs this loop; rank 0 alone reads the arrivals
(and broadcasts them), publishes, writes checkpoints and reports. Parameters, gradients, the
optimizer state and the streaming buffers are sharded; rank 0 keeps a host copy of the policy,
updated from the gathered weights each round, to publish and save it.
The reference model for a KL term is the initial policy (frozen), sharded like the policy.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import queue
import time
from pathlib import Path

import torch

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import learner_devices
from tsrl_cli.policy import checkpoint_activations, load_policy, param_bytes, save_policy, trainable_state
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
)
from tsrl_cli.rl.certificate import break_fold_if_asked, certify, due
from tsrl_cli.rl.group import LearnerGroup, ShardedGrads
from tsrl_cli.rl.learner import Objective, StreamLearner
from tsrl_cli.rl.masters import MASTER_KEY, MasterWeights, master_dtype, master_state, upcast_for_group
from tsrl_cli.rl.schedules import SCHEDULES, RoundWork
from tsrl_cli.rl.types import RoundPlan
from tsrl_cli.rl.weightbus import Publisher, join_bus
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
                 inbox, want_q, report_q, group: LearnerGroup | None = None, device: str | None = None,
                 bus_addr: tuple[str, int] | None = None):
        self.cfg, self.inbox, self.report_q = cfg, inbox, report_q
        self.run_dir = Path(run_dir)
        self.group = group
        self.rank, self.world = (group.rank, group.world) if group else (0, 1)
        self.device = device or learner_devices(cfg)[0]
        self.grads = self.host = None
        world, rank = self.world, self.rank
        load = {"dtype": cfg.model.dtype, "lora": cfg.lora, "seed": cfg.seed, "base": policy_dir}
        self.master_dtype = master_dtype(cfg)  # None: the optimizer steps the parameters in their own dtype
        if self.group is None:
            self.model, self.tok = load_policy(init_dir, device=self.device, **load)
            if cfg.learner.activation_checkpointing:
                checkpoint_activations(self.model)
        else:  # one rank at a time holds the whole model on the host, then keeps only its shard
            for r in range(world):
                if r == rank:
                    self.model, self.tok = load_policy(init_dir, device="cpu", **load)
                    if self.group.leader:
                        self.host = copy.deepcopy(self.model)  # publishing and checkpoints: the full policy
                    if cfg.learner.activation_checkpointing:
                        checkpoint_activations(self.model)  # inside each FSDP unit's hooks (policy.py)
                    compute = None  # with masters: the shards are float32, FSDP computes in the model's dtype
                    if self.master_dtype is not None:
                        compute = upcast_for_group([p for p in self.model.parameters() if p.requires_grad],
                                                   self.master_dtype)
                    self.grads = ShardedGrads(self.group, self.model)
                    self.group.shard(self.model, self.grads, compute_dtype=compute)
                self.group.barrier()
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        # one process with masters: the optimizer steps float32 copies; a group's shards are the masters
        self.masters = (MasterWeights(self.params, self.master_dtype)
                        if self.master_dtype is not None and self.group is None else None)
        self.opt_params = self.masters.tensors if self.masters is not None else self.params
        sizing = self.host if self.host is not None else self.model
        self.model_bytes = param_bytes(sizing) if self.group is None or self.group.leader else None
        self.trainable_bytes = param_bytes(sizing, trainable_only=True) if self.model_bytes is not None else None
        self.obj = Objective(cfg.objective, cfg.loss)
        self.opt = make_optimizer(self.opt_params, cfg)
        opt_state = Path(init_dir) / "optimizer.pt"
        if opt_state.is_file():  # resuming: the optimizer continues exactly where it stopped (on any N)
            sd = torch.load(opt_state, weights_only=True)
            masters = sd.pop(MASTER_KEY, None)  # the masters it stopped with (their cast is the checkpoint)
            if self.group is None:
                self.opt.load_state_dict(sd)
                if masters is not None:
                    with torch.no_grad():
                        for i, t in masters.items():
                            self.opt_params[int(i)].copy_(t)
                    if self.masters is not None:
                        self.masters.copy_to_params()
            else:
                self.group.load_optimizer_state(self.opt, sd, masters)
        self.ref = None
        if cfg.loss.kl_coef:
            self.ref = load_policy(policy_dir, dtype=cfg.model.dtype, device=self.device if self.group is None else "cpu",
                                   tokenizer=False)[0]
            if self.group is not None:
                self.group.shard(self.ref)
        self.version = start_version
        self.publisher = None  # rank 0: the weight bus's sender (rank 0 of the bus)
        if self.rank == 0 and bus_addr is not None:
            self.publisher = Publisher(join_bus(cfg, bus_addr, 0, self.device), want_q, start_version, report_q,
                                       rejoin=lambda epoch, world: join_bus(cfg, bus_addr, 0, self.device, epoch, world))
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

    # ---- what the schedules use ---------------------------------------------------------------
    def engine(self, plan: RoundPlan, *, recompute: bool = False, **kw) -> StreamLearner:
        """The round's learner engine on this rank (schedules choose when it runs). recompute: the
        exactness certificate's second engine (rl/certificate.py), which a test's fold fault never reaches."""
        lc = self.cfg.learner
        opts = {"max_tokens": lc.max_microbatch_tokens, "max_items": lc.max_microbatch_items if self.microbatch else 1,
                    "ref_model": self.ref, "chunk_tokens": lc.logits_chunk_tokens, "opd_unit": lc.opd_unit}
        opts.update(kw)
        if self.group is not None:
            opts.update(grads=self.grads, rank=self.rank, world=self.world)
        sl = StreamLearner(self.model, self.obj, plan.group_sizes(), **opts)
        if not recompute:
            break_fold_if_asked(sl, plan.round)
        return sl

    def receive(self, plan: RoundPlan, block: bool, limit: int | None = None) -> list:
        """The round's messages that have arrived (rank 0 reads the queue; a group broadcasts them).
        block: wait for at least one (nothing else to do); else only take what is there (at most `limit`)."""
        msgs = []
        if self.group is None or self.group.leader:
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
        return msgs if self.group is None else self.group.broadcast(msgs)

    def finish(self, sl: StreamLearner, plan: RoundPlan, work: RoundWork):
        """Round close: the gradient per parameter (one rank), or None on a group, where FSDP now holds
        the sharded p.grad of R. In a certified round (run.verify_every) the gradient is recomputed and
        compared first (rl/certificate.py): work.verify, or the run stops before the step."""
        grads = sl.close_round()
        if due(self.cfg, plan.round):
            work.verify = certify(self, plan, work, sl, grads)
        if self.group is None:
            return grads
        self.grads.emit(grads, lambda: sl.zero_loss())
        return None

    def progress(self, round_: int, work: RoundWork) -> None:
        if self.rank != 0:
            return
        t = now()
        if t - self._last_progress > 0.2:  # a few messages per second at most
            self._last_progress = t
            self.report_q.put(("progress", "learner", {"round": round_, "busy_s": work.busy_s,
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
        if self.group is None:
            return {n: t.cpu() for n, t in trainable_state(self.model).items()}
        full = self.group.full_trainable_state(self.model)
        if full is not None:
            host = dict(self.host.named_parameters())
            with torch.no_grad():
                for n, t in full.items():
                    host[n].copy_(t)
            full = {n: t.to(host[n].dtype) for n, t in full.items()}  # float32 masters: their cast, as the host's
        return full

    def publish(self) -> dict:
        """Offer the new weights to the weight bus's publisher: the trained parameters only (every
        parameter, or the LoRA adapters), on the learner's device. On-policy schedules offer the live
        tensors (nothing trains until the rollout side has them); async offers a host copy, since its
        next step may come first. The bytes are those one engine receives."""
        t0 = now()
        if self.group is None:
            state = trainable_state(self.model)
            if self.cfg.schedule == "async":
                state = {n: t.detach().to("cpu", copy=True) for n, t in state.items()}
        else:
            state = self.trained_state()  # gathered: already a copy
        if state is None:
            return {"start": t0, "end": now(), "bytes": 0}
        self.publisher.offer(self.version, state, t0)
        return {"start": t0, "end": now(), "bytes": sum(t.numel() * t.element_size() for t in state.values())}

    def save_checkpoint(self, round_: int) -> str | None:
        """checkpoints/round-<k>/: the policy (save_pretrained + tokenizer; with LoRA the merged model plus
        adapter/, which --resume loads), optimizer.pt and state.json, written atomically (policy.save_policy).
        optimizer.pt is the single-process format on any number of ranks, so a run resumes on any N."""
        if self.group is None:
            opt_state, model = self.opt.state_dict(), self.model
            if self.master_dtype is not None:
                opt_state[MASTER_KEY] = master_state(self.opt_params)
        else:
            opt_state, model = self.group.optimizer_state(self.opt), self.host
            if self.master_dtype is not None:  # the shards are the masters: gathered (a collective)
                full = self.group.full_trainable_state(self.model)
                if full is not None:
                    opt_state[MASTER_KEY] = dict(enumerate(full.values()))
            if not self.group.leader:
                return None

        def extra(d: Path) -> None:
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
            if self.group is not None:
                self.trained_state()
            self.save_checkpoint(0)
        learn = SCHEDULES[self.cfg.schedule]
        for plan in plans:
            reset_peak_rss()
            reset_peak_device(self.device)
            work = learn(self, plan)
            grad_norm = self.apply_step(work.grads)
            step = {"start": work.step_start, "end": now()}
            self.version += 1
            published = self.publish()
            ranks = self._per_rank(work)
            checkpoint = None
            if plan.save_checkpoint:
                t0 = now()
                checkpoint = (self.save_checkpoint(plan.round), now() - t0)
            if self.rank != 0:
                continue
            report = {
                "version": self.version, "items": work.items, "group_close": work.group_close, "batch": work.batch,
                "trajectories": work.trajectories,  # OPD: each trajectory's end (events.jsonl `trajectory` rows)
                "last_arrival": work.last_arrival, "busy_s": work.busy_s + (step["end"] - step["start"]), "step": step,
                "publish": published, "grad_norm": grad_norm, "model_bytes": self.model_bytes,
                "trainable_bytes": self.trainable_bytes, "opd_reverse_kl": _reverse_kl(work.rollouts),
                "microbatches": work.microbatches, "learners": self.world, "work": work.work(), **ranks,
                "verify": work.verify,
            }
            if checkpoint is not None:
                report["checkpoint"], report["checkpoint_s"] = checkpoint
            self.report_q.put(("learner_round", plan.round, report))

    def _per_rank(self, work: RoundWork) -> dict:
        """This round's per-rank figures, gathered on rank 0: peaks, buffer bytes, backward passes, loss."""
        mine = {"peak_rss": peak_rss_bytes(), "peak_device": peak_device_bytes(self.device),
                "accumulator_peak_bytes": work.accumulator_peak_bytes, "accumulator_set_bytes": work.buffer_set_bytes,
                "backwards": work.backwards, "loss": work.loss}
        ranks = [mine] if self.group is None else self.group.gather(mine)
        if ranks is None:
            return {}
        loss = None if any(r["loss"] is None for r in ranks) else sum(r["loss"] for r in ranks)
        return {"loss": loss, "peak_rss": ranks[0]["peak_rss"], "peak_device": ranks[0]["peak_device"],
                "accumulator_peak_bytes": ranks[0]["accumulator_peak_bytes"],
                "ranks": {k: [r[k] for r in ranks] for k in ("peak_rss", "peak_device", "accumulator_peak_bytes",
                                                             "accumulator_set_bytes", "backwards")}}

    def close(self, serve_last_sync: bool = True) -> None:
        if self.publisher is not None and serve_last_sync:  # the rollout side may still take the last weights
            self.publisher.close()
        if self.group is not None:
            self.group.close()


def _reverse_kl(rollouts: list[Rollout]) -> float | None:
    """OPD: mean over loss tokens of log pi_student - log pi_teacher on the sampled tokens
    (student = the rollout engine's log-probs); None for GRPO."""
    tot, n = 0.0, 0
    for r in rollouts:
        if r.teacher_logprobs is None or r.behavior_logprobs is None:
            return None
        for m, b, t in zip(r.loss_mask, r.behavior_logprobs, r.teacher_logprobs):
            if m:
                tot, n = tot + (b - t), n + 1
    return tot / n if n else None


def learner_main(cfg: TrainConfig, init_dir: str | None, policy_dir: str | None, start_version: int | None,
                 run_dir: str | None, plans, save_initial: bool | None, inbox, want_q, report_q, rank: int = 0,
                 world: int = 1, store: str | None = None, bus_addr: tuple[str, int] | None = None) -> None:
    """One learner process: rank `rank` of `world`. store: the FileStore of ranks tsrl started, or None under
    torchrun (env://), where ranks other than 0 get the run's plan (the None arguments) from rank 0.
    bus_addr: the weight bus's TCPStore (rank 0 sends the weights over it)."""
    init_worker()
    group = None
    local = rank
    if world > 1:
        if store is None:  # torchrun: this node's learner devices, indexed by LOCAL_RANK
            local = int(os.environ.get("LOCAL_RANK", rank))
        group = LearnerGroup.join(rank, world, learner_devices(cfg)[local], store)
        if store is None:
            run = group.broadcast((init_dir, policy_dir, start_version, run_dir, plans, save_initial))
            init_dir, policy_dir, start_version, run_dir, plans, save_initial = run
    learner = Learner(cfg, init_dir, policy_dir, start_version, run_dir, inbox, want_q, report_q, group,
                      learner_devices(cfg)[local], bus_addr)
    if report_q is not None:
        report_q.put(("ready", "learner" if world == 1 else f"learner-{rank}", None))
    finished = False
    try:
        learner.run(plans, save_initial)
        finished = True
    finally:
        learner.close(serve_last_sync=finished)
