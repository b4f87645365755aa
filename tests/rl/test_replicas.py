"""Engine replicas and the weight bus: replicas change where a request is answered, never what it is;
weights reach the engines over the bus, never through a multiprocessing queue."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tsrl_cli.rl.train import train

pytestmark = pytest.mark.slow


def rows(run_dir, name):
    return [json.loads(line) for line in (Path(run_dir) / name).read_text().splitlines()]


def final_weights(run_dir, k):
    d = Path(run_dir) / "checkpoints" / f"round-{k}"
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_two_replicas_generate_what_one_engine_does(toy_config):
    """float64 hf: one engine and `cpu:2` (two engine processes) give identical token ids for 3 rounds
    and final weights within 1e-9; both replicas answered requests (else the check proves nothing)."""
    runs = {}
    for spec in ("cpu", "cpu:2"):
        cfg = toy_config(out=spec.replace(":", "-"), schedule="stream", rounds=3,
                         **{"model.dtype": "float64", "run.save_rollouts": True, "devices.rollout": spec})
        train(cfg)
        runs[spec] = cfg.run_dir()
    toks = {s: {(r["round"], r["group_id"], r["sample_index"]): r["input_ids"] for r in rows(d, "rollouts.jsonl")}
            for s, d in runs.items()}
    assert len(toks["cpu"]) == 3 * 8 and toks["cpu"] == toks["cpu:2"]
    a, b = final_weights(runs["cpu"], 3), final_weights(runs["cpu:2"], 3)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-9
    ref = final_weights(runs["cpu"], 3)
    init = final_weights(runs["cpu"], 0) if (Path(runs["cpu"]) / "checkpoints" / "round-0").is_dir() else None
    if init is not None:  # the weights moved: equality above is not two untrained copies
        assert max(float((ref[k] - init[k]).abs().max()) for k in ref) > 1e-6
    m = rows(runs["cpu:2"], "metrics.jsonl")
    assert all(r["rollout_replicas"] == 2 and min(r["replica_requests"]) > 0 for r in m), \
        [r["replica_requests"] for r in m]
    assert all(r["weight_sync_hosts"] == 2 and r["weight_sync_bytes"] == 2 * r["weight_bytes"] > 0 for r in m)
    assert all(r["weight_sync_s"] > 0 for r in rows(runs["cpu"], "metrics.jsonl"))


# Every process of a run imports this (PYTHONPATH): it records each message that a multiprocessing
# queue or pipe carries whose pickle, plus the tensors it shares by handle (torch's reducers move
# tensor storages to shared memory and pickle only a handle), holds at least TSRL_AUDIT_MIN bytes.
AUDIT = textwrap.dedent("""
    import os
    from multiprocessing import reduction

    _dumps = reduction.ForkingPickler.dumps.__func__
    _shared = [0]

    def _counting(reducer):
        def reduce(obj):
            n = obj.nbytes() if callable(getattr(obj, "nbytes", None)) else obj.numel() * obj.element_size()
            _shared[0] += n
            return reducer(obj)
        reduce.tsrl_audit = True
        return reduce

    def dumps(cls, obj, protocol=None):
        for t, r in list(cls._extra_reducers.items()):  # torch registers its reducers when imported
            if not getattr(r, "tsrl_audit", False):
                cls._extra_reducers[t] = _counting(r)
        _shared[0] = 0
        buf = _dumps(cls, obj, protocol)
        size = len(buf) + _shared[0]
        if size >= int(os.environ["TSRL_AUDIT_MIN"]):
            import multiprocessing
            with open(os.environ["TSRL_AUDIT_FILE"], "a") as f:
                f.write(f"{multiprocessing.current_process().name} {type(obj).__name__} {size}\\n")
        return buf

    reduction.ForkingPickler.dumps = classmethod(dumps)
