"""Master weights (optim.master_dtype) on one learner process, bf16 model: the optimizer steps float32 copies.

The learner is built as `tsrl train` builds it (rl/learner_worker.Learner, the toy policy) and stepped with
fixed gradients, so the optimizer's arithmetic is known: AdamW with a constant gradient moves every
master by lr per step. At lr 5e-5 a bf16 AdamW step rounds away on every weight of magnitude >= 2^-5
(the nearest bf16 neighbours there are >= 2^-13 apart: half of that is 6.1e-5 > 5e-5), forever.
"""

import pytest
import torch
from toy_workload import TOY

from tsrl_cli.config import ConfigError, load_config
from tsrl_cli.rl.learner_worker import Learner
from tsrl_cli.rl.masters import MASTER_KEY

LR, STEPS = 5e-5, 100


def make(toy_policies, run_dir, init_dir=None, *sets):
    cfg = load_config(sets=[*TOY, "model.dtype=bfloat16", f"optim.lr={LR}", "optim.grad_clip=0",
                            f"run.out={run_dir}", *sets])
    policy = str(toy_policies[0])
    return Learner(cfg, init_dir or policy, policy, 0, str(run_dir), None, None, None)


def steps(lrn, n, seed=None):
    """n optimizer steps; seed None: a constant gradient of ones (AdamW: every weight decreases by lr per
    step), else positive gradients drawn from the seed."""
    g = torch.Generator().manual_seed(seed or 0)
    for _ in range(n):
        lrn.apply_step([torch.ones(p.shape) + (0 if seed is None else torch.rand(p.shape, generator=g))
                        for p in lrn.params])


def test_updates_below_bf16_resolution_still_move_the_weights(toy_policies, tmp_path):
    runs = {}
    for master in ("auto", "none"):
        lrn = make(toy_policies, tmp_path / master, None, f"optim.master_dtype={master}")
        start = [p.detach().clone() for p in lrn.params]
        steps(lrn, STEPS)
        runs[master] = (lrn, start)
    lrn, start = runs["auto"]
    assert lrn.masters is not None and all(m.dtype == torch.float32 for m in lrn.opt_params)
    assert all(p.dtype == torch.bfloat16 for p in lrn.params)
    for p, m, w0 in zip(lrn.params, lrn.opt_params, start, strict=True):
        assert torch.allclose(m, w0.float() - STEPS * LR, rtol=1e-5, atol=1e-6)  # every update kept
        assert torch.equal(p, m.to(torch.bfloat16))  # the model holds their cast
    moved = sum(int((p != w0).sum()) for p, w0 in zip(lrn.params, start, strict=True))
    assert moved == sum(p.numel() for p in lrn.params)  # 100 x 5e-5 = 5e-3: past every weight's rounding
    none, start = runs["none"]  # the positive control: bf16 AdamW
    assert none.masters is None and none.opt_params is none.params
    big = [w0.abs() >= 2 ** -5 for w0 in start]
    assert sum(int(b.sum()) for b in big) > 100  # the norms' 1.0 and the tails of the random weights
    assert all(torch.equal(p[b], w0[b]) for p, w0, b in zip(none.params, start, big, strict=True))  # never moved


def test_masters_resume_exactly_from_optimizer_pt(toy_policies, tmp_path):
    lrn = make(toy_policies, tmp_path / "a")
    steps(lrn, 7, seed=0)
    ckpt = lrn.save_checkpoint(1)
    sd = torch.load(f"{ckpt}/optimizer.pt", weights_only=True)
    assert all(t.dtype == torch.float32 for t in sd[MASTER_KEY].values())
    assert all(s["exp_avg"].dtype == torch.float32 for s in sd["state"].values())  # AdamW moments in float32
    again = make(toy_policies, tmp_path / "b", ckpt)
    assert all(torch.equal(a, b) for a, b in zip(lrn.opt_params, again.opt_params, strict=True))  # not the bf16 cast
    assert any(not torch.equal(m, p.float()) for m, p in zip(again.opt_params, again.params, strict=True))
    steps(lrn, 3, seed=1)
    steps(again, 3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(lrn.opt_params, again.opt_params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(lrn.params, again.params, strict=True))


def test_float_models_default_to_no_masters(toy_policies, tmp_path):
    lrn = make(toy_policies, tmp_path, None, "model.dtype=float32")
    assert lrn.masters is None and lrn.opt_params is lrn.params
    explicit = make(toy_policies, tmp_path / "x", None, "model.dtype=float64", "optim.master_dtype=float64")
    assert explicit.masters is not None and explicit.opt_params[0] is not explicit.params[0]


@pytest.mark.parametrize("sets,msg", [
    (["optim.master_dtype=float16"], "optim.master_dtype: 'float16' is not one of auto, float32, float64, none"),
    (["model.dtype=float64", "optim.master_dtype=float32"], "would round a float64 model's weights"),
    (["learner.logits_chunk_tokens=0"], "learner.logits_chunk_tokens: must be >= 1"),
    (["learner.activation_checkpointing=sometimes"], "learner.activation_checkpointing: expected true or false"),
])
def test_bad_values_are_one_line_config_errors(sets, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        load_config(sets=sets)
    assert "\n" not in str(e.value)
