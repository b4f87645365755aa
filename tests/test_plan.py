"""`tsrl plan`: the memory plan from a config.json alone.

The learner's and the teacher's figures are PyTorch's memory tracker over fake tensors; here they are checked
against the same tracker over real tensors (tiny Qwen3s from policy.tiny_qwen3_config, two sizes, within 10 %),
against the physics they must show (the full-vocabulary logits, what checkpointing and chunking remove, 1/N of the
state on N ranks, the teacher's key/value cache), and the arithmetic beside them (buffer sets, micro-batch rows,
vLLM's key/value and LoRA bytes, the CUDA allowance, the stated host) against hand counts.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tsrl_cli import plan as plan_mod
from tsrl_cli.cli import app
from tsrl_cli.config import LoRAConfig, load_config
from tsrl_cli.memtrace import LearnerShape, inference, learner_pass, optimizer_step, teacher_scoring
from tsrl_cli.plan import (
    CUDA_RUNTIME_BYTES,
    buffer_sets,
    kv_bytes_per_token,
    kv_shortfall,
    microbatch_rows,
    pinned_block_bytes,
    plan_experiment,
    vllm_lora,
)
from tsrl_cli.policy import build_from_config, model_config, tiny_qwen3_config
from tsrl_cli.rl.teacher_worker import CACHE_BYTES

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "experiments" / "node8" / "models"
runner = CliRunner()
# two CPU scales: (config, micro-batch rows, width)
SCALES = {"small": (dict(vocab_size=512, hidden=64, layers=2, max_positions=1024), 2, 256),
          "larger": (dict(vocab_size=4096, hidden=128, layers=4, max_positions=2048), 1, 1024)}


def rel(a: int, b: int) -> float:
    return abs(a - b) / b


@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize("settings", [
    dict(),
    dict(checkpointing=True, chunk_tokens=96, entropy=True, passes=2, buffer_dtype=torch.float64),
    dict(lora=LoRAConfig(rank=4), checkpointing=True, master_dtype=torch.float64),
], ids=["plain", "ckpt-chunk-entropy-2pass", "lora"])
@pytest.mark.slow
def test_fake_tensor_figure_equals_the_tracker_on_real_tensors(scale, settings):
    cfg, rows, width = SCALES[scale]
    s = LearnerShape(rows=rows, width=width, dtype=torch.float32, **settings)
    fake, real = learner_pass(tiny_qwen3_config(**cfg), s), learner_pass(tiny_qwen3_config(**cfg), s, fake=False)
    assert rel(fake.pass_peak, real.pass_peak) <= 0.10, (fake.pass_peak, real.pass_peak)
    assert (fake.param_bytes, fake.buffer_numel, fake.opt_shapes) == (real.param_bytes, real.buffer_numel,
                                                                      real.opt_shapes)
    step = [optimizer_step(fake.opt_shapes, torch.float32, foreach=True, fake=f) for f in (True, False)]
    assert rel(*step) <= 0.10, step
    inf = [inference(tiny_qwen3_config(**cfg), torch.float32, rows, width, cache=True, fake=f)[0]
           for f in (True, False)]
    assert rel(*inf) <= 0.10, inf


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_teacher_fake_figure_equals_the_tracker_on_real_tensors(scale):
    """The teacher's costliest forward (TurnScorer's last chunk over a cached prefix) on fake and real tensors,
    with chunks of 64 positions so that the prefix is cached first and the chunk extends it."""
    cfg, _, width = SCALES[scale]
    fake, real = (teacher_scoring(tiny_qwen3_config(**cfg), torch.float32, width, width // 4, chunk_tokens=64, fake=f)
                  for f in (True, False))
    assert rel(fake.peak, real.peak) <= 0.10, (fake.peak, real.peak)
    assert (fake.param_bytes, fake.others_bytes) == (real.param_bytes, real.others_bytes)


def test_the_teachers_figure_holds_its_cache_and_one_chunk_of_logits():
    """Physics: the scored prefix's keys and values (2 x layers x KV heads x head_dim x 4 bytes per position) and
    the last chunk's logits with their float32 log-softmax, never the whole turn's logits; a positive control
    for the chunking: chunks as long as the turn hold the turn's logits, about 2 x turn x V x 4 bytes more."""
    cfg = tiny_qwen3_config(vocab_size=16384, hidden=64, layers=2, max_positions=4096)
    T, turn, V = 2048, 1024, 16384
    kv = 2 * 2 * 2 * 16 * 4 * T
    small = teacher_scoring(cfg, torch.float32, T, turn, chunk_tokens=64)
    scoring = small.peak - small.param_bytes
    assert kv + 2 * 64 * V * 4 <= scoring < kv + 4 * 64 * V * 4 + (1 << 20)
    whole = teacher_scoring(cfg, torch.float32, T, turn, chunk_tokens=turn)
    assert whole.peak - small.peak > 2 * (turn - 64) * V * 4 * 0.9
    assert small.others_bytes == CACHE_BYTES - kv  # the rest of the byte cap may hold other trajectories' caches


