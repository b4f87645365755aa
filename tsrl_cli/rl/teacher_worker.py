"""OPD's teacher process: a fixed model that scores each model turn the moment it closes.

Turn k of a trajectory arrives as its token prefix (TurnClosed); the teacher's log-probs of the
turn's tokens given that prefix go to the learner at once (TurnScored), so that turn's backward
can start while the trajectory's tools still run. When the trajectory ends, its final rollout
leaves with every turn's teacher log-probs filled in (TrajectoryDone), in the same FIFO order, so
the learner always sees a trajectory's turns before its end.

The teacher keeps each open trajectory's key/value cache (TurnScorer): a turn's forward runs over
the tokens since the previous turn only, so a trajectory costs one forward over its tokens, not
one per turn over its growing prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tsrl_cli.config import TrainConfig
from tsrl_cli.core.losses import token_logprobs
from tsrl_cli.devices import device_of
from tsrl_cli.policy import load_policy
from tsrl_cli.processes import (
    init_worker,
    peak_device_bytes,
    peak_rss_bytes,
    reset_peak_device,
    reset_peak_rss,
)
from tsrl_cli.rl.types import RoundPlan, TrajectoryDone, TurnClosed, TurnScored
from tsrl_cli.rollouts import Rollout


CACHE_BYTES = 2 << 30  # the open trajectories' key/value caches a TurnScorer keeps (tsrl plan counts them)


@dataclass
class _Prefix:
    ids: list[int]  # the tokens cached so far
    past: object  # the model's key/value cache over them (transformers Cache)
    last_logits: torch.Tensor  # (1, 1, V): the logits at the last cached position (they predict the next token)


class TurnScorer:
    """Teacher log-probs of a trajectory's turns, one turn at a time, over a key/value cache per trajectory.

    score(key, ids, s, e) equals policy.score_tokens(model, ids, s, e) (without grad the cached keys and
    values are what a full forward computes: equal up to float rounding, tested) but runs the forward over
    ids[L:e] only, L being the tokens cached for `key` by its earlier turns. A prefix that does not
    extend the cached one, or a turn starting inside it, is scored from scratch (and cached anew).
    Caches beyond max_bytes (estimated from the model's shapes) are dropped, least recently used first:
    their next turn is scored from scratch, with the same result.
    """

    def __init__(self, model, max_bytes: int = CACHE_BYTES):
        self.model = model
        self.device = next(model.parameters()).device
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        elem = next(model.parameters()).element_size()
        self.bytes_per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * elem  # keys and values, every layer
        self.max_bytes = max_bytes
        self.open: dict = {}  # key -> _Prefix, least recently used first

    @torch.no_grad()
    def score(self, key, ids: list[int], s: int, e: int) -> tuple[list[float], int]:
        """(log-probs of ids[s:e], token positions the forward covered)."""
        first = max(s, 1)
        lead = [0.0] * (first - s)  # position 0 predicts nothing
        if e <= first:
            return lead, 0
        st = self.open.get(key)
        if st is not None and (first - 1 < len(st.ids) - 1 or len(st.ids) >= e or ids[:len(st.ids)] != st.ids):
            st = None  # not a continuation of the cached prefix: start over
        L = 0 if st is None else len(st.ids)
        new = torch.tensor([ids[L:e]], dtype=torch.long, device=self.device)
        keep = e - max(first - 1, L)  # the new positions whose logits predict turn tokens
        out = self.model(input_ids=new, past_key_values=None if st is None else st.past, use_cache=True,
                         logits_to_keep=keep)
        logits = out.logits  # (1, keep, V) at positions e-keep .. e-1
        if first - 1 < L:  # the turn starts right after the cache: its first token's logits are the cached ones
            logits = torch.cat([st.last_logits, logits], dim=1)
        lp = token_logprobs(logits, torch.tensor([ids[first - 1:e]], device=self.device))[0, 1:]
        self.open.pop(key, None)
        self.open[key] = _Prefix(list(ids[:e]), out.past_key_values, out.logits[:, -1:])
        while len(self.open) > 1 and self.cached_tokens() * self.bytes_per_token > self.max_bytes:
            self.open.pop(next(iter(self.open)))
        return lead + lp.double().tolist(), e - L

    def cached_tokens(self) -> int:
        return sum(len(p.ids) for p in self.open.values())

    def close(self, key) -> None:
        self.open.pop(key, None)


class TeacherWorker:
    def __init__(self, cfg: TrainConfig, teacher_dir: str, in_q, out_q, report_q):
        self.device = device_of(cfg, "teacher")
        self.model, _ = load_policy(teacher_dir, dtype=cfg.model.dtype, device=self.device, tokenizer=False)
        self.scorer = TurnScorer(self.model)
        self.in_q, self.out_q, self.report_q = in_q, out_q, report_q

    def run_round(self, plan: RoundPlan) -> dict:
        scores: dict[tuple[str, int], list[float]] = {}  # teacher log-probs so far, per trajectory
        ended = turns = positions = 0
        busy = busy_cpu = 0.0
        while ended < plan.num_trajectories:
            msg = self.in_q.get()
            if msg.round != plan.round:
                raise RuntimeError(f"teacher: round {msg.round} message during round {plan.round}")
            if isinstance(msg, TurnClosed):
                t0, c0 = time.monotonic(), time.process_time()
                s, e = msg.turn_spans[msg.turn]
                buf = scores.setdefault((msg.group_id, msg.sample_index), [])
                buf += [0.0] * (e - len(buf))
                buf[s:e], covered = self.scorer.score((msg.group_id, msg.sample_index), msg.input_ids, s, e)
                spans = [tuple(sp) for sp in msg.turn_spans] + [(e, e)]  # placeholder: turns still to come
                partial = Rollout(msg.group_id, msg.sample_index, msg.input_ids, msg.loss_mask, 0.0, spans,
                                  teacher_logprobs=list(buf[:e]))
                t1 = time.monotonic()
                busy, busy_cpu = busy + t1 - t0, busy_cpu + time.process_time() - c0
                positions += covered
                self.out_q.put(TurnScored(msg.round, msg.policy_version, partial, msg.turn, msg.closed_at, t1,
                                          teacher_start=t0))
                turns += 1
            else:  # TrajectoryDone: attach every turn's scores, then hand over
                assert isinstance(msg, TrajectoryDone)
                r = msg.rollout
                buf = scores.pop(r.key, [])
                self.scorer.close(r.key)
                r.teacher_logprobs = (buf + [0.0] * len(r.input_ids))[: len(r.input_ids)]
                msg.finished_at = time.monotonic()
                self.out_q.put(msg)
                ended += 1
        # busy_cpu_s against busy_s: how much of the scoring wall time this process had a core
        return {"busy_s": busy, "busy_cpu_s": busy_cpu, "turns": turns, "positions": positions}

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
