"""OPD's teacher process: a fixed model that scores each model turn the moment it closes.

Turn k of a trajectory arrives as its token prefix (TurnClosed); the teacher's log-probs of the
turn's tokens given that prefix go to the learner at once (TurnScored), so that turn's backward
can start while the trajectory's tools still run. When the trajectory ends, its final rollout
leaves with every turn's teacher log-probs filled in (TrajectoryDone), in the same FIFO order, so
the learner always sees a trajectory's turns before its end.

The teacher keeps each open trajectory's key/value cache (TurnScorer): a turn's forward runs over
the tokens since the previous turn only, so a trajectory costs one forward over its tokens, not
one per turn over its growing prefix.

Memory (tsrl plan traces TurnScorer.score_tensor itself): the weights, the key/value caches (the one
being extended and the others kept, together at most `max_bytes`, or the scored trajectory's alone
when it is larger) and one chunk's transients: the forward runs SCORE_CHUNK_TOKENS positions at a
time, so no activation or full-vocabulary logits tensor is longer than that. For Qwen3-32B in bf16
at 32,768 tokens: 61.0 GiB of weights, 8.0 GiB of keys and values (2 x 64 layers x 8 KV heads x 128
x 2 bytes = 256 KiB per token) and 1.7 GiB for a chunk of 1,024 positions (tsrl plan), where one
forward over the whole prefix with its turn's logits would hold 14 GiB beside the weights.
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

CACHE_BYTES = 2 << 30  # the key/value caches a TurnScorer may keep at least (more up to one full-length trajectory's)
# positions per teacher forward: a chunk's activations and its logits (bf16, their float32 log-softmax) are the
# transients beside the caches, 1.7 GiB at Qwen3's vocabulary of 151,936 in bf16; the scores are the same at any chunk
# size up to float rounding (a chunk attends to the cached keys of the chunks before it)
SCORE_CHUNK_TOKENS = 1024


@dataclass
class _Prefix:
    ids: list[int]  # the tokens cached so far
    past: object  # the model's key/value cache over them (transformers Cache)
    last_logits: torch.Tensor  # (1, 1, V): the logits at the last cached position (they predict the next token)


class TurnScorer:
    """Teacher log-probs of a trajectory's turns, one turn at a time, over a key/value cache per trajectory.

    score(key, ids, s, e) equals policy.score_tokens(model, ids, s, e) (without grad the cached keys and
    values are what a full forward computes: equal up to float rounding, tested) but runs the forward over
    ids[L:e] only, L being the tokens cached for `key` by its earlier turns, `chunk_tokens` positions per
    forward. A prefix that does not extend the cached one, or a turn starting inside it, is scored from
    scratch (and cached anew).
    The caches are bounded before each forward: other trajectories' caches are dropped, least recently used
    first, until they and this trajectory's e tokens fit max_bytes (estimated from the model's shapes); a
    dropped trajectory's next turn is scored from scratch, with the same result. max_bytes is at least what
    one `max_tokens` trajectory's cache takes, since scoring such a trajectory holds that much anyway.
    """

    def __init__(self, model, max_bytes: int = CACHE_BYTES, chunk_tokens: int = SCORE_CHUNK_TOKENS,
                 max_tokens: int = 0):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model = model
        self.device = next(model.parameters()).device
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        elem = next(model.parameters()).element_size()
        self.bytes_per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * elem  # keys and values, every layer
        self.max_bytes = max(max_bytes, max_tokens * self.bytes_per_token)
        self.chunk_tokens = chunk_tokens
        self.open: dict = {}  # key -> _Prefix, least recently used first

    @torch.no_grad()
    def score(self, key, ids: list[int], s: int, e: int) -> tuple[list[float], int]:
        """(log-probs of ids[s:e], token positions the forward covered)."""
        first = max(s, 1)
        lead = [0.0] * (first - s)  # position 0 predicts nothing
        if e <= first:
            return lead, 0
        lp, covered = self.score_tensor(key, ids, first, e)
        return lead + lp.double().tolist(), covered

    @torch.no_grad()
    def score_tensor(self, key, ids: list[int], first: int, e: int) -> tuple[torch.Tensor, int]:
        """((e - first,) log-probs of ids[first:e], positions covered), for 1 <= first < e: score's work as
        tensors (tsrl plan runs it on fake ones)."""
        st = self.open.pop(key, None)
        if st is not None and (first - 1 < len(st.ids) - 1 or len(st.ids) >= e or ids[:len(st.ids)] != st.ids):
            st = None  # not a continuation of the cached prefix: start over
        L = 0 if st is None else len(st.ids)
        self._make_room(e)
        past = None if st is None else st.past
        # logits at position p predict ids[p + 1]; the turn needs those at first - 1 .. e - 2. `carry` is the last
        # kept position's row (1, 1, V), which predicts the first token of what follows it
        carry = st.last_logits if st is not None and first - 1 < L else None
        pieces = []
        for a in range(L, e, self.chunk_tokens):
            b = min(a + self.chunk_tokens, e)
            keep = b - max(a, first - 1)  # the chunk's positions from first - 1 on: a suffix of the chunk
            out = self.model(input_ids=torch.tensor([ids[a:b]], dtype=torch.long, device=self.device),
                             past_key_values=past, use_cache=True,
                             logits_to_keep=keep if keep > 0 else torch.zeros(0, dtype=torch.long, device=self.device))
            past = out.past_key_values
            if keep <= 0:
                continue
            rows = out.logits if carry is None else torch.cat([carry, out.logits], dim=1)  # (1, n, V)
            q = b - rows.shape[1]  # the position of rows[:, 0]
            if rows.shape[1] > 1:  # row j predicts ids[q + j + 1]
                pieces.append(token_logprobs(rows, torch.tensor([ids[q:b]], device=self.device))[0, 1:])
            carry = rows[:, -1:].clone()  # a copy: a view would keep the chunk's (1, n, V) logits alive in the cache
            del out, rows
        self.open[key] = _Prefix(list(ids[:e]), past, carry)
        return torch.cat(pieces), e - L

    def _make_room(self, tokens: int) -> None:
        """Drop other trajectories' caches, least recently used first, until they and `tokens` fit max_bytes."""
        while self.open and (self.cached_tokens() + tokens) * self.bytes_per_token > self.max_bytes:
            self.open.pop(next(iter(self.open)))

    def cached_tokens(self) -> int:
        return sum(len(p.ids) for p in self.open.values())

    def close(self, key) -> None:
        self.open.pop(key, None)


class TeacherWorker:
    def __init__(self, cfg: TrainConfig, teacher_dir: str, in_q, out_q, report_q):
        self.device = device_of(cfg, "teacher")
        self.model, _ = load_policy(teacher_dir, dtype=cfg.model.dtype, device=self.device, tokenizer=False)
        # the caches kept between turns may hold one full-length trajectory: scoring one holds that much anyway
        self.scorer = TurnScorer(self.model, max_tokens=cfg.rollout.max_trajectory_tokens)
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
                # a placeholder span stands for turns still to come, unless this turn is known to be the last
                spans = [tuple(sp) for sp in msg.turn_spans] + ([] if msg.last else [(e, e)])
                partial = Rollout(msg.group_id, msg.sample_index, msg.input_ids, msg.loss_mask, 0.0, spans,
                                  teacher_logprobs=list(buf[:e]))
                t1 = time.monotonic()
                busy, busy_cpu = busy + t1 - t0, busy_cpu + time.process_time() - c0
                positions += covered
                self.out_q.put(TurnScored(msg.round, msg.policy_version, partial, msg.turn, msg.closed_at, t1,
                                          teacher_start=t0, last=msg.last))
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
