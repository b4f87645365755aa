"""Remote rollout servers: `tsrl serve` (engines/server.py) and the openai engine (engines/openai.py).

Every check compares with a reference computed without HTTP: the same float64 model called directly
through HFEngine (batch-invariant, so a turn is bitwise a function of weights, context, params and
seed). Positive controls: another seed gives other tokens; after a sync the tokens differ from the old
weights'; a server shut down mid-round really had requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.openai import OpenAIEngine
from tsrl_cli.engines.protocol import SamplingParams, TurnRequest, request_seed
from tsrl_cli.engines.server import start_server
from tsrl_cli.errors import OperationFailed
from tsrl_cli.policy import build_tiny_model
from tsrl_cli.rl.weightbus import WeightBus, serve_store

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def engine(seed: int = 0) -> HFEngine:
    return HFEngine(build_tiny_model(seed, torch.float64), batch_invariant=True)


class SlowEngine(HFEngine):
    """An hf engine that takes its time: generation (a request in flight at shutdown) and weight updates
    (completions arriving while a sync applies its buckets)."""

    gen_delay_s = 0.0
    update_delay_s = 0.0

    def generate(self, requests):
        time.sleep(self.gen_delay_s)
        return super().generate(requests)

    def update_weights(self, named_tensors, version):
        time.sleep(self.update_delay_s)
        super().update_weights(named_tensors, version)


def slow(gen_delay_s=0.0, update_delay_s=0.0) -> SlowEngine:
    e = SlowEngine(build_tiny_model(0, torch.float64), batch_invariant=True)
    e.gen_delay_s, e.update_delay_s = gen_delay_s, update_delay_s
    return e


class HeldEngine(HFEngine):
    """An hf engine whose first call (an engine call of the static batcher, a step of the continuous one)
    waits, so that a test acts at a known moment instead of racing a delay: `entered` is set once that
    call is inside the engine, and it waits for `go()` to be true."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.go, self.calls = threading.Event(), (lambda: True), 0

    def _hold(self) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            t0 = time.monotonic()
            while not self.go() and time.monotonic() - t0 < 60:
                time.sleep(0.005)

    def generate(self, requests):
        self._hold()
        return super().generate(requests)

    def step(self):
        self._hold()
        return super().step()


def held() -> HeldEngine:
    return HeldEngine(build_tiny_model(0, torch.float64), batch_invariant=True)


def requests(n: int = 16, max_tokens: int = 12) -> list[TurnRequest]:
    """Seeded turns at temperature 1 with top_p 1 and 0.8; half may stop early on one of 8 stop tokens."""
    return [TurnRequest([3 + i, 9, 11, 13, 2 * i + 1][: 2 + i % 4],
                        SamplingParams(temperature=1.0, top_p=(1.0, 0.8)[i % 2], max_tokens=max_tokens,
                                       seed=request_seed(7, i), stop_token_ids=tuple(range(8)) if i % 4 < 2 else ()))
            for i in range(n)]


def run_sessions(client, reqs, tasks: int = 8):
    """`tasks` asyncio sessions, each sending its share of `reqs` one after another (like agent loops)."""
    async def main():
        outs = [None] * len(reqs)

        async def session(k):
            for i in range(k, len(reqs), tasks):
                outs[i] = await client.generate(reqs[i])

        await asyncio.gather(*(session(k) for k in range(tasks)))
        return outs

    return asyncio.run(main())


def assert_same(outs, refs):
    for o, r in zip(outs, refs, strict=True):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs, strict=True)) < 1e-12
        assert o.policy_version == r.policy_version


