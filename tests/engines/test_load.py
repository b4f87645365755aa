"""The engine opener (engines/load.py), the engine device (devices.engine_device) and a weight sync into an
engine (engines/weight_sync.py apply_sync).

A machine with GPUs is faked where the device choice is what is checked: torch.cuda.device_count is
what devices.cuda_count asks (through NVML, without initialising CUDA), so patching it is the whole of
that machine's answer. Nothing here moves a tensor to CUDA.
"""

import pytest
import torch

from tsrl_cli.devices import engine_device
from tsrl_cli.engines.hf import HFEngine
from tsrl_cli.engines.load import engine_config, engine_dtype, engine_on_model, open_engine
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.engines.weight_sync import apply_sync
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import build_tiny_model


def gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_engine_device_default_is_the_first_gpu_else_cpu(monkeypatch):
    gpus(monkeypatch, 0)
    assert engine_device(None) == "cpu"
    gpus(monkeypatch, 2)
    assert engine_device(None) == "cuda:0"
    assert engine_device("cuda:1") == engine_device("1") == "cuda:1" and engine_device("cpu") == "cpu"


@pytest.mark.parametrize("spec,n,msg", [
    ("cuda:7", 2, "cuda:7 is not available here (2 CUDA device(s))"),
    ("cuda:0", 0, "sees no CUDA device"),
    ("bogus", 2, "not a device list"),
    ("0-1", 2, "names 2 devices"),
])
def test_engine_device_refuses_a_bad_spec_in_one_line(monkeypatch, spec, n, msg):
    gpus(monkeypatch, n)
    with pytest.raises(UsageError, match="--device") as e:
        engine_device(spec)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_engine_dtype_auto_rule():
    assert engine_dtype("hf", "cuda:0") == "bfloat16" and engine_dtype("hf", "cpu") == "float32"
    assert engine_dtype("vllm", "cuda:0") == "auto"  # vLLM reads the model's config
    assert engine_dtype("hf", "cuda:0", "float64") == "float64"
    with pytest.raises(UsageError, match="float16"):
        engine_dtype("hf", "cpu", "float16")


def test_open_engine_hf_on_the_device_and_dtype_asked(monkeypatch):
    """The hf engine's model is loaded on devices[0] in engine_dtype's dtype; a fake CUDA machine shows the
    request (load_policy is asked for cuda:1 and bfloat16), served here from the CPU."""
    import tsrl_cli.engines.load as opener

    asked, real = [], opener.load_policy

    def on_cpu(model, *, dtype, device, **kw):
        asked.append((device, dtype))
        return real(model, dtype="float32", device="cpu", **kw)

    monkeypatch.setattr(opener, "load_policy", on_cpu)
    engine, device = open_engine("builtin:tiny", "hf", ("cuda:1",))
    assert asked == [("cuda:1", "bfloat16")] and device == "cuda:1" and isinstance(engine, HFEngine)
    engine, device = open_engine("builtin:tiny", "hf", ("cpu",), "float64")
    assert asked[-1] == ("cpu", "float64") and device == "cpu"


def test_open_engine_cpu_for_real():
    engine, device = open_engine("builtin:tiny")
    assert device == "cpu" and engine_config(engine) == {"engine": "hf", "dtype": "float32", "device": "cpu"}
    with pytest.raises(UsageError, match="--engine 'tgi'"):
        open_engine("builtin:tiny", "tgi")


def test_engine_config_names_other_engines_by_class(tok):
    assert engine_config(ScriptedEngine(tok, lambda ctx, k: "")) == {"engine": "ScriptedEngine", "dtype": None,
                                                                     "device": None}


class FakeBus:
    """WeightBus.receive's face: calls apply(bucket) per bucket, returns the sync's info."""

    def __init__(self, buckets, version):
        self.buckets, self.version = buckets, version

    def receive(self, apply):
        for b in self.buckets:
            apply(b)
        return {"version": self.version, "published_at": 1.0, "bytes": 8 * sum(len(b) for b in self.buckets)}


