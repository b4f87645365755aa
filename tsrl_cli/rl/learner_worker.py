"""The learner process: the model being trained, its optimizer, one step per round.

    for each round:
        work = SCHEDULES[schedule](learner, plan)   # sync | stream | async: the round's gradient
        optimizer step (grad clip), version += 1
        publish the weights to the rollout process (safetensors bytes over a queue)
        checkpoint when the plan says so

The reference model for a KL term is the initial policy (frozen), scored here per trajectory.
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import device_of
from tsrl_cli.policy import load_policy, param_bytes, save_policy, score_tokens, trainable_state
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
)
from tsrl_cli.rl.learner import Objective
from tsrl_cli.rl.schedules import SCHEDULES, RoundWork
from tsrl_cli.rl.types import RoundPlan, TrajectoryDone
from tsrl_cli.rollouts import Rollout

now = time.monotonic


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)


class Learner:
    def __init__(self, cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, run_dir: str,
                 inbox, weights_q, report_q):
        self.cfg, self.inbox, self.weights_q, self.report_q = cfg, inbox, weights_q, report_q
        self.run_dir = Path(run_dir)
        self.device = device_of(cfg, "learner")
        self.model, self.tok = load_policy(init_dir, dtype=cfg.model.dtype, device=self.device, lora=cfg.lora,
                                           seed=cfg.seed, base=policy_dir)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.model_bytes = param_bytes(self.model)
        self.trainable_bytes = param_bytes(self.model, trainable_only=True)
        self.obj = Objective(cfg.objective, cfg.loss)
        self.opt = make_optimizer(self.params, cfg)
        opt_state = Path(init_dir) / "optimizer.pt"
        if opt_state.is_file():  # resuming: the optimizer continues exactly where it stopped
            self.opt.load_state_dict(torch.load(opt_state, weights_only=True))
        self.ref = (load_policy(policy_dir, dtype=cfg.model.dtype, device=self.device, tokenizer=False)[0]
                    if cfg.loss.kl_coef else None)
        self.version = start_version
        self._last_progress = 0.0

    # ---- what the schedules use ---------------------------------------------------------------
    def arrivals(self, plan: RoundPlan):
        """The round's messages in arrival order, until every trajectory of the plan has ended."""
        ended = 0
        while ended < plan.num_trajectories:
            msg = self.inbox.get()
            if msg.round != plan.round:
                raise RuntimeError(f"learner: a round {msg.round} item arrived during round {plan.round}")
            ended += isinstance(msg, TrajectoryDone)
            yield msg

    def with_ref(self, r: Rollout) -> Rollout:
        """Attach the reference (initial policy) log-probs when the objective has a KL term."""
        if self.ref is not None:
            r.ref_logprobs = score_tokens(self.ref, r.input_ids)
        return r

    def progress(self, round_: int, work: RoundWork) -> None:
        t = now()
        if t - self._last_progress > 0.2:  # a few messages per second at most
            self._last_progress = t
            self.report_q.put(("progress", "learner", {"round": round_, "busy_s": work.busy_s,
                                                       "items": len(work.items)}))

    # ---- step, weights, checkpoints -----------------------------------------------------------
    def apply_step(self, grads) -> float:
        for p, g in zip(self.params, grads, strict=True):
            p.grad = None if g is None else g.to(p.dtype)
        present = [p.grad for p in self.params if p.grad is not None]
        if self.cfg.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(norm)

    def publish(self) -> dict:
        """Send the new weights to the rollout process: a safetensors blob (exact in every dtype) of the
        trained parameters only (every parameter, or the LoRA adapters)."""
        t0 = now()
        blob = save({n: t.cpu() for n, t in trainable_state(self.model).items()})
        self.weights_q.put((self.version, blob, t0))
        return {"start": t0, "end": now(), "bytes": len(blob)}

    def save_checkpoint(self, round_: int) -> str:
        """checkpoints/round-<k>/: the policy (save_pretrained + tokenizer; with LoRA the merged model plus
        adapter/, which --resume loads), optimizer.pt and state.json, written atomically (policy.save_policy)."""

        def extra(d: Path) -> None:
            torch.save(self.opt.state_dict(), d / "optimizer.pt")
            (d / "state.json").write_text(json.dumps({"round": round_, "policy_version": self.version,
                                                      "schedule": self.cfg.schedule, "seed": self.cfg.seed}))

        try:
            return str(save_policy(self.model, self.tok, self.run_dir / "checkpoints" / f"round-{round_}", extra=extra))
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            full = getattr(e, "errno", None) == errno.ENOSPC or shutil.disk_usage(self.run_dir).free < (1 << 20)
            if not full:
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
            step = {"start": work.step_start, "end": now()}
            self.version += 1
            published = self.publish()
            report = {
                "version": self.version, "items": work.items, "group_close": work.group_close, "batch": work.batch,
                "last_arrival": work.last_arrival, "busy_s": work.busy_s + (step["end"] - step["start"]), "step": step, "publish": published,
                "loss": work.loss, "grad_norm": grad_norm, "accumulator_peak_bytes": work.accumulator_peak_bytes,
                "peak_rss": peak_rss_bytes(), "peak_device": peak_device_bytes(self.device),
                "model_bytes": self.model_bytes, "trainable_bytes": self.trainable_bytes,
                "opd_reverse_kl": _reverse_kl(work.rollouts),
            }
            if plan.save_checkpoint:
                t0 = now()
                report["checkpoint"] = self.save_checkpoint(plan.round)
                report["checkpoint_s"] = now() - t0
            self.report_q.put(("learner_round", plan.round, report))


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


def learner_main(cfg: TrainConfig, init_dir: str, policy_dir: str, start_version: int, run_dir: str, plans,
                 save_initial: bool, inbox, weights_q, report_q) -> None:
    init_worker()
    learner = Learner(cfg, init_dir, policy_dir, start_version, run_dir, inbox, weights_q, report_q)
    report_q.put(("ready", "learner", None))
    learner.run(plans, save_initial)