def post(url, body, opener=NO_PROXY):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def servers():
    """servers(engine, ...) starts a server on an OS-chosen port; all are shut down after the test."""
    started = []

    def make(eng, **kw):
        started.append(start_server(eng, model_name="tiny", **kw))
        return started[-1]

    yield make
    for s in started:
        s.shutdown()


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_server_gives_the_engines_turns_to_concurrent_sessions(servers, batching):
    reqs = requests()
    refs = engine().generate(reqs)
    eng = held()
    srv = servers(eng, batching=batching)
    if batching == "static":  # the first engine call computes once it holds two requests, or two more wait behind it
        eng.go = lambda: srv.batcher.batches[0] > 1 or srv.batcher._q.qsize() >= 2
    else:  # the first step computes once two more requests wait: the next step admits them beside the running
        eng.go = lambda: srv.batcher._q.qsize() >= 2
    client = OpenAIEngine([srv.url], log=print)
    outs = run_sessions(client, reqs)
    assert_same(outs, refs)
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # both endings crossed the wire
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)
    # concurrent HTTP requests shared engine calls (static) or steps (continuous)
    assert max(srv.batcher.batches) > 1 if batching == "static" else srv.batcher.peak_running > 1
    other = asyncio.run(client.generate(replace(reqs[0], params=replace(reqs[0].params, seed=1))))
    assert other.token_ids != outs[0].token_ids  # the comparison can fail: the seed matters
    client.close()


def test_reply_shape_health_and_models(servers):
    srv = servers(engine())
    status, reply = post(f"{srv.url}/v1/completions", {"model": "tiny", "prompt": [[5, 6, 7]], "max_tokens": 4,
                                                         "seed": 3, "logprobs": 0, "return_token_ids": True})
    assert status == 200 and reply["object"] == "text_completion" and reply["policy_version"] == 0
    ch = reply["choices"][0]
    ref = engine().generate([TurnRequest([5, 6, 7], SamplingParams(max_tokens=4, seed=3))])[0]
    assert ch["token_ids"] == ref.token_ids and ch["finish_reason"] == "length"
    assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    assert ch["logprobs"]["token_logprobs"] == ref.logprobs  # JSON floats round-trip exactly
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    with NO_PROXY.open(f"{srv.url}/health", timeout=10) as r:
        assert r.status == 200
    with NO_PROXY.open(f"{srv.url}/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny"]