""")


def _audited(tmp_path, args, weight_bytes):
    (tmp_path / "audit").mkdir(exist_ok=True)
    (tmp_path / "audit" / "sitecustomize.py").write_text(AUDIT)
    log = tmp_path / "audit.log"
    log.write_text("")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'audit'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TSRL_AUDIT_FILE": str(log), "TSRL_AUDIT_MIN": str(weight_bytes // 2)}
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return log.read_text().splitlines()


@pytest.mark.parametrize("devices", ["cpu:2"])  # the learner side is the same for one engine
def test_no_weights_pass_through_a_queue(toy_policies, tmp_path, devices):
    """A 2-round stream run, every process audited: no message of half the weights' size or more goes
    through a multiprocessing queue. Positive control: the same audit catches a state dict put on a queue."""
    from tsrl_cli.rl.toy import ensure_toy_policy

    path = str(next(ensure_toy_policy("builtin:toy").glob("*.safetensors")))
    weight_bytes = sum(t.numel() * 8 for t in load_file(path).values())  # the run trains in float64
    control = ("import multiprocessing as mp\nfrom safetensors.torch import load_file\n"
               f"sd = {{k: v.double() for k, v in load_file({path!r}).items()}}\n"
               "q = mp.get_context('spawn').Queue(); q.put(sd); q.get(); q.close()\n")
    caught = _audited(tmp_path, [sys.executable, "-c", control], weight_bytes)
    assert caught and caught[0].split()[1] == "dict", caught
    out = tmp_path / "run"
    lines = _audited(tmp_path, [sys.executable, "-m", "tsrl_cli", "train", "--set", "model.policy=builtin:toy",
                                "--set", "data.train=[builtin:echo]", "--set", "model.dtype=float64",
                                "--set", "rollout.prompts_per_round=2", "--set", "rollout.group_size=4",
                                "--set", "rollout.max_turns=2", "--set", "rollout.max_turn_tokens=32",
                                "--rounds", "2", "--schedule", "stream", "--rollout-devices", devices,
                                "--out", str(out), "--json"], weight_bytes)
    assert lines == [], lines
    m = rows(out, "metrics.jsonl")
    assert len(m) == 2 and all(r["weight_bytes"] == weight_bytes and r["weight_sync_s"] > 0 for r in m)


def test_rollout_devices_validation(toy_config):
    from tsrl_cli.devices import rollout_replicas
    from tsrl_cli.errors import UsageError

    assert rollout_replicas(toy_config(**{"devices.rollout": "cpu:3"})) == [("cpu",), ("cpu",), ("cpu",)]
    assert rollout_replicas(toy_config(**{"devices.rollout": "0-3"})) == [(f"cuda:{i}",) for i in range(4)]
    cfg = toy_config("rollout.engine=vllm", "rollout.tensor_parallel=2", "model.dtype=float32",
                     **{"devices.rollout": "0-3"})
    assert rollout_replicas(cfg) == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]
    with pytest.raises(UsageError, match="not a multiple of rollout.tensor_parallel 2"):
        rollout_replicas(toy_config("rollout.engine=vllm", "rollout.tensor_parallel=2", "model.dtype=float32",
                                    **{"devices.rollout": "0-2"}))


def test_weight_bus_buckets_carry_every_tensor_exactly():
    """The bus in one process pair: mixed dtypes, tiny buckets (each tensor its own or shared), equal bits."""
    import multiprocessing as mp

    from tsrl_cli.rl.weightbus import plan_buckets, serve_store

    manifest = [("a", "float64", [3, 4]), ("b", "float32", [7]), ("c", "float32", [2]), ("d", "float64", [1])]
    # a (96 B) alone though over the cap; b and c share one float32 bucket (36 B); d starts a float64 one
    assert plan_buckets(manifest, 40) == [[0], [1, 2], [3]]
    store = serve_store()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(store.port, q))
    p.start()
    from tsrl_cli.rl.weightbus import WeightBus

    bus = WeightBus.join("127.0.0.1", store.port, 0, 2, bucket_bytes=40)
    g = torch.Generator().manual_seed(1)
    src = {"a": torch.randn(3, 4, generator=g, dtype=torch.float64), "b": torch.randn(7, generator=g),
           "c": torch.randn(2, generator=g), "d": torch.randn(1, generator=g, dtype=torch.float64)}
    sent = bus.send(5, src, 1.0)
    bus.send_nothing()
    got, info, nothing = q.get(timeout=120)
    p.join(timeout=60)
    assert info["version"] == 5 and info["bytes"] == sent == sum(t.numel() * t.element_size() for t in src.values())
    assert nothing["version"] is None
    assert got.keys() == src.keys() and all(torch.equal(got[k], src[k]) and got[k].dtype == src[k].dtype for k in src)


def _receiver(port, q):
    from tsrl_cli.rl.weightbus import WeightBus

    bus = WeightBus.join("127.0.0.1", port, 1, 2, bucket_bytes=40)
    got = {}
    info = bus.receive(lambda d: got.update({k: v.clone() for k, v in d.items()}))
    nothing = bus.receive(lambda d: got.update(d))
    q.put((got, info, nothing))
