"""OPD's teacher process: a fixed model that scores each model turn the moment it closes.

Turn k of a trajectory arrives as its token prefix (TurnClosed); the teacher's log-probs of the
turn's tokens given that prefix go to the learner at once (TurnScored), so that turn's backward
can start while the trajectory's tools still run. When the trajectory ends, its final rollout
leaves with every turn's teacher log-probs filled in (TrajectoryDone), in the same FIFO order, so
the learner always sees a trajectory's turns before its end.
"""

from __future__ import annotations

import time

from tsrl_cli.config import TrainConfig
from tsrl_cli.devices import device_of
from tsrl_cli.policy import load_policy, score_tokens
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
)
from tsrl_cli.rl.types import RoundPlan, TrajectoryDone, TurnClosed, TurnScored
from tsrl_cli.rollouts import Rollout


class TeacherWorker:
    def __init__(self, cfg: TrainConfig, teacher_dir: str, in_q, out_q, report_q):
        self.device = device_of(cfg, "teacher")
        self.model, _ = load_policy(teacher_dir, dtype=cfg.model.dtype, device=self.device, tokenizer=False)
        self.in_q, self.out_q, self.report_q = in_q, out_q, report_q

    def run_round(self, plan: RoundPlan) -> dict:
        scores: dict[tuple[str, int], list[float]] = {}  # teacher log-probs so far, per trajectory
        ended = turns = 0
        busy = 0.0
        while ended < plan.num_trajectories:
            msg = self.in_q.get()
            if msg.round != plan.round:
                raise RuntimeError(f"teacher: round {msg.round} message during round {plan.round}")
            if isinstance(msg, TurnClosed):
                t0 = time.monotonic()
                s, e = msg.turn_spans[msg.turn]
                buf = scores.setdefault((msg.group_id, msg.sample_index), [])
                buf += [0.0] * (e - len(buf))
                buf[s:e] = score_tokens(self.model, msg.input_ids, s, e)
                spans = [tuple(sp) for sp in msg.turn_spans] + [(e, e)]  # placeholder: turns still to come
                partial = Rollout(msg.group_id, msg.sample_index, msg.input_ids, msg.loss_mask, 0.0, spans,
                                  teacher_logprobs=list(buf[:e]))
                busy += time.monotonic() - t0
                self.out_q.put(TurnScored(msg.round, msg.policy_version, partial, msg.turn, msg.closed_at,
                                          time.monotonic()))
                turns += 1
            else:  # TrajectoryDone: attach every turn's scores, then hand over
                assert isinstance(msg, TrajectoryDone)
                r = msg.rollout
                buf = scores.pop(r.key, [])
                r.teacher_logprobs = (buf + [0.0] * len(r.input_ids))[: len(r.input_ids)]
                msg.finished_at = time.monotonic()
                self.out_q.put(msg)
                ended += 1
        return {"busy_s": busy, "turns": turns}

    def run(self, plans: list[RoundPlan]) -> None:
        for plan in plans:
            reset_peak_rss()
            reset_peak_device(self.device)
            report = self.run_round(plan)
            report["peak_rss"] = peak_rss_bytes()
            report["peak_device"] = peak_device_bytes(self.device)
            self.report_q.put(("teacher_round", plan.round, report))


def teacher_main(cfg: TrainConfig, teacher_dir: str, plans, in_q, out_q, report_q) -> None:
    init_worker()
    teacher = TeacherWorker(cfg, teacher_dir, in_q, out_q, report_q)
    report_q.put(("ready", "teacher", None))
    teacher.run(plans)