@pytest.mark.parametrize("body,field", [
    ({"prompt": "print hello"}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1], "temperature": "hot"}, "temperature"),
    ({"prompt": [1], "top_p": 0}, "top_p"),
    ({"prompt": [1], "seed": 1.5}, "seed"),
    ({"prompt": [1], "stop_token_ids": "2"}, "stop_token_ids"),
    ({"prompt": [1], "logprobs": -1}, "logprobs"),
    ({"prompt": [1], "n": 2}, "n"),
])
def test_bad_request_is_400_naming_the_field(servers, body, field):
    srv = servers(engine())
    status, reply = post(f"{srv.url}/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == field
    assert reply["error"]["message"].startswith(f"{field}:")


def test_client_raises_a_bad_request_without_failing_over(servers):
    srv = servers(engine())
    logs = []
    client = OpenAIEngine([srv.url], log=logs.append)
    with pytest.raises(OperationFailed, match="HTTP 400: prompt: empty"):
        asyncio.run(client.generate(TurnRequest([], SamplingParams())))
    assert client.dead == {} and logs == []


def test_failover_gives_the_healthy_servers_turns(servers):
    reqs = requests(8, max_tokens=8)
    healthy = servers(engine())
    refs = run_sessions(OpenAIEngine([healthy.url]), reqs)

    # down before the round: connection refused
    gone = servers(engine())
    gone.shutdown()
    logs = []
    outs = run_sessions(OpenAIEngine([gone.url, healthy.url], log=logs.append), reqs)
    assert_same(outs, refs)
    assert len(logs) == 1 and gone.url in logs[0] and "cannot connect" in logs[0]

    # down while requests are in flight: they are answered 503 and re-sent
    dying_engine = held()
    dying = servers(dying_engine)
    dying_engine.go = lambda: dying.aborted > 0  # held inside the engine until the shutdown answered them
    logs = []
    client = OpenAIEngine([dying.url, healthy.url], log=logs.append)

    async def round_with_a_shutdown():
        sessions = asyncio.ensure_future(asyncio.to_thread(run_sessions, client, reqs))
        await asyncio.to_thread(dying_engine.entered.wait, 60)  # a batch is inside dying's engine, held there
        await asyncio.to_thread(dying.shutdown)
        return await sessions

    outs = asyncio.run(round_with_a_shutdown())
    assert dying.aborted > 0  # the in-flight path ran
    assert_same(outs, refs)
    assert len(logs) == 1 and dying.url in logs[0]  # HTTP 503, or a reset for a connection caught mid-accept

    # none left: the error names every server and its cause
    healthy.shutdown()
    client = OpenAIEngine([dying.url, healthy.url], log=logs.append)
    with pytest.raises(OperationFailed) as e:
        asyncio.run(client.generate(reqs[0]))
    assert dying.url in str(e.value) and healthy.url in str(e.value) and "cannot connect" in str(e.value)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_weight_sync_over_the_bus(servers, batching):
    store = serve_store()
    eng = slow(update_delay_s=0.03)  # ~0.5 s of bucket updates for completions to run into
    srv = servers(eng, join_bus=WeightBus.join, batching=batching)
    client = OpenAIEngine([srv.url])
    reqs = requests(4, max_tokens=8)
    old = engine().generate(reqs)

    new_model = build_tiny_model(0, torch.float64)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    new = [replace(o, policy_version=7) for o in HFEngine(new_model, batch_invariant=True).generate(reqs)]
    assert [o.token_ids for o in new] != [o.token_ids for o in old]  # the weights change the samples

    client.join_bus("127.0.0.1", store.port, first_rank=1, world=2, backend="gloo")
    bus = WeightBus.join("127.0.0.1", store.port, 0, 2, "gloo", bucket_bytes=16 << 10)  # many buckets
    seen = []  # completions sent while the sync runs: each must be wholly old or wholly new

    def keep_asking(stop: threading.Event):
        c = OpenAIEngine([srv.url])
        while not stop.is_set():
            seen.append(run_sessions(c, reqs, tasks=4))

    stop = threading.Event()
    with ThreadPoolExecutor(2) as ex:
        asking = ex.submit(keep_asking, stop)
        while not seen:  # one round on the old weights first
            time.sleep(0.01)
        syncing = ex.submit(client.sync)
        sent = bus.send(7, {n: p.detach() for n, p in new_model.named_parameters()}, time.time())
        (reply,) = syncing.result(timeout=60)
        stop.set()
        asking.result(timeout=60)
    assert reply["version"] == 7 and reply["bytes"] == sent and reply["start"] <= reply["end"]
    assert client.weights_status()[0]["joined"] and srv.engine.version == 7
    assert_same(run_sessions(client, reqs), new)
    for outs in seen:
        for o, a, b in zip(outs, old, new, strict=True):
            assert_same([o], [a if o.policy_version == 0 else b])

    # a header without weights (the learner had nothing newer) leaves the version alone
    with ThreadPoolExecutor(1) as ex:
        syncing = ex.submit(client.sync)
        bus.send(None, {}, time.time())
        assert syncing.result(timeout=60)[0]["version"] is None
    assert srv.engine.version == 7


def test_weight_endpoints_without_a_bus(servers):
    srv = servers(engine())
    status, reply = post(f"{srv.url}/tsrl/weights/join", {"host": "127.0.0.1", "port": 1, "rank": 1, "world": 2})
    assert status == 501 and "weight bus" in reply["error"]["message"]


def test_tsrl_serve_bad_input_is_one_error_line(tmp_path):
    for args, word in ([["--model", str(tmp_path / "nonexistent")], "not a model directory"],
                       [["--model", str(tmp_path), "--engine", "tgi"], "--engine"],
                       [["--model", str(tmp_path), "--dtype", "float16"], "--dtype"],
                       [["--model", str(tmp_path), "--batching", "dynamic"], "--batching"]):
        res = CliRunner().invoke(app, ["serve", *args])
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2, res.output
        assert len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], lines
        assert res.stdout == "" and "Traceback" not in res.output
