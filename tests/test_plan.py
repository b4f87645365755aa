"""`tsrl plan`: the memory plan from a config.json alone.

The learner's figure is PyTorch's memory tracker over fake tensors; here it is checked against the same tracker
over real tensors (tiny Qwen3s from policy.tiny_qwen3_config, two sizes, within 10 %), against the physics it must
show (the full-vocabulary logits, what checkpointing and chunking remove, 1/N of the state on N ranks), and the
arithmetic beside it (buffer sets, micro-batch rows, vLLM's key/value bytes) against hand counts.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import LoRAConfig, load_config
from tsrl_cli.memtrace import LearnerShape, inference, learner_pass, optimizer_step
from tsrl_cli.plan import buffer_sets, kv_bytes_per_token, microbatch_rows, plan_experiment
from tsrl_cli.policy import build_from_config, model_config, tiny_qwen3_config

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
def test_fake_tensor_figure_equals_the_tracker_on_real_tensors(scale, settings):
    cfg, rows, width = SCALES[scale]
    s = LearnerShape(rows=rows, width=width, dtype=torch.float32, **settings)
    fake, real = learner_pass(tiny_qwen3_config(**cfg), s), learner_pass(tiny_qwen3_config(**cfg), s, fake=False)
    assert rel(fake.pass_peak, real.pass_peak) <= 0.10, (fake.pass_peak, real.pass_peak)
    assert (fake.param_bytes, fake.buffer_numel, fake.opt_shapes) == (real.param_bytes, real.buffer_numel, real.opt_shapes)
    step = [optimizer_step(fake.opt_shapes, torch.float32, foreach=True, fake=f) for f in (True, False)]
    assert rel(*step) <= 0.10, step
    inf = [inference(tiny_qwen3_config(**cfg), torch.float32, rows, width, cache=True, fake=f)[0] for f in (True, False)]
    assert rel(*inf) <= 0.10, inf


def test_positive_control_the_10_percent_check_catches_a_mistraced_micro_batch():
    cfg, rows, width = SCALES["larger"]
    s = LearnerShape(rows=rows, width=width, dtype=torch.float32, chunk_tokens=128)
    wrong = LearnerShape(rows=rows, width=width + width // 4, dtype=torch.float32, chunk_tokens=128)  # 25 % longer rows
    fake, real = learner_pass(tiny_qwen3_config(**cfg), wrong), learner_pass(tiny_qwen3_config(**cfg), s, fake=False)
    assert rel(fake.pass_peak, real.pass_peak) > 0.10


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
    ckpt = learner_pass(wide, LearnerShape(rows=1, width=T, dtype=torch.float32, checkpointing=True)).parts["Activation"]
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
    assert buffer_sets(load_config(None, opd)) == 1 + 8
    assert buffer_sets(load_config(None, [*opd, "loss.max_open_groups=3"])) == 4


def test_microbatch_rows_follow_the_learner_caps():
    cfg = load_config(None, ["rollout.prompts_per_round=4", "rollout.group_size=8", "learner.max_microbatch_tokens=4096"])
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
    doc = plan_experiment(cfg, capacity_gib=1.0, host_gib=4.0)
    by = {p["name"]: p for p in doc["processes"]}
    assert set(by) == {"learner-0", "learner-1", "engine-0", "engine-1", "host"}
    assert by["learner-0"]["device"] == "cuda:4" and by["learner-0"]["parts"]["streaming_buffers"] == 0
    host = by["host"]["parts"]
    sets, set_bytes = by["learner-0"]["counts"]["buffer_sets"], by["learner-0"]["parts"]["buffer_set"]
    assert host["learner_pinned_buffers"] == 2 * sets * set_bytes  # the buffers moved to host memory, both ranks
    assert by["learner-0"]["capacity_bytes"] == 1 << 30 and doc["fits"] is True


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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_full", "grpo_lora", "opd_full", "opd_lora"])
def test_node8_files_fit_an_80_gib_device(name):
    """The node8 files on 80 GiB GPUs and a 2 TiB host (an 8-GPU H100/H200 server's); 141 GiB has more room."""
    res = runner.invoke(app, ["plan", str(ROOT / "experiments" / "node8" / f"{name}.yaml"), "--capacity-gib", "80",
                              "--host-gib", "2048", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["fits"] and all(p["fits"] for p in doc["processes"])
    assert math.isclose(doc["processes"][0]["capacity_bytes"], 80 * 2**30)
