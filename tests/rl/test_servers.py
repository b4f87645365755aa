"""rollout.engine openai: training against OpenAI-compatible servers (`tsrl serve`'s server, here in
this process over the hf engine) generates what the in-process engine does, and survives a server lost
mid-round: named in the log, its requests re-sent, the bus re-formed without it, the rounds exact."""

import json
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from toy_workload import TOY

from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.server import start_server
from tsrl_cli.policy import load_policy
from tsrl_cli.rl.train import train
from tsrl_cli.rl.weightbus import WeightBus

pytestmark = pytest.mark.slow
KEY = "run-key-7"  # every server here wants it: the run must send it on every request, and never save it


def rows(run_dir, name):
    return [json.loads(line) for line in (Path(run_dir) / name).read_text().splitlines()]


def weights(run_dir, k):
    out = {}
    for f in sorted((Path(run_dir) / "checkpoints" / f"round-{k}").glob("*.safetensors")):
        out.update(load_file(f))
    return out


class LostMidRound(HFEngine):
    """An engine whose server is lost at a known moment: it answers `answers` engine calls; on the next
    it shuts its server down (from another thread, as a failing node would go), waits until the server
    has answered the requests in flight with 503, and fails that batch. The server is lost mid-round
    with requests in flight, whatever the machine's load: no poll races the round."""

    answers = 1  # round 1's first batch of b: its next one is in round 1 too (its sessions' later turns)
    server = None  # set once the server exists

    def generate(self, requests):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls <= self.answers:
            return super().generate(requests)
        threading.Thread(target=self.server.shutdown, daemon=True).start()
        t0 = time.monotonic()
        while self.server.in_flight and time.monotonic() - t0 < 60:  # the shutdown answers them with 503
            time.sleep(0.01)
        raise RuntimeError("server is shutting down")


def server(model_dir, engine=HFEngine, batching="continuous"):
    model, tok = load_policy(model_dir, dtype="float64", device="cpu")
    # the server's engine starts from *other* weights: the run's own reach it over the bus at start
    with __import__("torch").no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return start_server(engine(model, pad_id=tok.pad_token_id), join_bus=WeightBus.join, api_key=KEY,
                        batching=batching)


@pytest.fixture(scope="module")
def ref(toy_policies, tmp_path_factory):
    """The in-process engine's run (float64, 2 stream rounds): what every server run must reproduce."""
    from tsrl_cli.config import load_config

    cfg = load_config(sets=[*TOY, "model.dtype=float64", "run.save_rollouts=true",
                            f"run.out={tmp_path_factory.mktemp('ref')}"], flags={"schedule": "stream", "rounds": 2})
    train(cfg)
    return cfg


def test_openai_engine_matches_in_process_and_survives_a_lost_server(toy_config, toy_policies, ref):
    flags = {"model.dtype": "float64", "run.save_rollouts": True}

    # b: lost on its 2nd batch (static batching: LostMidRound counts engine calls); a batches continuously
    a, b = server(toy_policies[0]), server(toy_policies[0], engine=LostMidRound, batching="static")
    b.engine.server = b
    log: list[dict] = []
    try:
        cfg = toy_config("rollout.engine=openai", f"rollout.servers=[{a.url},{b.url}]", f"rollout.server_api_key={KEY}",
                         out="srv", schedule="stream", rounds=2, **flags)
        train(cfg, progress=log.append)
    finally:
        a.shutdown()
        b.shutdown()
    got = {(r["round"], r["group_id"], r["sample_index"]): r["input_ids"]
           for r in rows(cfg.run_dir(), "rollouts.jsonl")}
    want = {(r["round"], r["group_id"], r["sample_index"]): r["input_ids"]
            for r in rows(ref.run_dir(), "rollouts.jsonl")}
    assert len(want) == 16 and got == want
    wa, wb = weights(ref.run_dir(), 2), weights(cfg.run_dir(), 2)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-9
    lines = [e["line"] for e in log if e["event"] == "log"]
    assert any(b.url in line for line in lines) and not any(a.url in line for line in lines), lines
    m = rows(cfg.run_dir(), "metrics.jsonl")
    assert m[0]["replica_requests"][1] > 0  # b answered before it was lost (else the kill tested nothing)
    assert b.engine.calls == LostMidRound.answers + 1 and b.aborted > 0  # lost with requests in flight
    assert m[0]["rollout_engine"] == "OpenAIEngine" and m[1]["weight_sync_hosts"] == 1 and m[1]["weight_sync_s"] > 0
    saved = (Path(cfg.run_dir()) / "config.yaml").read_text()
    assert KEY not in saved and a.url in saved  # the key was sent (the servers answered) but never saved


def test_two_nodes_under_torchrun_with_a_remote_server(toy_config, toy_policies, tmp_path, ref):
    """The multi-node recipe of docs/distributed.md on one machine: `torchrun --nnodes 2 --nproc-per-node 1`
    (two "nodes", one learner rank each) and one `tsrl serve` process as the rollout node: 2 rounds,
    the same tokens as the single-process run and final weights within 1e-9 (float64)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TSRL_API_KEY": KEY}  # the recipe's way: the key in the environment of both sides
    srv = subprocess.Popen([sys.executable, "-m", "tsrl_cli", "serve", "--model", str(toy_policies[0]), "--dtype",
                            "float64", "--port", "0"],
                           cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = []
    try:
        url = srv.stdout.readline().split()[2]  # "tsrl serve: http://127.0.0.1:PORT (model ...)"
        assert url.startswith("http://"), url
        out = tmp_path / "two-nodes"
        sets = [a for s in [*TOY, "model.dtype=float64", "run.save_rollouts=true", "rollout.engine=openai",
                            f"rollout.servers=[{url}]"] for a in ("--set", s)]
        port = str(29900 + os.getpid() % 90)
        for node in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, "-m", "tsrl_cli",
                 "train", *sets, "--learner-devices", "cpu", "--schedule", "stream", "--rounds", "2", "--out", str(out),
                 "--json"], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = [p.communicate(timeout=600) for p in procs]
        for p, (_, err) in zip(procs, results, strict=True):
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in [*procs, srv]:
            if p.poll() is None:
                p.kill()

    def key(r):
        return r["round"], r["group_id"], r["sample_index"]

    assert {key(r): r["input_ids"] for r in rows(out, "rollouts.jsonl")} == \
        {key(r): r["input_ids"] for r in rows(ref.run_dir(), "rollouts.jsonl")}
    wa, wb = weights(ref.run_dir(), 2), weights(out, 2)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-9
    m = rows(out, "metrics.jsonl")
    assert [r["learner_ranks"] for r in m] == [2, 2] and all(r["rollout_engine"] == "OpenAIEngine" for r in m)
    assert KEY not in (out / "config.yaml").read_text()
