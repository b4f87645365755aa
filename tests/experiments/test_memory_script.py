"""experiments/memory_lora.py: the bytes it reports are the bytes the accumulator held.

The independent reference is arithmetic on the adapter shapes: with one open group at most,
stream's extra is 2 float sets of the trainable parameters (S_r, S_1), and the whole accumulator
one more (R). The gradient itself is checked against the lazy path in float64.
"""

import argparse
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="peft is in the dev extra; LoRA rows need it")

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "memory_lora.py"


def _load():
    spec = importlib.util.spec_from_file_location("memory_lora", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**kw):
    base = dict(preset="small", device="cpu", dtype="float64", groups=3, group_size=3, length=24, max_open_groups=1,
                targets=("q_proj", "v_proj"), adv_norm="group", count_only=False, micro=3)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("adv_norm,sets", [("group", 2), ("center", 1)])
def test_measured_buffers_match_the_shapes(adv_norm, sets):
    m = _load()
    real = m.one_mode(_args(adv_norm=adv_norm), lora_rank=4)
    counted = m.one_mode(_args(adv_norm=adv_norm, count_only=True, device="meta"), lora_rank=4)
    assert real["trainable_bytes"] == counted["trainable_bytes"] > 0
    assert real["open_peak_bytes"] == counted["open_peak_bytes"] == sets * real["trainable_bytes"]  # float64 adapters
    assert real["accumulator_peak_bytes"] == (sets + 1) * real["trainable_bytes"]
    # stream == the lazy padded batch; 1e-6 not 1e-9: Qwen3RMSNorm computes in float32 even in a float64
    # model, and padded rows and single rows round differently there (measured 1.6e-7)
    assert real["grad_max_rel_diff"] < 1e-6


def test_attention_adapters_are_smaller_than_all_linear():
    m = _load()
    qv = m.one_mode(_args(count_only=True, device="meta"), lora_rank=8)
    all_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    every = m.one_mode(_args(count_only=True, device="meta", targets=all_linear), lora_rank=8)
    assert qv["open_over_model"] < every["open_over_model"]