def test_positive_control_the_10_percent_check_catches_a_mistraced_micro_batch():
    cfg, rows, width = SCALES["larger"]
    s = LearnerShape(rows=rows, width=width, dtype=torch.float32, chunk_tokens=128)
    wrong = LearnerShape(rows=rows, width=width + width // 4, dtype=torch.float32, chunk_tokens=128)  # 25 % longer rows
    fake, real = learner_pass(tiny_qwen3_config(**cfg), wrong), learner_pass(tiny_qwen3_config(**cfg), s, fake=False)
    assert rel(fake.pass_peak, real.pass_peak) > 0.10


@pytest.mark.slow
def test_the_traced_peak_shows_the_logits_and_what_chunking_and_checkpointing_remove():
    """Physics, not the tracker's word: without chunking the float32 logits and their log-softmax, 2 x T x V x 4
    bytes, are alive together; with chunks of C positions no such tensor is; checkpointing keeps one layer's
    activations instead of all of them."""
    cfg = tiny_qwen3_config(vocab_size=16384, hidden=64, layers=4, max_positions=2048)
    T, V = 1024, 16384
    full = learner_pass(cfg, LearnerShape(rows=1, width=T, dtype=torch.float32))
    assert full.pass_peak >= 2 * T * V * 4
    chunked = learner_pass(cfg, LearnerShape(rows=1, width=T, dtype=torch.float32, chunk_tokens=64))
    assert chunked.pass_peak < full.pass_peak - T * V * 4
    wide = tiny_qwen3_config(vocab_size=256, hidden=64, layers=8, max_positions=2048)
    plain = learner_pass(wide, LearnerShape(rows=1, width=T, dtype=torch.float32)).parts["Activation"]
    shape = LearnerShape(rows=1, width=T, dtype=torch.float32, checkpointing=True)
    ckpt = learner_pass(wide, shape).parts["Activation"]
    assert ckpt < plain / 2


def test_a_group_rank_holds_a_shard_of_the_state():
    """FSDP2 on a fake process group: rank 0 of 4 holds 1/4 of every parameter (dim 0 padded to a multiple of 4),
    and one buffer set is that many elements (counted here by hand from the unsharded model)."""
    cfg = tiny_qwen3_config(vocab_size=1000, hidden=64, layers=2, max_positions=512)
    one = learner_pass(cfg, LearnerShape(rows=1, width=128, dtype=torch.float32))
    four = learner_pass(cfg, LearnerShape(rows=1, width=128, dtype=torch.float32, world=4))
    model = build_from_config(cfg)
    by_hand = sum(-(-p.shape[0] // 4) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert four.buffer_numel == by_hand == four.param_numel
    assert abs(four.param_numel * 4 - one.param_numel) <= 4 * sum(p.numel() // p.shape[0] for p in model.parameters())
    assert four.pass_peak < one.pass_peak


def test_buffer_sets_are_docs_arithmetic():
    base = load_config(None, ["rollout.prompts_per_round=16", "rollout.group_size=8"])
    assert buffer_sets(base) == 1 + 2 * 16  # GRPO, group normalization, every group open
    assert buffer_sets(load_config(None, ["rollout.prompts_per_round=16", "loss.max_open_groups=4"])) == 9
    assert buffer_sets(load_config(None, ["rollout.prompts_per_round=16", "loss.adv_norm=center"])) == 17
    assert buffer_sets(load_config(None, ["schedule=sync"])) == 1
    assert buffer_sets(load_config(None, ["objective=opd"])) == 1  # token-mean: every turn's scalar is known
    opd = ["objective=opd", "loss.loss_agg=seq-mean-token-mean", "rollout.prompts_per_round=2",
           "rollout.group_size=4"]
    assert buffer_sets(load_config(None, opd)) == 1  # learner.opd_unit trajectory: one row into R at each end
    turn = [*opd, "learner.opd_unit=turn"]  # per-turn backwards: a unit buffer per open trajectory
    assert buffer_sets(load_config(None, turn)) == 1 + 8
    assert buffer_sets(load_config(None, [*turn, "loss.max_open_groups=3"])) == 4


def test_microbatch_rows_follow_the_learner_caps():
    cfg = load_config(None, ["rollout.prompts_per_round=4", "rollout.group_size=8",
                             "learner.max_microbatch_tokens=4096"])
    assert microbatch_rows(cfg, world=1, width=1024) == 1  # one CPU process streams one arrival at a time
    assert microbatch_rows(cfg, world=2, width=1024) == 4  # a group micro-batches: 4096 // 1024
    assert microbatch_rows(load_config(None, ["schedule=sync", "rollout.prompts_per_round=4"]), 1, 1024) == 32
    capped = load_config(None, ["learner.microbatch='on'", "learner.max_microbatch_items=3"])
    assert microbatch_rows(capped, world=1, width=64) == 3


def test_kv_bytes_per_token_is_vllms_formula_for_qwen3_8b():
    cfg = model_config(MODELS / "Qwen3-8B")
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 36 * 8 * 128 * 2 == 147_456
    assert kv_bytes_per_token(cfg, torch.bfloat16, tp=2) == 147_456 // 2
    assert kv_bytes_per_token(cfg, torch.bfloat16, tp=16) == 2 * 36 * 1 * 128 * 2  # at least one KV head per rank


def test_committed_configs_have_the_published_sizes():
    """The committed config.json files build Qwen's published sizes (model cards: 1.7B with 1.4B non-embedding,
    8.2B with 6.95B, 32.8B with 31.2B; non-embedding leaves out the embedding and an untied LM head)."""
    for name, total, body in (("Qwen3-1.7B", 1.7, 1.4), ("Qwen3-8B", 8.2, 6.95), ("Qwen3-32B", 32.8, 31.2)):
        with torch.device("meta"):
            model = build_from_config(model_config(MODELS / name), torch.bfloat16)
        n = sum(p.numel() for p in model.parameters()) / 1e9
        emb = sum({id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(),
                                                             model.get_output_embeddings())}.values()) / 1e9
        assert abs(n - total) < 0.06 and abs(n - emb - body) < 0.06, (name, n, n - emb)


def _tiny_experiment(tmp_path, **keys) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    tiny_qwen3_config(vocab_size=512, hidden=64, layers=2, max_positions=512).to_json_file(str(folder / "config.json"))
    doc = {"model": {"policy": "builtin:toy", "policy_config": str(folder)},
           "rollout": {"max_trajectory_tokens": 256, "prompts_per_round": 2, "group_size": 2}, **keys}
    f = tmp_path / "exp.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_plan_of_a_cpu_experiment_json_and_exit_codes(tmp_path):
    exp = _tiny_experiment(tmp_path)
    res = runner.invoke(app, ["plan", str(exp), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) == {"processes", "fits"} and doc["fits"] is True
    names = [p["name"] for p in doc["processes"]]
    assert names == ["learner", "rollout"]
    for p in doc["processes"]:
        assert {"name", "device", "peak_bytes", "capacity_bytes", "fits"} <= set(p) and p["device"] == "cpu"
        assert p["device_bytes"] == sum(q["peak_bytes"] for q in doc["processes"])  # one device, shared
    tight = runner.invoke(app, ["plan", str(exp), "--json", "--host-gib", "0.001"])
    assert tight.exit_code == 1 and json.loads(tight.stdout)["fits"] is False
    human = runner.invoke(app, ["plan", str(exp)])
    assert human.exit_code == 0 and "Every process fits" in human.stdout and "learner" in human.stdout


def test_a_group_on_gpus_plans_every_rank_and_the_host(tmp_path):
    cfg = load_config(_tiny_experiment(tmp_path), ["devices.learner=4-5", "devices.rollout=0-1",
                                                    "loss.buffer_device=cpu"])
    doc = plan_experiment(cfg, capacity_gib=3.0, host_gib=4.0)
    by = {p["name"]: p for p in doc["processes"]}
    assert set(by) == {"learner-0", "learner-1", "engine-0", "engine-1", "host"}
    assert by["learner-0"]["device"] == "cuda:4" and by["learner-0"]["parts"]["streaming_buffers"] == 0
    host = by["host"]["parts"]
    sets, set_bytes = by["learner-0"]["counts"]["buffer_sets"], by["learner-0"]["parts"]["buffer_set"]
    assert host["learner_pinned_buffers"] == 2 * sets * set_bytes  # the buffers moved to host memory, both ranks
    assert by["learner-0"]["capacity_bytes"] == 3 << 30 and doc["fits"] is True
    for name in ("learner-0", "engine-0"):  # every CUDA process carries the runtime allowance beside its tensors
        p = by[name]
        assert p["parts"]["cuda_runtime"] == CUDA_RUNTIME_BYTES
        traced = p["parts"]["prefill"] + p["parts"]["weights"] if name == "engine-0" else \
            max(p["parts"]["pass"], p["parts"]["step"])
        assert p["peak_bytes"] - CUDA_RUNTIME_BYTES == traced
    assert "cuda_runtime" not in by["host"]["parts"]
    assert plan_experiment(cfg, capacity_gib=2.0, host_gib=4.0)["fits"] is False  # the allowance alone is 2 GiB


def test_the_host_is_the_stated_one_unless_the_flag_says_otherwise(tmp_path):
    exp = _tiny_experiment(tmp_path)
    stated = plan_experiment(load_config(exp, ["devices.host_memory_gib=3.5"]))
    assert {p["capacity_bytes"] for p in stated["processes"]} == {int(3.5 * 2**30)}
    assert stated["processes"][0]["capacity"] == "devices.host_memory_gib"
    flag = plan_experiment(load_config(exp, ["devices.host_memory_gib=3.5"]), host_gib=0.001)
    assert flag["fits"] is False and flag["processes"][0]["capacity"] == "--host-gib"
    res = runner.invoke(app, ["plan", str(exp), "--json", "--set", "devices.host_memory_gib=0.001"])
    assert res.exit_code == 1 and json.loads(res.stdout)["fits"] is False
    bad = runner.invoke(app, ["plan", str(exp), "--set", "devices.host_memory_gib=0"])
    assert bad.exit_code == 2 and "devices.host_memory_gib" in bad.output


def test_vllm_lora_is_the_stacked_adapters_by_hand():
    """Qwen3-8B, rank 16 on the seven projections: per layer r x (in + out) of q (4096 -> 4096), k and v
    (4096 -> 1024), o (4096 -> 4096), gate and up (4096 -> 12288), down (12288 -> 4096); 36 layers, bf16: PEFT's
    43.6 M adapter parameters. Rank 12 is stacked at vLLM's rank 16 on the device (its own rank on the host);
    tensor-parallel ranks split q/k/v/gate/up by their output and o/down by their input; vLLM wraps all seven
    projections even when lora.targets names one."""
    config = model_config(MODELS / "Qwen3-8B")
    cfg = load_config(None, ["model.dtype=bfloat16", "lora.rank=16"])
    per_layer = 8192 + 5120 + 5120 + 8192 + 16384 + 16384 + 16384
    assert 36 * per_layer * 16 == 43_646_976
    buffers = 4 * plan_mod.VLLM_PROFILE_TOKENS * 8 + 3 * plan_mod.VLLM_PROFILE_TOKENS * 16 * 4
    device, host, counts = vllm_lora(cfg, config, tp=1)
    assert device == 36 * per_layer * 16 * 2 + buffers and host == 36 * per_layer * 16 * 2
    assert counts == {"lora_stacked_rank": 16, "max_loras": 1}
    d12, h12, _ = vllm_lora(load_config(None, ["model.dtype=bfloat16", "lora.rank=12"]), config, tp=1)
    assert d12 == device and h12 == 36 * per_layer * 12 * 2
    # vLLM wraps every projection whatever lora.targets says (no target_modules): the host copy is the adapter's
    d_q, h_q, _ = vllm_lora(load_config(None, ["model.dtype=bfloat16", "lora.rank=16", "lora.targets=[q_proj]"]),
                            config, tp=1)
    assert d_q == device and h_q == 36 * 8192 * 16 * 2
    tp2 = (4096 + 2048) + 2 * (4096 + 512) + (2048 + 4096) + 2 * (4096 + 6144) + (6144 + 4096)
    assert vllm_lora(cfg, config, tp=2)[0] == 36 * tp2 * 16 * 2 + buffers
    assert vllm_lora(load_config(None, ["model.dtype=bfloat16"]), config, tp=1) == (0, 0, {})


def test_a_vllm_engine_with_lora_gives_its_adapters_room_from_the_kv_cache(tmp_path):
    """The plan of a vLLM engine with LoRA: the stacked adapters sit inside vLLM's fraction beside the weights, so
    the key/value cache is that much smaller, and the host keeps each replica's adapter."""
    keys = ["devices.rollout=0-1", "devices.learner=2", "rollout.engine=vllm", "rollout.vllm_memory_fraction=0.5"]
    with_vllm = load_config(_tiny_experiment(tmp_path), [*keys, "lora.rank=4"])
    no_lora = load_config(tmp_path / "exp.yaml", keys)
    a, b = ({p["name"]: p for p in plan_experiment(c, capacity_gib=8.0, host_gib=64.0)["processes"]}
            for c in (with_vllm, no_lora))
    lora_dev, lora_host, _ = vllm_lora(with_vllm, model_config(tmp_path / "model"), tp=1)
    assert a["engine-0"]["parts"]["lora"] == lora_dev > 0 and b["engine-0"]["parts"]["lora"] == 0
    assert b["engine-0"]["parts"]["kv_cache"] - a["engine-0"]["parts"]["kv_cache"] == lora_dev
    assert a["host"]["parts"]["engine_cpu_loras"] == 2 * lora_host


def test_the_plan_warns_when_a_vllm_replicas_kv_cache_is_short_of_its_running_turns(tmp_path):
    """A replica runs min(rollout.max_batch, its sessions) turns at once, each growing to rollout.max_trajectory_tokens
    (256 here): vLLM's key/value cache must hold that many tokens, else vLLM preempts turns and prefills them again.
    The cache is sized through rollout.vllm_memory_fraction: roomy at 0.5, then the replica's fixed bytes plus room
    for 5 full-length turns, which warns for 8 running turns (a warning: the plan still fits) and not for 4."""
    exp = _tiny_experiment(tmp_path)
    keys = ["devices.rollout=0", "devices.learner=1", "rollout.engine=vllm", "rollout.concurrency=8",
            "rollout.max_batch=16"]

    def engine(*more):
        doc = plan_experiment(load_config(exp, [*keys, *more]), capacity_gib=8.0, host_gib=64.0)
        return doc, next(p for p in doc["processes"] if p["name"] == "rollout")

    _, roomy = engine("rollout.vllm_memory_fraction=0.5")
    per_token, counts = roomy["counts"]["kv_bytes_per_token"], roomy["counts"]
    assert counts["max_model_len"] == 256 and counts["running_turns"] == 8  # min(max_batch 16, 8 sessions)
    assert counts["kv_cache_tokens"] == roomy["parts"]["kv_cache"] // per_token > 8 * 256 and roomy["warnings"] == []
    fixed = roomy["parts"]["gpu_memory_utilization"] - roomy["parts"]["kv_cache"]
    fraction = (fixed + 5 * 256 * per_token + per_token // 2) / (8 << 30)
    doc, short = engine(f"rollout.vllm_memory_fraction={fraction!r}")
    tokens = short["counts"]["kv_cache_tokens"]
    assert tokens // 256 == 5 and doc["fits"]
    assert short["warnings"] == [kv_shortfall("rollout", tokens, 8, 256)]
    assert "fewer than 8 running turns x 256 tokens (rollout.max_batch x rollout.max_trajectory_tokens = 2,048; " \
           "room for 5 at full length)" in short["warnings"][0]
    _, few = engine(f"rollout.vllm_memory_fraction={fraction!r}", "rollout.max_batch=4")
    assert few["counts"]["running_turns"] == 4 and few["warnings"] == []
    assert kv_shortfall("r", 2048, 8, 256) is None and kv_shortfall("r", 2047, 8, 256) is not None  # the edge
    res = runner.invoke(app, ["plan", str(exp), "--capacity-gib", "8", "--host-gib", "64", *(
        x for k in (*keys, f"rollout.vllm_memory_fraction={fraction!r}") for x in ("--set", k))])
    assert res.exit_code == 0 and "warning rollout: vLLM's key/value cache holds" in res.stdout, res.output


@pytest.mark.parametrize("setup,msg", [
    ("missing", "no config.json"),
    ("unknown", "not a config transformers can build"),
    ("builtin", "set model.policy_config"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, setup, msg):
    exp = _tiny_experiment(tmp_path)
    doc = yaml.safe_load(exp.read_text())
    if setup == "missing":
        (tmp_path / "model" / "config.json").unlink()
    elif setup == "unknown":
        (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    else:
        del doc["model"]["policy_config"]
        exp.write_text(yaml.safe_dump(doc))
    res = runner.invoke(app, ["plan", str(exp)])
    assert res.exit_code == 2 and msg in res.output and len(res.output.strip().splitlines()) == 1, res.output


NODE8 = ["grpo_full", "grpo_lora", "opd_full", "opd_lora"]
DEVICES = {"80 GB": 80e9 / 2**30, "141 GB": 141e9 / 2**30}  # 74.5 and 131.3 GiB: the marketed sizes, in bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", NODE8)
def test_node8_files_fit_80_gb_and_141_gb_devices_and_their_stated_host(name):
    """Every node8 process fits an 80 GB and a 141 GB device (80e9 and 141e9 bytes, less than such devices report
    to CUDA) and the 2 TB host the files state, through the CLI with --json."""
    for label, gib in DEVICES.items():
        gib = float(f"{gib:.4f}")
        res = runner.invoke(app, ["plan", str(ROOT / "experiments" / "node8" / f"{name}.yaml"),
                                  "--capacity-gib", str(gib), "--json"])
        assert res.exit_code == 0, (label, res.output)
        doc = json.loads(res.stdout)
        assert doc["fits"] and all(p["fits"] for p in doc["processes"]), label
        host = [p for p in doc["processes"] if p["device"] == "cpu"]
        assert all(p["capacity_bytes"] == 2048 * 2**30 for p in host)
        assert all(p["capacity"] == "devices.host_memory_gib" for p in host)
        assert all(p["capacity_bytes"] == int(gib * 2**30) for p in doc["processes"] if p["device"] != "cpu")


# Qwen3-8B's trained elements per FSDP unit (experiments/node8/models/Qwen3-8B): a decoder layer holds q and o
# (4096 x 4096), k and v (1024 x 4096), gate, up and down (12288 x 4096), q_norm and k_norm (128), two layer norms
# (4096); the root unit the embedding and the untied LM head (151936 x 4096) and the final norm (4096)
QWEN3_8B_LAYER = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 12288 * 4096 + 2 * 128 + 2 * 4096
QWEN3_8B_ROOT = 2 * 151936 * 4096 + 4096


def test_pinned_blocks_are_the_next_power_of_two_by_hand():
    """The caching host allocator's rule (c10::llvm::PowerOf2Ceil): a request of n bytes holds the smallest power
    of two >= n. At grpo_full's sizes (one float32 block per FSDP unit and rank, 4 ranks) a buffer set asks 7.63 GiB
    and holds 11.0 GiB: the plan would understate the pinned memory by 44 % without the rounding."""
    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4, 5, 4095, 4096, 4097)] == [0, 1, 2, 4, 4, 8, 4096, 4096, 8192]
    assert pinned_block_bytes(5 << 20) == 8 << 20 and pinned_block_bytes((3 << 30) + 1) == 4 << 30
    assert QWEN3_8B_LAYER == 192_946_432 and QWEN3_8B_ROOT == 1_244_663_808  # elements
    layer, root = QWEN3_8B_LAYER // 4 * 4, QWEN3_8B_ROOT // 4 * 4  # one rank's float32 shard, bytes (divisible by 4)
    assert (pinned_block_bytes(layer), pinned_block_bytes(root)) == (256 << 20, 2 << 30)  # 184 MiB, 1.16 GiB asked
    asked, held = 36 * layer + root, 36 * pinned_block_bytes(layer) + pinned_block_bytes(root)
    assert (asked, held) == (8_190_735_360, 11_811_160_064) and round(held / asked - 1, 2) == 0.44


def test_the_plan_counts_each_pinned_tensor_as_its_block(tmp_path):
    """Host buffers of a group on GPUs: one pinned block per template tensor per set, and one per tensor of the fold
    staging, each rounded; tsrl plan shows the requested bytes and the rounded ones (the difference is a part of its
    own, so the host's total is what the allocator holds)."""
    cfg = load_config(_tiny_experiment(tmp_path), ["devices.learner=4-5", "devices.rollout=0-1",
                                                    "loss.buffer_device=cpu"])
    by = {p["name"]: p for p in plan_experiment(cfg, capacity_gib=3.0, host_gib=4.0)["processes"]}
    host, sets = by["host"], by["learner-0"]["counts"]["buffer_sets"]
    trace = learner_pass(model_config(tmp_path / "model"), LearnerShape(rows=1, width=256, dtype=torch.float32,
                                                                        world=2, buffer_dtype=None))
    numels = trace.buffer_numels
    assert len(numels) == 3 and sum(numels) == trace.buffer_numel  # two decoder layers and the root, this rank's
    asked = 2 * sum(sets * 4 * n + 4 * n for n in numels)  # float32 model and buffers, 2 ranks
    held = 2 * sum(sets * pinned_block_bytes(4 * n) + pinned_block_bytes(4 * n) for n in numels)
    assert host["counts"] == {"pinned_requested_bytes": asked, "pinned_bytes": held} and held > asked
    parts = host["parts"]
    assert parts["learner_pinned_buffers"] + parts["learner_fold_staging"] == asked
    assert parts["pinned_rounding"] == held - asked and host["peak_bytes"] == sum(parts.values())
    on_device = plan_experiment(load_config(tmp_path / "exp.yaml", ["devices.learner=4-5", "devices.rollout=0-1"]),
                                capacity_gib=3.0, host_gib=4.0)
    assert "pinned_bytes" not in {k for p in on_device["processes"] for k in p["counts"]}  # nothing pinned
    human = runner.invoke(app, ["plan", str(tmp_path / "exp.yaml"), "--set", "devices.learner=4-5", "--set",
                                "devices.rollout=0-1", "--set", "loss.buffer_device=cpu", "--capacity-gib", "3"])
    assert f"pinned_requested_bytes {asked:,}" in human.stdout and f"pinned_bytes {held:,}" in human.stdout


@pytest.mark.slow
def test_grpo_full_pins_the_hand_counted_blocks():
    """grpo_full (17 buffer sets per rank, bf16 fold staging, 4 ranks): the plan's pinned figures are the blocks
    counted by hand above, 534.0 GiB asked and 770.0 GiB held, inside the 2,048 GiB host the file states."""
    doc = plan_experiment(load_config(ROOT / "experiments" / "node8" / "grpo_full.yaml"))
    host = next(p for p in doc["processes"] if p["name"] == "host")
    staging = 36 * pinned_block_bytes(QWEN3_8B_LAYER // 4 * 2) + pinned_block_bytes(QWEN3_8B_ROOT // 4 * 2)
    held = 4 * (17 * 11_811_160_064 + staging)
    asked = 4 * (17 * 8_190_735_360 + (36 * QWEN3_8B_LAYER + QWEN3_8B_ROOT) // 4 * 2)
    assert host["counts"] == {"pinned_requested_bytes": asked, "pinned_bytes": held} and host["fits"]


@pytest.mark.slow
def test_the_plans_sharded_learner_figure_is_a_real_allocation_of_rank_0(tmp_path, monkeypatch):
    """tsrl plan's learner-0 of a 4-rank CPU group (rank 0 of a fake process group on fake tensors) against the same
    rank allocated for real: the model built and sharded on the meta device, rank 0's shards given CPU storage
    (Module.to_empty) and the same micro-batch's pass run under the tracker; and AdamW's step over that rank's
    real shards. Within 10 % (on the CPU: to the byte). Positive control: a real micro-batch 25 % longer is not."""
    shapes = []
    traced = plan_mod.learner_pass
    monkeypatch.setattr(plan_mod, "learner_pass", lambda config, s: shapes.append(s) or traced(config, s))
    cfg = load_config(_tiny_experiment(tmp_path), ["devices.learner=cpu:4"])
    rank0 = next(p for p in plan_experiment(cfg, host_gib=64.0)["processes"] if p["name"] == "learner-0")
    (s,) = shapes
    assert s.world == 4
    assert (s.rows, s.width) == (rank0["counts"]["microbatch_rows"], rank0["counts"]["microbatch_width"])
    config = model_config(tmp_path / "model")
    real = learner_pass(config, s, fake=False)
    assert rel(rank0["parts"]["traced_pass"], real.pass_peak) <= 0.10, (rank0["parts"]["traced_pass"], real.pass_peak)
    assert real.param_numel == real.buffer_numel < sum(p.numel() for p in build_from_config(config).parameters()) / 3
    step = optimizer_step(real.opt_shapes, real.opt_dtype, foreach=False, fake=False)
    assert rel(rank0["parts"]["traced_optimizer_step"], step) <= 0.10, (rank0["parts"]["traced_optimizer_step"], step)
    longer = learner_pass(config, dataclasses.replace(s, width=s.width + s.width // 4), fake=False)
    assert rel(rank0["parts"]["traced_pass"], longer.pass_peak) > 0.10