def test_apply_sync_loads_every_bucket_and_sets_the_version_last():
    engine = engine_on_model(build_tiny_model(0, torch.float64))
    source = build_tiny_model(1, torch.float64)  # the weights the learner publishes
    named = dict(source.named_parameters())
    names = sorted(named)
    buckets = [{n: named[n].detach() for n in names[: len(names) // 2]},
               {n: named[n].detach() for n in names[len(names) // 2:]}]
    seen, firsts = [], []
    real_update = engine.update_weights

    def update(bucket, version):  # the engine's version while each bucket is applied
        seen.append(engine.version)
        real_update(bucket, version)

    engine.update_weights = update
    info = apply_sync(engine, FakeBus(buckets, 5).receive, first_bucket=lambda: firsts.append(len(seen)))
    assert info["version"] == 5 == engine.version and seen == [0, 0] and firsts == [0]
    got = dict(engine.model.named_parameters())
    assert all(torch.equal(got[n], named[n]) for n in names)

    info = apply_sync(engine, FakeBus([], None).receive, first_bucket=lambda: firsts.append("again"))
    assert info["version"] is None and engine.version == 5 and firsts == [0]  # nothing newer: untouched


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_sync_that_misses_a_tensor_is_refused_until_a_complete_one(lora):
    """A sync that misses a trained tensor would serve two versions' weights under the new number: it
    raises naming the tensor, the version stays, turns are refused; the next complete sync is served.
    LoRA syncs carry the adapters alone (policy.trainable_state), and only those are required."""
    from tsrl_cli.engines.protocol import SamplingParams, TurnRequest
    from tsrl_cli.policy import trainable_state, wrap_lora

    if lora:
        pytest.importorskip("peft", reason="LoRA needs the peft package (pip install -e '.[lora]')")

    def policy(seed):  # with LoRA the engine and the learner share the base, as a run's do
        m = build_tiny_model(0 if lora else seed, torch.float64)
        return wrap_lora(m, 4, 8.0, ("q_proj", "v_proj"), seed) if lora else m

    engine = engine_on_model(policy(0))
    learner = policy(1)
    with torch.no_grad():  # adapters start with B = 0: give them weights that change the samples
        for n, p in learner.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(n)))
    sent = trainable_state(learner)
    n_params = len(dict(learner.named_parameters()))
    assert len(sent) < n_params if lora else len(sent) == n_params
    names = sorted(sent)
    turn = [TurnRequest([1, 2, 3], SamplingParams(max_tokens=6, seed=7))]
    before = engine.generate(turn)[0]

    dropped = names[-1]
    with pytest.raises(RuntimeError, match=f"missed 1 of the model's {len(names)} tensors \\(first: {dropped}\\)"):
        apply_sync(engine, FakeBus([{n: sent[n] for n in names[:-1]}], 6).receive)
    assert engine.version == 0
    with pytest.raises(RuntimeError, match="turns are refused until a sync carries them all"):
        engine.generate(turn)

    info = apply_sync(engine, FakeBus([{n: sent[n] for n in names[:2]}, {n: sent[n] for n in names[2:]}], 7).receive)
    assert info["version"] == 7 == engine.version
    after = engine.generate(turn)[0]
    reference = engine_on_model(learner).generate(turn)[0]  # the learner's own weights, served directly
    assert after.token_ids == reference.token_ids and after.logprobs == pytest.approx(reference.logprobs, abs=1e-12)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-6)  # control: the sync changed what is served


class CapturedVLLM:
    """VLLMEngine's constructor, recording the CUDA_VISIBLE_DEVICES it would start under (vLLM reads it then)."""

    seen: list = []

    def __init__(self, model, dtype="auto", seed=0, **kwargs):
        import os

        CapturedVLLM.seen.append((os.environ.get("CUDA_VISIBLE_DEVICES"), kwargs.get("tensor_parallel_size")))


@pytest.mark.parametrize("inherited,devices,expected", [
    ("2,3,6,7", ("cuda:1", "cuda:2"), "3,6"),  # a scheduler's allocation: entries 1 and 2, not GPUs 1 and 2
    ("GPU-aaaa,GPU-bbbb,GPU-cccc", ("cuda:2",), "GPU-cccc"),
    ("MIG-aaaa,MIG-bbbb", ("cuda:1",), "MIG-bbbb"),
    (None, ("cuda:1", "cuda:2"), "1,2"),  # unset: cuda:k is GPU k
])
def test_a_vllm_engine_on_gpus_sees_the_inherited_entries(monkeypatch, inherited, devices, expected):
    import tsrl_cli.engines.load as opener

    monkeypatch.setattr(opener, "VLLMEngine", CapturedVLLM)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after the test, as CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", inherited or "")  # recorded, so the engine's value is undone after
    if inherited is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    CapturedVLLM.seen = []
    engine, device = open_engine("unused", "vllm", devices)
    tp = len(devices) if len(devices) > 1 else None
    assert CapturedVLLM.seen == [(expected, tp)] and device == "cuda:0"  # vLLM then sees them as cuda:0..


def test_a_vllm_engine_beyond_the_inherited_list_is_refused_before_vllm_starts(monkeypatch):
    import tsrl_cli.engines.load as opener

    monkeypatch.setattr(opener, "VLLMEngine", CapturedVLLM)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    CapturedVLLM.seen = []
    with pytest.raises(UsageError) as e:
        open_engine("unused", "vllm", ("cuda:2",), key="devices.rollout")
    assert str(e.value).startswith("devices.rollout: cuda:2 is entry 2") and "lists 2 (2,3)" in str(e.value)
    assert CapturedVLLM.seen == [] and opener.os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # nothing changed
