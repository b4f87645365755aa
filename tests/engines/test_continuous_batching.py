"""Continuous batching (engines/batching.py ContinuousBatcher, the hf engine's add/step/running).

A turn's tokens and log-probs do not depend on when it joined the running batch: checked in float64
against the same request run alone and against an independent replay (one full forward of context +
tokens, each token re-drawn from the request's own generator). A turn admitted while a long one runs
returns before it ends (counted in engine steps; the static batcher, the positive control, makes it
wait). The batching figures are recounted from a known schedule.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

from tsrl_cli.engines.batching import ContinuousBatcher, TurnBatcher, make_batcher
from tsrl_cli.engines.batching_stats import quantile_nearest_rank
from tsrl_cli.engines.hf import HFEngine, sample_token
from tsrl_cli.engines.protocol import SamplingParams, TurnOutput, TurnRequest, request_seed
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import build_tiny_model


def request(i: int, ctx_len: int, max_tokens: int, **kw) -> TurnRequest:
    ctx = [(7 * i + 3 * k) % 60 + 2 for k in range(ctx_len)]
    return TurnRequest(ctx, SamplingParams(max_tokens=max_tokens, seed=request_seed(11, i), **kw))


# (step at which it is added, request): context lengths shorter and longer than the running batch's
# cache, stop tokens, top-p, another temperature; some end while others join
SCHEDULE = [
    (0, request(0, 5, 20)),
    (0, request(1, 2, 6)),
    (2, request(2, 11, 9, top_p=0.8)),
    (3, request(3, 1, 14, stop_token_ids=tuple(range(2, 14)))),
    (3, request(4, 3, 4, temperature=0.7)),
    (7, request(5, 24, 12)),
    (8, request(6, 4, 5, stop_token_ids=tuple(range(2, 30)))),
    (12, request(7, 6, 8)),
]


def run_schedule(engine: HFEngine, schedule) -> tuple[dict[int, TurnOutput], list[int]]:
    """Add each request at its step, step until all ended; (outputs by index, running count per step)."""
    out, running, step = {}, [], 0
    while len(out) < len(schedule):
        for i, (at, r) in enumerate(schedule):
            if at == step:
                engine.add(i, r)
        running.append(engine.running())
        out.update(engine.step())
        step += 1
    return out, running


def replay(model, r: TurnRequest, o: TurnOutput) -> tuple[list[int], list[float]]:
    """Independent reference: one forward of context + sampled tokens; each position's token re-drawn by
    sample_token from the request's own generator, its log-prob read from that forward."""
    ids = torch.tensor([r.context_ids + o.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]  # (T, V)
    gen = torch.Generator().manual_seed(r.params.seed)
    n = len(r.context_ids)
    toks, lps = [], []
    for k in range(len(o.token_ids)):
        row = logits[n - 1 + k]
        toks.append(sample_token(row, r.params, gen))
        lps.append(float(torch.log_softmax(row.double(), -1)[o.token_ids[k]]))
    return toks, lps


def test_turns_joining_at_different_steps_equal_each_turn_alone_float64():
    model = build_tiny_model(0, torch.float64)
    eng = HFEngine(model)
    out, running = run_schedule(eng, SCHEDULE)
    assert eng.running() == 0 and max(running) >= 4  # turns really ran side by side
    alone = {i: eng.generate([r])[0] for i, (_, r) in enumerate(SCHEDULE)}
    for i, (_, r) in enumerate(SCHEDULE):
        a, c = alone[i], out[i]
        assert c.token_ids == a.token_ids and c.finish_reason == a.finish_reason, i
        assert max(abs(x - y) for x, y in zip(c.logprobs, a.logprobs, strict=True)) < 1e-9, i
        toks, lps = replay(model, r, c)
        assert toks == c.token_ids, i
        assert max(abs(x - y) for x, y in zip(c.logprobs, lps, strict=True)) < 1e-9, i
    assert {o.finish_reason for o in out.values()} == {"stop", "length"}
    # control: the comparison can fail (another seed, other tokens)
    r0 = SCHEDULE[0][1]
    other = eng.generate([TurnRequest(r0.context_ids, SamplingParams(max_tokens=20, seed=1))])[0]
    assert other.token_ids != out[0].token_ids


def test_batch_invariant_continuous_is_bitwise_alone_float32():
    eng = HFEngine(build_tiny_model(0, torch.float32), batch_invariant=True)
    out, _ = run_schedule(eng, SCHEDULE)
    for i, (_, r) in enumerate(SCHEDULE):
        a = eng.generate([r])[0]
        assert out[i].token_ids == a.token_ids and out[i].logprobs == a.logprobs


class CountingEngine(HFEngine):
    """An hf engine that counts its steps and holds step `hold_at` until `go` is set (`at_hold` says it is
    there), so that a test submits a turn at a known step; `ended_at[first context token]` is the step a
    turn ended in."""

    def __init__(self, *args, hold_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.count, self.hold_at = 0, hold_at
        self.at_hold, self.go = threading.Event(), threading.Event()
        self.ended_at: dict[int, int] = {}
        self._first: dict[int, int] = {}

    def add(self, rid, req):
        self._first[rid] = req.context_ids[0]
        super().add(rid, req)

    def step(self):
        self.count += 1
        if self.count == self.hold_at:
            self.at_hold.set()
            assert self.go.wait(60)
        ended = super().step()
        for rid, _ in ended:
            self.ended_at[self._first[rid]] = self.count
        return ended


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_turn_admitted_while_another_runs_returns_before_it_ends(batching):
    """A 3-token turn submitted during step 5 of a 40-token turn: continuous admits it at step 6 and returns
    it at step 8, while the long turn runs to step 40; static (the control) returns it only after."""
    k, short_len, long_len = 5, 3, 40
    eng = CountingEngine(build_tiny_model(0, torch.float64), hold_at=k)
    long_r = TurnRequest([40, 41, 42], SamplingParams(max_tokens=long_len, seed=1))
    short_r = TurnRequest([50, 51, 52, 53, 54, 55], SamplingParams(max_tokens=short_len, seed=2))
    ref_engine = HFEngine(build_tiny_model(0, torch.float64))
    refs = ref_engine.generate([long_r]) + ref_engine.generate([short_r])
    batcher = make_batcher(eng, max_batch=8, batching=batching)
    order = []

    async def main():
        long_t = asyncio.create_task(batcher.generate(long_r))
        long_t.add_done_callback(lambda _: order.append("long"))
        await asyncio.to_thread(eng.at_hold.wait, 60)  # the engine is inside step k of the long turn
        short_t = asyncio.create_task(batcher.generate(short_r))
        short_t.add_done_callback(lambda _: order.append("short"))
        await asyncio.sleep(0)  # the short turn is on the batcher's queue
        assert batcher._q.qsize() == 1
        eng.go.set()
        return await long_t, await short_t

    try:
        outs = asyncio.run(main())
    finally:
        batcher.close()
    for o, ref in zip(outs, refs, strict=True):
        assert o.token_ids == ref.token_ids
        assert max(abs(x - y) for x, y in zip(o.logprobs, ref.logprobs, strict=True)) < 1e-9
    if batching == "continuous":
        assert isinstance(batcher, ContinuousBatcher)
        assert eng.ended_at == {50: k + short_len, 40: long_len} and order == ["short", "long"]
    else:
        assert isinstance(batcher, TurnBatcher)
        assert eng.ended_at == {40: long_len, 50: long_len + short_len} and order == ["long", "short"]


class ScriptedSteps:
    """A stepping engine without a model: turn i ends after `lengths[i]` steps with that many tokens. Its
    step count is the test's clock."""

    version = 0

    def __init__(self):
        self.clock, self.live = 0, {}

    def add(self, rid, req):
        self.live[rid] = [req.params.max_tokens, req.params.max_tokens]

    def running(self):
        return len(self.live)

    def step(self):
        self.clock += 1
        ended = []
        for rid, left in list(self.live.items()):
            left[0] -= 1
            if left[0] == 0:
                ended.append((rid, TurnOutput([1] * left[1], [0.0] * left[1], "length")))
                del self.live[rid]
        return ended

    def generate(self, requests):  # static: one call runs its batch to the end
        self.clock += max(r.params.max_tokens for r in requests)
        return [TurnOutput([1] * r.params.max_tokens, [0.0] * r.params.max_tokens, "length") for r in requests]


def fifo_recount(lengths: list[int], slots: int) -> dict:
    """The figures of FIFO admission into `slots`, every turn submitted at time 0 and one step a time unit:
    each step admits waiting turns into free slots, then every running turn advances one token."""
    waiting, running, t = list(range(len(lengths))), {}, 0
    waits, per_step, last = [], [], 0
    while waiting or running:
        while waiting and len(running) < slots:
            i = waiting.pop(0)
            running[i] = lengths[i]
            waits.append(t)
        per_step.append(len(running))
        t += 1
        for i in list(running):
            running[i] -= 1
            if running[i] == 0:
                del running[i]
                last = t
    return {"turns": len(lengths), "generated_tokens": sum(lengths), "tokens_per_s": sum(lengths) / last,
            "queue_wait_mean_s": sum(waits) / len(waits),
            "queue_wait_p95_s": sorted(waits)[math.ceil(0.95 * len(waits)) - 1],
            "running_mean": sum(per_step) / len(per_step), "steps": len(per_step)}


LENGTHS = [3, 1, 2, 4, 1, 2, 5, 1]


def submit_paused(batcher, reqs) -> list[TurnOutput]:
    """Submit every request while the batcher is paused (all at clock 0), then let it run."""
    async def main():
        batcher.pause()
        tasks = [asyncio.create_task(batcher.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        batcher.resume()
        return await asyncio.gather(*tasks)

    return asyncio.run(main())


def test_batching_figures_recount_from_a_known_schedule():
    eng = ScriptedSteps()
    batcher = ContinuousBatcher(eng, max_running=3, clock=lambda: eng.clock)
    reqs = [TurnRequest([1], SamplingParams(max_tokens=n)) for n in LENGTHS]
    try:
        outs = submit_paused(batcher, reqs)
        figures = batcher.take_stats()
        assert batcher.take_stats()["turns"] == 0  # taken: the next round starts from nothing
    finally:
        batcher.close()
    assert [len(o.token_ids) for o in outs] == LENGTHS
    assert figures == {"batching": "continuous", **fifo_recount(LENGTHS, 3)}
    assert figures["queue_wait_p95_s"] > 0 and figures["running_mean"] > 1  # a schedule that queues and batches

    # static, one turn per engine call: turn i waits for every turn before it, and calls take max_tokens steps
    eng = ScriptedSteps()
    batcher = TurnBatcher(eng, max_batch=1, clock=lambda: eng.clock)
    try:
        submit_paused(batcher, reqs)
        figures = batcher.take_stats()
    finally:
        batcher.close()
    waits = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    assert figures == {"batching": "static", "turns": len(LENGTHS), "generated_tokens": sum(LENGTHS),
                       "tokens_per_s": 1.0, "queue_wait_mean_s": sum(waits) / len(waits),
                       "queue_wait_p95_s": waits[-1], "running_mean": 1.0, "steps": len(LENGTHS)}


def test_quantile_nearest_rank():
    xs = list(range(1, 21))  # 20 values: p95 is the 19th smallest
    assert quantile_nearest_rank(xs[::-1], 0.95) == 19 and quantile_nearest_rank([4.0], 0.95) == 4.0
    assert quantile_nearest_rank(xs, 0.5) == 10


class FailingSteps(ScriptedSteps):
    """Fails at step `fail_at`, keeping its turns (an engine in an unknown state) unless `drops`."""

    def __init__(self, fail_at: int, drops: bool):
        super().__init__()
        self.fail_at, self.drops = fail_at, drops

    def step(self):
        if self.clock + 1 == self.fail_at:
            self.fail_at = None  # once
            if self.drops:
                self.live.clear()
            raise RuntimeError("device lost")
        return super().step()


@pytest.mark.parametrize("drops", [False, True])
def test_an_engine_failure_fails_every_waiting_and_running_turn(drops):
    eng = FailingSteps(fail_at=2, drops=drops)
    batcher = ContinuousBatcher(eng, max_running=2)
    reqs = [TurnRequest([1], SamplingParams(max_tokens=n)) for n in (1, 5, 5, 5)]

    async def main():
        batcher.pause()
        tasks = [asyncio.create_task(batcher.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        batcher.resume()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        first, *rest = asyncio.run(main())
        assert isinstance(first, TurnOutput)  # ended at step 1, before the failure
        assert all(isinstance(e, RuntimeError) and "device lost" in str(e) for e in rest)  # running and waiting
        later = asyncio.run(main())  # an engine that kept its turns takes no more; one that dropped them does
        if drops:
            assert isinstance(later[0], TurnOutput) and batcher.error is None
        else:
            assert all(isinstance(e, RuntimeError) and "device lost" in str(e) for e in later)
    finally:
        batcher.close()


def test_a_refused_turn_fails_alone():
    eng = HFEngine(build_tiny_model(0, torch.float64))
    batcher = make_batcher(eng, max_batch=4)

    async def main():
        return await asyncio.gather(batcher.generate(TurnRequest([], SamplingParams(max_tokens=3))),
                                    batcher.generate(TurnRequest([5, 6], SamplingParams(max_tokens=3))),
                                    return_exceptions=True)

    try:
        bad, good = asyncio.run(main())
    finally:
        batcher.close()
    assert isinstance(bad, ValueError) and "non-empty context" in str(bad)
    assert isinstance(good, TurnOutput) and len(good.token_ids) == 3


def test_make_batcher_chooses_by_engine_and_setting():
    hf = HFEngine(build_tiny_model(0, torch.float32))
    made = [make_batcher(hf), make_batcher(hf, batching="static"), make_batcher(_GenerateOnly())]
    try:
        assert [type(b) for b in made] == [ContinuousBatcher, TurnBatcher, TurnBatcher]
    finally:
        for b in made:
            b.close()
    with pytest.raises(UsageError, match="rollout.batching"):
        make_batcher(hf, batching="dynamic")


class _GenerateOnly:
    """An engine with generate only (as the scripted one): the static path whatever the setting."""

    def generate(self, requests):
        return []


def test_rollout_batching_is_checked():
    from tsrl_cli.config import ConfigError, load_config

    assert load_config(sets=[], flags={}).rollout.batching == "continuous"
    with pytest.raises(ConfigError, match="rollout.batching"):
        load_config(sets=["rollout.batching=dynamic"], flags={})
