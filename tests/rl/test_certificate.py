"""The exactness certificate (run.verify_every, rl/certificate.py) inside real runs on the toy workload.

- float64 stream with `--set run.verify_every=1`, one process and a learner group of 2 CPU ranks:
  verify_rel_diff <= 1e-9 in every round, in metrics.jsonl, the summary and `tsrl report`; the
  certified run ends on the uncertified run's weights (the step's gradient is left as it was)
- the same for OPD with LoRA, sync (padded step, per-item recomputation) and async with TIS
- a fold dropped (one process) or sent twice (2 ranks) in round 2: the run stops in round 2 with exit 1
  and an error line naming the round and the difference; round 1 is recorded, round 2 never stepped
- bad values of the two keys: one line, exit 2
- the shard-wise comparison reduced over ranks gives the whole gradient's figure
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from toy_workload import TOY
from typer.testing import CliRunner

from tsrl_cli.config import ConfigError, load_config
from tsrl_cli.core.graddiff import combine, compare
from tsrl_cli.rl.certificate import BREAK_FOLD_ENV, tolerance_of
from tsrl_cli.rl.train import train

ROOT = Path(__file__).resolve().parents[2]
F64 = {"model.dtype": "float64"}


def rows(d):
    return [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]


def final_weights(d):
    ckpts = sorted((Path(d) / "checkpoints").glob("round-*"), key=lambda p: int(p.name.split("-")[1]))
    return load_file(str(ckpts[-1] / "model.safetensors"))


def max_rel(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-300)) for k in a)


def certified_rows(d, rounds):
    m = rows(d)
    assert [r["round"] for r in m] == list(range(1, rounds + 1))
    assert all(r["verify_rel_diff"] <= 1e-9 and r["verify_s"] > 0 for r in m), [r.get("verify_rel_diff") for r in m]
    assert all(r["verify_s"] < r["learner_busy_s"] for r in m)  # inside the learner's busy time
    assert all(r["grad_norm"] > 1e-3 for r in m)  # a certificate of a zero gradient would hold whatever was summed
    return m


# ---- the shard-wise figure ----------------------------------------------------------------------------


def test_combine_of_shards_is_the_whole_gradients_figure():
    gen = torch.Generator().manual_seed(0)
    lazy = [torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
    other = [t + 1e-3 * torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in lazy]
    whole = compare(["a", "b"], lazy, other)
    # two "ranks", each holding half of every tensor's rows (FSDP's dim-0 sharding)
    parts = [compare([f"a{r}", f"b{r}"], [t.chunk(2)[r] for t in lazy], [t.chunk(2)[r] for t in other]) for r in (0, 1)]
    got = combine(parts)
    assert got["max_rel_diff"] == whole["max_rel_diff"] > 0
    assert (got["max_abs_diff"], got["max_abs_grad"]) == (whole["max_abs_diff"], whole["max_abs_grad"])
    # positive control: one rank's pieces alone miss the other's larger difference
    other[0][5, 0] += 1.0  # row 5 lives on rank 1
    parts = [compare(["a", "b"], [t.chunk(2)[r] for t in lazy], [t.chunk(2)[r] for t in other]) for r in (0, 1)]
    assert combine(parts)["max_rel_diff"] == compare(["a", "b"], lazy, other)["max_rel_diff"] > parts[0]["max_rel_diff"]


def test_tis_weights_reach_the_open_groups_buffers(tiny64):
    """What the certificate found in async with TIS and sync_batching per_item: the members of an open group
    were backwarded without their truncated importance weights. Streamed per arrival (every group opens),
    the TIS-weighted gradient equals the lazy one with the same weights."""
    import random
    from collections import Counter

    from tsrl_cli.core.offpolicy import tis_weights
    from tsrl_cli.policy import score_tokens
    from tsrl_cli.rl.learner import Objective, StreamLearner, lazy_loss, pad_rows
    from tsrl_cli.rl.schedules import tis
    from tsrl_cli.verify import arrivals, feed, random_rollouts

    obj = Objective("grpo")
    ro = random_rollouts(tiny64.get_input_embeddings().weight.shape[0], 3, 4, 3)
    rng = random.Random(0)
    for r in ro:  # the rollout engine's log-probs, off by up to e^{+-1}: weights from e^-1 to the cap
        r.behavior_logprobs = [lp + rng.uniform(-1.0, 1.0) for lp in score_tokens(tiny64, r.input_ids)]
    cap = 2.0

    def lazy_weights(logp):
        behavior = pad_rows([r.behavior_logprobs for r in ro], logp.shape[1], logp.dtype, logp.device)
        return tis_weights(logp, behavior, cap)

    params = [p for p in tiny64.parameters() if p.requires_grad]
    lazy = torch.autograd.grad(lazy_loss(tiny64, ro, obj, token_weights=lazy_weights), params)
    sizes = Counter(r.group_id for r in ro)

    def streamed(weights):
        sl = StreamLearner(tiny64, obj, sizes, max_items=1, token_weights=weights)
        return feed(sl, arrivals(ro, obj, "random", 0), 1), sl

    got, sl = streamed(tis(cap))
    assert any(b.target[0] == "member" for b in sl.batches)  # open groups' members were backwarded
    names = [str(i) for i in range(len(params))]
    assert compare(names, lazy, got)["max_rel_diff"] <= 1e-10
    assert compare(names, lazy, streamed(None)[0])["max_rel_diff"] > 1e-3  # positive control: the weights matter


# ---- the two keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets, match", [
    (["run.verify_every=-1"], "run.verify_every: must be >= 0"),
    (["run.verify_every=two"], "run.verify_every: expected an integer"),
    (["run.verify_every=1", "run.verify_tol=0"], "run.verify_tol: must be > 0"),
    (["run.verify_every=1", "run.verify_tol=-1e-3"], "run.verify_tol: must be > 0"),
    (["run.verify_every=1", "run.verify_tol=big"], "run.verify_tol: expected a finite number"),
    (["run.verify_tol=1e-6"], "run.verify_every is 0"),
])
def test_bad_values_of_the_two_keys_exit_2_in_one_line(tmp_path, sets, match):
    from tsrl_cli.cli import app

    with pytest.raises(ConfigError, match=match):
        load_config(sets=sets)
    res = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "x"), *[a for s in sets for a in ("--set", s)]])
    assert res.exit_code == 2 and match in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "x").exists()  # nothing written


def test_default_tolerance_per_dtype():
    def tol(*sets):
        return tolerance_of(load_config(sets=["run.verify_every=1", *sets]))

    assert (tol("model.dtype=float64"), tol("model.dtype=float32"), tol("model.dtype=bfloat16")) == (1e-10, 1e-4, 5e-2)
    assert tol("model.dtype=float32", "loss.buffer_dtype=bfloat16") == 5e-2  # bf16 buffers: bf16's tolerance
    assert tol("run.verify_tol=3e-7") == 3e-7


# ---- real runs ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stream_certified_every_round_and_the_step_untouched(toy_config, tmp_path):
    from tsrl_cli.report.build import ReportOptions, build_report

    results = tmp_path / "results"
    cfg = toy_config("run.verify_every=1", out=str(results / "toy" / "stream" / "seed0"), schedule="stream", rounds=3,
                     **F64)
    summary = train(cfg)
    d = cfg.run_dir()
    m = certified_rows(d, 3)
    assert summary["verify_rounds"] == 3 and summary["verify_rel_diff_max"] == max(r["verify_rel_diff"] for r in m)
    assert 0 < summary["verify_share_of_learner"] < 1
    assert json.loads((d / "DONE").read_text())["verify_rel_diff_max"] == summary["verify_rel_diff_max"]
    plain = toy_config(out="plain", schedule="stream", rounds=3, **F64)
    train(plain)
    assert "verify_rel_diff" not in rows(plain.run_dir())[0]  # off by default
    assert max_rel(final_weights(plain.run_dir()), final_weights(d)) < 1e-12  # the certificate changed no step
    # tsrl report: the certificate's table, from these rows
    doc = build_report(ReportOptions(results_dir=str(results), out_dir=str(tmp_path / "report")))
    table = (tmp_path / "report" / "tables" / "certificate.md").read_text()
    assert "toy · stream" in table and f"{summary['verify_rel_diff_max']:.3g}" in table, table
    assert "### Exactness certificate" in Path(doc["report"]).read_text()


@pytest.mark.slow
@pytest.mark.parametrize("schedule, objective, extra", [
    ("stream", "opd", ["lora.rank=8"]),  # OPD turns, LoRA adapters
    ("sync", "grpo", ["sync_batching=padded", "loss.kl_coef=0.05"]),  # padded step, per-item recomputation
    ("async", "grpo", ["offpolicy.tis_cap=2.0", "learner.max_microbatch_tokens=400"]),  # TIS weights, split batch
], ids=["stream-opd-lora", "sync-padded", "async-tis"])
def test_certified_in_every_schedule(toy_config, schedule, objective, extra):
    cfg = toy_config("run.verify_every=1", *extra, schedule=schedule, objective=objective, rounds=2, **F64)
    train(cfg)
    certified_rows(cfg.run_dir(), 2)


def train_args(out, *args):
    sets = [a for s in [*TOY, "model.dtype=float64"] for a in ("--set", s)]
    return ["train", *sets, "--out", str(out), "--json", *args]


def cli(out, *args, env=None):
    return subprocess.run([sys.executable, "-m", "tsrl_cli", *train_args(out, *args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env, check=False)


@pytest.mark.slow
def test_learner_group_certified_every_round(toy_policies, tsrl_here, tmp_path):
    """`--learner-devices cpu:2 --set run.verify_every=1`: each rank compares its shards, the max over ranks
    (the command in this process, conftest.tsrl_here: it needs no hook in its workers' environment)."""
    d = tmp_path / "run"
    res = tsrl_here(*train_args(d, "--learner-devices", "cpu:2", "--rounds", "3", "--set", "run.verify_every=1"))
    assert res.returncode == 0, res.stderr[-3000:]
    m = certified_rows(d, 3)
    assert all(r["learner_ranks"] == 2 for r in m)
    assert json.loads(res.stdout)["verify_rounds"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("learners, how", [("cpu", "drop"), ("cpu:2", "twice")])
def test_a_broken_fold_stops_the_run_in_its_round(toy_policies, tmp_path, learners, how):
    """The fold broken is the first into R; the entropy term makes its gradient non-zero in every round (on the
    toy workload at lr 1e-2 every reward of round 2 can be 0, and then an advantage-weighted fold is 0 too)."""
    d = tmp_path / "run"
    env = dict(os.environ, **{BREAK_FOLD_ENV: f"2:{how}"})
    entropy = ["--set", "loss.entropy_coef=0.01"]
    res = cli(d, "--learner-devices", learners, "--rounds", "3", "--save-every", "1", "--set", "run.verify_every=1",
              *entropy, env=env)
    assert res.returncode == 1 and res.stdout == "", res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert "round 2: exactness certificate failed" in lines[0] and "above run.verify_tol 1.0e-10" in lines[0], lines
    assert lines[1:] == ["(set TSRL_DEBUG=1 for the full message)"]  # the worker's traceback stays behind it
    assert [r["round"] for r in rows(d)] == [1]  # round 1 certified and recorded, round 2 never stepped
    assert rows(d)[0]["verify_rel_diff"] <= 1e-9
    assert not (d / "checkpoints" / "round-2").exists() and (d / "checkpoints" / "round-1").is_dir()
    # positive control of the hook's scope: the same fault with the certificate off trains through silently
    if learners == "cpu":
        quiet = cli(tmp_path / "quiet", "--rounds", "2", *entropy, env=env)
        assert quiet.returncode == 0 and [r["round"] for r in rows(tmp_path / "quiet")] == [1, 2], quiet.stderr[-2000:]
