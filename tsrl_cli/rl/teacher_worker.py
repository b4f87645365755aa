"""OPD's teacher process: a fixed model that scores each model turn the moment it closes.

Turn k of a trajectory arrives as its token prefix (TurnClosed); the teacher's log-probs of the
turn's tokens given that prefix go to the learner at once (TurnScored), so that turn's backward
can start while the trajectory's tools still run. When the trajectory ends, its final rollout
leaves with every turn's teacher log-probs filled in (TrajectoryDone), in the same FIFO order, so
the learner always sees a trajectory's turns before its end.

The teacher keeps each open trajectory's key/value cache (TurnScorer): a turn's forward runs over
the tokens since the previous turn only, so a trajectory costs one forward over its tokens, not
one per turn over its growing prefix. The caches are sized for every open session
(teacher_cache_bytes: rollout.concurrency full-length trajectories, or model.teacher_cache_gib);
under a smaller cap the least recently used are dropped, and with sessions interleaved round-robin
almost every turn then re-scores its whole prefix. The worker scores every queued turn of distinct
trajectories in one padded forward (TurnScorer.score_many), each row over its own cache.

Memory (tsrl plan traces TurnScorer.score_tensor itself): the weights, the key/value caches (the one
being extended and the others kept, together at most `max_bytes`, or the scored trajectory's alone
when it is larger) and one chunk's transients: the forward runs SCORE_CHUNK_TOKENS positions at a
time (rows x positions in a batched forward), so no activation or full-vocabulary logits tensor is
longer than that. For Qwen3-32B in bf16 at 32,768 tokens: 61.0 GiB of weights, 8.0 GiB of keys and
values per trajectory (2 x 64 layers x 8 KV heads x 128 x 2 bytes = 256 KiB per token) and 1.7 GiB
for a chunk of 1,024 positions (tsrl plan), where one forward over the whole prefix with its turn's
logits would hold 14 GiB beside the weights.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

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
from tsrl_cli.rl.placement import Placement
from tsrl_cli.rl.reports import Report, TeacherReport
from tsrl_cli.rl.types import RoundPlan, TrajectoryDone, TurnClosed, TurnScored
from tsrl_cli.rollouts import Rollout

CACHE_BYTES = 2 << 30  # a TurnScorer's default cap on its key/value caches (more up to one full-length trajectory's)
# positions per teacher forward: a chunk's activations and its logits (bf16, their float32 log-softmax) are the
# transients beside the caches, 1.7 GiB at Qwen3's vocabulary of 151,936 in bf16; the scores are the same at any chunk
# size up to float rounding (a chunk attends to the cached keys of the chunks before it)
SCORE_CHUNK_TOKENS = 1024
# trajectories scored in one padded forward at most: each row gets SCORE_CHUNK_TOKENS // rows positions per forward
SCORE_BATCH_ROWS = 32
GiB = 1 << 30


def teacher_cache_bytes(cfg: TrainConfig, bytes_per_token: int) -> int:
    """The key/value caches OPD's teacher keeps between turns (TurnScorer max_bytes, at least one full-length
    trajectory's): model.teacher_cache_gib, else every open session's full-length cache, rollout.concurrency x
    rollout.max_trajectory_tokens x bytes_per_token (2 x layers x KV heads x head_dim x bytes). tsrl plan counts
    the same bytes against the teacher's device."""
    if cfg.model.teacher_cache_gib is not None:
        return int(cfg.model.teacher_cache_gib * GiB)
    return cfg.rollout.concurrency * cfg.rollout.max_trajectory_tokens * bytes_per_token


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
    scratch (and cached anew). score_many scores turns of distinct trajectories together, one padded forward
    over all of them (the same scores up to float rounding, tested).
    The caches are bounded before each forward: other trajectories' caches are dropped, least recently used
    first, until they and this trajectory's e tokens fit max_bytes (estimated from the model's shapes); a
    dropped trajectory's next turn is scored from scratch, with the same result. max_bytes is at least what
    one `max_tokens` trajectory's cache takes, since scoring such a trajectory holds that much anyway.
    """

    def __init__(self, model, max_bytes: int = CACHE_BYTES, chunk_tokens: int = SCORE_CHUNK_TOKENS,
                 max_tokens: int = 0, max_rows: int = SCORE_BATCH_ROWS):
        if chunk_tokens < 1 or max_rows < 1:
            raise ValueError(f"chunk_tokens and max_rows must be >= 1, got {chunk_tokens}, {max_rows}")
        self.model = model
        self.device = next(model.parameters()).device
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        elem = next(model.parameters()).element_size()
        self.bytes_per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * elem  # keys and values, every layer
        self.max_bytes = max(max_bytes, max_tokens * self.bytes_per_token)
        self.chunk_tokens = chunk_tokens
        # score_many's padded rows need each layer to cache every position (a sliding-window layer keeps its window)
        full = set(getattr(c, "layer_types", None) or ["full_attention"]) == {"full_attention"}
        self.max_rows = max_rows if full else 1
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

    @staticmethod
    def _extends(st: _Prefix | None, ids: list[int], first: int, e: int) -> bool:
        """Whether the turn ids[first:e] continues the cached prefix `st`: ids start with it, the turn starts at
        or after its last position and ends past it."""
        return st is not None and first - 1 >= len(st.ids) - 1 and len(st.ids) < e and ids[:len(st.ids)] == st.ids

    @torch.no_grad()
    def score_tensor(self, key, ids: list[int], first: int, e: int) -> tuple[torch.Tensor, int]:
        """((e - first,) log-probs of ids[first:e], positions covered), for 1 <= first < e: score's work as
        tensors (tsrl plan runs it on fake ones)."""
        st = self.open.pop(key, None)
        if not self._extends(st, ids, first, e):
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

    @torch.no_grad()
    def score_many(self, turns: list[tuple]) -> list[tuple[list[float], int]]:
        """score(key, ids, s, e) for each (key, ids, s, e) of distinct trajectories, as padded forwards of up to
        max_rows turns: each row extends its own cache. A turn joins a forward while the caches kept, the
        forward's padded cache (rows x (longest cache + longest turn)) fit max_bytes, else it waits for the
        next one; the first always joins (dropping caches as score does). [(log-probs, positions), ...]"""
        if len({t[0] for t in turns}) < len(turns):
            raise ValueError("score_many: one turn per trajectory (a trajectory's next turn extends this one's cache)")
        out: list = [None] * len(turns)
        todo = []
        for i, (key, ids, s, e) in enumerate(turns):
            if e <= max(s, 1):
                out[i] = self.score(key, ids, s, e)  # nothing to score
            else:
                todo.append(i)
        while todo:
            rows = self._admit([turns[i] for i in todo])
            batch = [todo[j] for j in rows]
            if len(batch) == 1:
                out[batch[0]] = self.score(*turns[batch[0]])
            else:
                for i, (lp, covered) in zip(batch, self._score_rows([turns[i] for i in batch]), strict=True):
                    s, e = turns[i][2:]
                    out[i] = [0.0] * (max(s, 1) - s) + lp.double().tolist(), covered
            todo = [i for i in todo if i not in batch]
        return out

    def _admit(self, turns: list[tuple]) -> list[int]:
        """Indices of the turns of one padded forward, in order: see score_many."""
        rows: list[int] = []
        kept, longest, newest = self.cached_tokens(), 0, 0
        for j, (key, ids, s, e) in enumerate(turns):
            if len(rows) == min(self.max_rows, self.chunk_tokens):
                break
            st = self.open.get(key)
            L = len(st.ids) if self._extends(st, ids, max(s, 1), e) else 0
            held = 0 if st is None else len(st.ids)  # kept now; the forward takes it over (or drops it)
            padded = (len(rows) + 1) * (max(longest, L) + max(newest, e - L))
            if rows and (kept - held + padded) * self.bytes_per_token > self.max_bytes:
                continue
            rows.append(j)
            kept, longest, newest = kept - held, max(longest, L), max(newest, e - L)
        return rows

    def _score_rows(self, turns: list[tuple]) -> list[tuple[torch.Tensor, int]]:
        """score_tensor for several trajectories in one padded forward per chunk. Row r's cache of L_r positions
        sits right-aligned in the first P = max L_r columns (left padding); its new tokens follow at columns
        P + o, o < n_r = e_r - L_r, chunk by chunk, pads after them. The attention mask hides every pad and each
        row's positions are its own (L_r + o), so a row's keys, values and logits are its single forward's."""
        B, dev = len(turns), self.device
        firsts = [max(s, 1) for _, _, s, _ in turns]
        sts = []
        for (key, ids, _, e), f in zip(turns, firsts, strict=True):
            st = self.open.pop(key, None)
            sts.append(st if self._extends(st, ids, f, e) else None)  # else scored from scratch
        Ls = [0 if st is None else len(st.ids) for st in sts]
        ns = [e - L for (*_, e), L in zip(turns, Ls, strict=True)]
        P, W = max(Ls), max(ns)
        self._make_room(B * (P + W))
        past = None
        if P:  # the rows' caches stacked one layer at a time, each row's layer freed as it is copied
            past = DynamicCache(ddp_cache_data=self._stack(sts, P))
        mask = torch.tensor([[0] * (P - L) + [1] * L for L in Ls], dtype=torch.long, device=dev)
        # as in score_tensor: a row's cached last logits predict its first new token
        carry = [None if st is None or f - 1 >= L else st.last_logits
                 for st, f, L in zip(sts, firsts, Ls, strict=True)]
        pieces: list[list[torch.Tensor]] = [[] for _ in range(B)]
        w = max(1, self.chunk_tokens // B)  # rows x positions per forward: at most chunk_tokens
        for a in range(0, W, w):
            b = min(a + w, W)
            x = torch.zeros(B, b - a, dtype=torch.long)
            pos = torch.zeros(B, b - a, dtype=torch.long)
            real = torch.zeros(B, b - a, dtype=torch.long)
            need = []  # per row, the chunk's offsets whose logits it keeps: its first scored token's predictor on
            for r, ((_, ids, *_), L, n, f) in enumerate(zip(turns, Ls, ns, firsts, strict=True)):
                m = max(0, min(b, n) - a)
                x[r, :m] = torch.tensor(ids[L + a:L + a + m], dtype=torch.long)
                real[r, :m] = 1
                pos[r] = torch.arange(L + a, L + b).clamp(max=L + n - 1)  # a pad takes the row's last position
                need.append(range(max(a, f - 1 - L), min(b, n)))
            mask = torch.cat([mask, real.to(dev)], dim=1)
            keep = b - min((k.start for k in need if len(k)), default=b)
            out = self.model(input_ids=x.to(dev), attention_mask=mask, position_ids=pos.to(dev),
                             past_key_values=past, use_cache=True,
                             logits_to_keep=keep if keep > 0 else torch.zeros(0, dtype=torch.long, device=dev))
            past = out.past_key_values
            for r, k in enumerate(need):
                if not len(k):
                    continue
                ids, L = turns[r][1], Ls[r]
                rows = out.logits[r:r + 1, k.start - (b - keep):k.stop - (b - keep)]  # offsets k: positions L + k
                if carry[r] is not None:
                    rows = torch.cat([carry[r], rows], dim=1)
                q = L + k.stop - rows.shape[1]  # the position of rows[:, 0]
                if rows.shape[1] > 1:
                    pieces[r].append(token_logprobs(rows, torch.tensor([ids[q:L + k.stop]], device=dev))[0, 1:])
                carry[r] = rows[:, -1:].clone()
            del out
        caches = [DynamicCache() for _ in range(B)]  # each row's real columns P - L_r .. P + n_r - 1, copied out
        for i, layer in enumerate(past.layers):
            for r, (L, n) in enumerate(zip(Ls, ns, strict=True)):
                caches[r].update(layer.keys[r:r + 1, :, P - L:P + n], layer.values[r:r + 1, :, P - L:P + n], i)
            layer.keys = layer.values = None  # the batch's layer: freed before the next one is copied
        for (key, ids, _, e), cache, c in zip(turns, caches, carry, strict=True):
            self.open[key] = _Prefix(list(ids[:e]), cache, c)
        return [(torch.cat(p), n) for p, n in zip(pieces, ns, strict=True)]

    def _stack(self, sts: list[_Prefix | None], P: int):
        """Per layer, (keys, values) of shape (rows, KV heads, P, head_dim): each row's cache at the end, zeros
        before it (masked). Yields one layer at a time and frees the rows' copies of it."""
        ref = next(st for st in sts if st is not None).past.layers
        for i in range(len(ref)):
            k0 = ref[i].keys
            k = k0.new_zeros(len(sts), k0.shape[1], P, k0.shape[3])
            v = torch.zeros_like(k)
            for r, st in enumerate(sts):
                if st is not None:
                    layer = st.past.layers[i]
                    k[r, :, P - layer.keys.shape[2]:] = layer.keys[0]
                    v[r, :, P - layer.values.shape[2]:] = layer.values[0]
                    layer.keys = layer.values = None
            yield k, v

    def _make_room(self, tokens: int) -> None:
        """Drop other trajectories' caches, least recently used first, until they and `tokens` fit max_bytes."""
        while self.open and (self.cached_tokens() + tokens) * self.bytes_per_token > self.max_bytes:
            self.open.pop(next(iter(self.open)))

    def cached_tokens(self) -> int:
        return sum(len(p.ids) for p in self.open.values())

    def close(self, key) -> None:
        self.open.pop(key, None)


class TeacherWorker:
    def __init__(self, cfg: TrainConfig, teacher_dir: str, in_q, out_q, report_q, device: str | None = None):
        self.device = device or device_of(cfg, "teacher")
        self.model, _ = load_policy(teacher_dir, dtype=cfg.model.dtype, device=self.device, tokenizer=False)
        # every open session's cache (teacher_cache_bytes), at least one full-length trajectory's: scoring one holds
        # that much anyway
        # rollout.batch_invariant: each turn scored alone, so a score does not depend on which turns were queued
        # beside it (a padded forward's float rounding does); a resumed round then ends bit for bit
        self.scorer = TurnScorer(self.model, max_bytes=0, max_tokens=cfg.rollout.max_trajectory_tokens,
                                 max_rows=1 if cfg.rollout.batch_invariant else SCORE_BATCH_ROWS)
        self.scorer.max_bytes = max(self.scorer.max_bytes, teacher_cache_bytes(cfg, self.scorer.bytes_per_token))
        self.in_q, self.out_q, self.report_q = in_q, out_q, report_q

    def _take(self, plan: RoundPlan, block: bool) -> list:
        """The messages queued now (at least one when `block`), checked to be this round's."""
        got = [self.in_q.get()] if block else []
        while True:
            try:
                got.append(self.in_q.get_nowait())
            except queue.Empty:
                break
        for msg in got:
            if msg.round != plan.round:
                raise RuntimeError(f"teacher: round {msg.round} message during round {plan.round}")
        return got

    def run_round(self, plan: RoundPlan) -> TeacherReport:
        """Score the round's turns as they queue: every queued turn of distinct trajectories in one call (a
        trajectory's later turn and its end wait for its earlier turns), each trajectory's messages in order.
        The report's positions are the tokens the forwards covered, not their pads: a trajectory's tokens once
        when every session keeps its cache, more where a dropped cache made a turn re-score its prefix."""
        scores: dict[tuple[str, int], list[float]] = {}  # teacher log-probs so far, per trajectory
        pending: list = []  # messages taken from the queue and not yet handled, in arrival order
        ended = turns = positions = 0
        busy = busy_cpu = 0.0
        while ended < plan.num_trajectories:
            pending += self._take(plan, block=not pending)
            firsts, seen = [], set()  # each trajectory's first pending message, where it is a turn
            for msg in pending:
                key = (msg.group_id, msg.sample_index) if isinstance(msg, TurnClosed) else msg.rollout.key
                if key not in seen and isinstance(msg, TurnClosed):
                    firsts.append(msg)
                seen.add(key)
            if firsts:
                t0, c0 = time.monotonic(), time.process_time()
                got = self.scorer.score_many([((m.group_id, m.sample_index), m.input_ids, *m.turn_spans[m.turn])
                                              for m in firsts])
                t1 = time.monotonic()
                busy, busy_cpu = busy + t1 - t0, busy_cpu + time.process_time() - c0
                for msg, (lp, covered) in zip(firsts, got, strict=True):
                    s, e = msg.turn_spans[msg.turn]
                    buf = scores.setdefault((msg.group_id, msg.sample_index), [])
                    buf += [0.0] * (e - len(buf))
                    buf[s:e] = lp
                    # a placeholder span stands for turns still to come, unless this turn is known to be the last
                    spans = [tuple(sp) for sp in msg.turn_spans] + ([] if msg.last else [(e, e)])
                    partial = Rollout(msg.group_id, msg.sample_index, msg.input_ids, msg.loss_mask, 0.0, spans,
                                      teacher_logprobs=list(buf[:e]))
                    positions += covered
                    self.out_q.put(TurnScored(msg.round, msg.policy_version, partial, msg.turn, msg.closed_at, t1,
                                              teacher_start=t0, last=msg.last))
                turns += len(firsts)
                scored = {id(m) for m in firsts}
                pending = [m for m in pending if id(m) not in scored]
            waiting = {(m.group_id, m.sample_index) for m in pending if isinstance(m, TurnClosed)}
            done = [m for m in pending if isinstance(m, TrajectoryDone) and m.rollout.key not in waiting]
            pending = [m for m in pending if not any(m is d for d in done)]
            for msg in done:  # every turn scored: attach the scores, then hand over
                r = msg.rollout
                buf = scores.pop(r.key, [])
                self.scorer.close(r.key)
                r.teacher_logprobs = (buf + [0.0] * len(r.input_ids))[: len(r.input_ids)]
                msg.finished_at = time.monotonic()
                self.out_q.put(msg)
                ended += 1
        return TeacherReport(busy_s=busy, busy_cpu_s=busy_cpu, turns=turns, positions=positions)

    def run(self, plans: list[RoundPlan]) -> None:
        for plan in plans:
            reset_peak_rss()
            reset_peak_device(self.device)
            report = self.run_round(plan)
            report.peak_rss, report.peak_device = peak_rss_bytes(), peak_device_bytes(self.device)
            self.report_q.put((Report.teacher_round, plan.round, report))


@dataclass(frozen=True)
class TeacherArgs:
    """What OPD's teacher process starts from (rl/train.py Workers)."""

    cfg: TrainConfig
    placement: Placement
    teacher_dir: str
    plans: list[RoundPlan]
    in_q: object  # closed turns and ended trajectories from the rollout process
    out_q: object  # scored turns and trajectories to the learner
    report_q: object


def teacher_main(args: TeacherArgs) -> None:
    init_worker()
    teacher = TeacherWorker(args.cfg, args.teacher_dir, args.in_q, args.out_q, args.report_q, args.placement.teacher)
    args.report_q.put((Report.ready, "teacher", None))
    teacher.run(args.plans)
