"""One weight sync into an engine: apply_sync takes a sync's buckets from the weight bus into any engine
(train's engines and `tsrl serve` alike); sync_gap names the tensors a sync missed, for which an engine
refuses turns until a complete sync arrives.
"""

from __future__ import annotations

from collections.abc import Callable

from tsrl_cli.engines.protocol import PolicyEngine


def apply_sync(engine: PolicyEngine, receive: Callable[[Callable[[dict], None]], dict],
               first_bucket: Callable[[], None] = lambda: None) -> dict:
    """Take one weight sync into `engine`: `receive(apply)` (rl/weightbus.py WeightBus.receive) calls
    apply(named tensors) per bucket as it arrives, and each bucket goes straight into update_weights;
    an engine that must see a whole version before serving it (vllm: one reload of all buckets) has
    `finish_weights()`, called once after the last bucket.
    The engine keeps its old version until the last bucket is in, then takes the sync's; a version None
    (the learner had nothing newer) leaves it as it was. `first_bucket()` runs before the first bucket
    is applied (`tsrl serve` pauses its batcher there). Returns receive's {"version", "bytes", ...}."""
    started = False

    def apply(bucket: dict) -> None:
        nonlocal started
        if not started:
            first_bucket()
            started = True
        engine.update_weights(bucket, engine.version)

    info = receive(apply)
    if started and hasattr(engine, "finish_weights"):
        engine.finish_weights()
    if info["version"] is not None:
        engine.version = info["version"]
    return info


def sync_gap(expected: set[str], received: set[str]) -> str | None:
    """Why an engine must refuse turns after a weight sync that carried `received` of the `expected` tensor
    names (it would serve two versions' weights under one number), or None when none is missing. An engine
    raises it from finish_weights and refuses turns with it until a complete sync (HFEngine, VLLMEngine)."""
    missing = sorted(expected - received)
    if not missing:
        return None
    return (f"a weight sync missed {len(missing)} of the model's {len(expected)} tensors (first: {missing[0]}); "
            "turns are refused until a sync carries them all")
