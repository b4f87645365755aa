"""OPD's teacher across many open trajectories (rl/teacher_worker.py): a cache per session, turns of
distinct sessions scored in one padded forward (TurnScorer.score_many), and the worker's queue.

The reference is policy.score_tokens (a fresh forward over the turn's whole prefix) and the unbatched
TurnScorer.score: float64 agrees to 1e-12. The simulation drives TeacherWorker.run_round with 128
sessions whose turns arrive interleaved round-robin: with every session's cache kept, the positions
the teacher's forwards cover are each trajectory's tokens once; under the old small cap (LRU) almost
every turn re-scores its prefix.
"""

import queue
import random
from collections import deque

import pytest
import torch

from tsrl_cli.config import load_config
from tsrl_cli.policy import score_tokens
from tsrl_cli.rl.teacher_worker import TeacherWorker, TurnScorer, teacher_cache_bytes
from tsrl_cli.rl.types import GroupSpec, RoundPlan, TrajectoryDone, TurnClosed, TurnScored
from tsrl_cli.rollouts import Rollout

SPANS = [(10, 15), (20, 26), (26, 30), (34, 40)]  # as tests/rl/test_teacher.py: a turn after a tool, one right after


def _ids(model, n, seed):
    rng = random.Random(seed)
    return [rng.randrange(model.config.vocab_size) for _ in range(n)]


def _close(got, want):
    return torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                          rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [3, 7, 64, 1024])
def test_batched_turns_score_as_their_own_forwards(teacher64, chunk):
    """Five trajectories at different turns (so caches of different lengths share a forward, beside ones scored from
    scratch): every turn equals score_tokens and the unbatched scorer, position for position, and each covers the
    same positions; a forward holds at most `chunk` rows x positions."""
    trajs = {k: _ids(teacher64, 40, 10 + k) for k in range(5)}
    batched = TurnScorer(teacher64, chunk_tokens=chunk)
    alone = TurnScorer(teacher64, chunk_tokens=chunk)
    shapes = []
    for step in range(len(SPANS) + 2):
        turns = [(k, t[:SPANS[step - k % 3][1]], *SPANS[step - k % 3]) for k, t in trajs.items()
                 if 0 <= step - k % 3 < len(SPANS)]
        hook = teacher64.register_forward_pre_hook(lambda mod, args, kw: shapes.append(kw["input_ids"].shape),
                                                   with_kwargs=True)
        try:
            got = batched.score_many(turns)
        finally:
            hook.remove()
        for turn, (lp, n) in zip(turns, got, strict=True):
            want, n_alone = alone.score(*turn)
            assert _close(lp, want) and _close(lp, score_tokens(teacher64, turn[1], *turn[2:])) and n == n_alone
    assert max(b * t for b, t in shapes) <= chunk
    if chunk >= 5:
        assert max(b for b, _ in shapes) > 1  # the check covers batched forwards
    assert batched.cached_tokens() == alone.cached_tokens() == 200


def test_a_batch_mixes_fresh_and_broken_prefixes_position_zero_and_empty_turns(teacher64):
    """In one call: a turn from position 0, an empty turn (nothing to score, nothing cached), a trajectory whose
    prefix no longer extends its cache (scored from scratch), and a turn starting right after its cache (its first
    token predicted by the kept logits)."""
    a, b, c, d = (_ids(teacher64, 40, 20 + k) for k in range(4))
    scorer = TurnScorer(teacher64)
    scorer.score_many([("b", b[:15], 10, 15), ("c", c[:26], 20, 26)])
    b2 = list(b)
    b2[2] = (b2[2] + 1) % teacher64.config.vocab_size
    turns = [("a", a[:6], 0, 6), ("d", d[:4], 4, 4), ("b", b2[:26], 20, 26), ("c", c[:30], 26, 30)]
    got = scorer.score_many(turns)
    assert got[1] == ([], 0) and "d" not in scorer.open
    assert got[0][0][0] == 0.0 and got[0][1] == 6 and got[2][1] == 26 and got[3][1] == 4
    for (_, ids, s, e), (lp, _) in zip(turns, got, strict=True):
        assert _close(lp, score_tokens(teacher64, ids, s, e))
    with pytest.raises(ValueError, match="one turn per trajectory"):
        scorer.score_many([("a", a[:15], 10, 15), ("a", a[:26], 20, 26)])


def test_a_turn_waits_when_the_padded_forward_would_pass_the_cap(teacher64):
    """The caches kept and a forward's padded cache (rows x (longest cache + longest turn)) fit max_bytes: a turn that
    would pass it is scored in a forward of its own, with nothing dropped, and the same scores."""
    a, b, c = (_ids(teacher64, 40, 30 + k) for k in range(3))
    scorer = TurnScorer(teacher64, max_bytes=0)
    scorer.max_bytes = 100 * scorer.bytes_per_token
    scorer.score_many([("a", a[:26], 20, 26), ("b", b[:15], 10, 15)])  # 2 x 26 padded, both kept: 41 tokens
    alive, rows = [], []

    def seen(mod, args, kw):
        rows.append(kw["input_ids"].shape[0])
        alive.append(scorer.cached_tokens())

    hook = teacher64.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        got = scorer.score_many([("a", a[:40], 34, 40), ("b", b[:26], 20, 26), ("c", c[:15], 10, 15)])
    finally:
        hook.remove()
    # a and b: 2 x (26 + 14) = 80 padded; with c, 3 x (26 + 15) = 123 > 100: c waits for a forward beside 40 + 26
    assert rows == [2, 1] and alive == [0, 66]
    assert list(scorer.open) == ["a", "b", "c"]
    for (_, ids, s, e), (lp, _) in zip([("a", a, 34, 40), ("b", b, 20, 26), ("c", c, 10, 15)], got, strict=True):
        assert _close(lp, score_tokens(teacher64, ids[:e], s, e))


def test_the_cache_is_sized_for_every_open_session():
    """model.teacher_cache_gib unset: rollout.concurrency full-length trajectories; set: that many GiB."""
    cfg = load_config(None, ["objective=opd", "rollout.concurrency=128", "rollout.max_trajectory_tokens=32768"])
    # Qwen3-32B in bf16: 256 KiB a token, 8 GiB a full-length session, 1 TiB for 128
    assert teacher_cache_bytes(cfg, 256 << 10) == 128 * (8 << 30) == 1 << 40
    assert teacher_cache_bytes(load_config(None, ["model.teacher_cache_gib=9.5"]), 256 << 10) == int(9.5 * 2**30)


# ---------------------------------------------------------------------------- the worker, 128 interleaved sessions

SESSIONS, TURNS, PROMPT, TURN, TOOL = 128, 8, 24, 24, 8  # node8's 128 sessions; turns scaled down to the tiny model


class Bursts:
    """The teacher's in-queue: messages arrive in bursts; get_nowait ends a burst with queue.Empty, and the next
    get() waits for the next burst (the teacher drains what has arrived, scores it, then waits)."""

    def __init__(self, bursts):
        self.bursts = deque(deque(b) for b in bursts if b)

    def get(self):
        return self.bursts[0].popleft()

    def get_nowait(self):
        if not self.bursts[0]:
            self.bursts.popleft()
            raise queue.Empty
        return self.bursts[0].popleft()


class Sink(list):
    put = list.append


def _sessions(vocab):
    """Each session: (input_ids, turn spans): a prompt, then TURNS model turns with a tool's output between them."""
    out = []
    for i in range(SESSIONS):
        rng = random.Random(i)
        ids, spans = [rng.randrange(vocab) for _ in range(PROMPT)], []
        for k in range(TURNS):
            if k:
                ids += [rng.randrange(vocab) for _ in range(TOOL)]
            spans.append((len(ids), len(ids) + TURN))
            ids += [rng.randrange(vocab) for _ in range(TURN)]
        out.append((ids, spans))
    return out


def _round(sets, burst=16):
    """Round-robin arrival: turn k of every session, then turn k + 1 ..., `burst` messages at a time; each
    trajectory's end right after its last turn."""
    sessions = _sessions(128)
    msgs = []
    for k in range(TURNS):
        for i, (ids, spans) in enumerate(sessions):
            e = spans[k][1]
            msgs.append(TurnClosed(1, 0, f"g{i // 8}", i % 8, k, ids[:e], [0] * e, spans[:k + 1], closed_at=0.0,
                                   last=k == TURNS - 1))
    for i, (ids, spans) in enumerate(sessions):
        msgs.append(TrajectoryDone(1, 0, Rollout(f"g{i // 8}", i % 8, ids, [0] * len(ids), 0.0, spans), "t",
                                   "submitted", TURNS, finished_at=0.0))
    cfg = load_config(None, ["objective=opd", "model.dtype=float64", f"rollout.concurrency={SESSIONS}",
                             "rollout.max_trajectory_tokens=512", *sets])
    out = Sink()
    worker = TeacherWorker(cfg, "builtin:tiny-teacher", Bursts([msgs[j:j + burst] for j in range(0, len(msgs), burst)]),
                           out, None, device="cpu")
    plan = RoundPlan(1, tuple(GroupSpec(f"g{g}", f"t/{g}", 8) for g in range(SESSIONS // 8)))
    report = worker.run_round(plan)
    return sessions, worker, out, report


def test_128_interleaved_sessions_cost_each_trajectory_token_once(teacher64):
    """Every session's cache kept (the default: rollout.concurrency full-length trajectories): the teacher's
    positions are the trajectories' tokens once (<= 1.2 asked, 1.0 here); each turn's scores are score_tokens',
    and each trajectory leaves after its turns, in turn order."""
    sessions, worker, out, report = _round([])
    tokens = sum(len(ids) for ids, _ in sessions)
    assert worker.scorer.max_bytes == SESSIONS * 512 * worker.scorer.bytes_per_token
    assert report.turns == SESSIONS * TURNS and report.positions / tokens <= 1.2
    assert report.positions == tokens
    order: dict = {}
    for msg in out:
        key = msg.rollout.key
        if isinstance(msg, TurnScored):
            assert order.setdefault(key, []) == list(range(msg.turn))  # turns in order, before the end
            order[key].append(msg.turn)
        else:
            assert order.pop(key) == list(range(TURNS))
            i = key[1] + 8 * int(key[0][1:])
            ids, spans = sessions[i]
            if i in (0, 77, 127):  # three sessions' every turn against a fresh forward over its prefix
                for s, e in spans:
                    assert _close(msg.rollout.teacher_logprobs[s:e], score_tokens(teacher64, ids[:e], s, e))
    assert not order and len(out) == SESSIONS * (TURNS + 1)


def test_positive_control_a_one_trajectory_cache_rescores_the_prefixes():
    """The same round under a cap of one full-length trajectory's cache (what the teacher kept before it sized
    its caches for every session), dropped least recently used first: round-robin turns find their cache gone
    and re-score their prefixes, about (K + 1)/2 = 4.5x the tokens."""
    sessions, _, _, report = _round(["model.teacher_cache_gib=0"])
    tokens = sum(len(ids) for ids, _ in sessions)
    assert report.positions / tokens > 3.5
