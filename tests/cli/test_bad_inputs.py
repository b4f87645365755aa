"""Every command answers bad input the same way: exit 2, one `error:` line on stderr naming the place and
the fix, last on stderr (progress lines may come before it), no traceback, nothing on stdout, and nothing
written: a run folder named by --out is not created, or stays empty. The table covers every command and each
kind of bad input it takes: missing and
wrong-kind paths, corrupt parquet / safetensors / JSONL / YAML / JSON, wrong types, unknown keys,
out-of-range values, a model folder without a tokenizer. docs/reliability.md counts this table."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
import torch
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.policy import build_tiny_model

# (command line with {t} for the test's folder, a word the error must contain)
CASES = [
    ("verify --model {t}/nonexistent", "not a model directory"),
    ("verify --model {t}/corrupt_model", "could not load the model"),
    ("verify --rollouts {t}/nonexistent.jsonl", "not found"),
    ("verify --rollouts {t}/corrupt.jsonl", "corrupt.jsonl:"),
    ("verify --rollouts {t}/wrong_fields.jsonl", "unknown field"),
    ("verify --dtype float16", "float16"),
    ("verify --order sideways", "sideways"),
    ("verify --loss-agg mean", "loss aggregation 'mean'"),
    ("verify --loss-agg seq-mean-token-sum-norm", "--norm-constant"),
    ("verify --groups 0", "--groups"),
    ("verify --max-open-groups -1", "max open groups"),
    ("verify --global-batch-size 0", "global batch size"),
    ("verify --objective opd --teacher {t}/corrupt_model", "could not load the model"),
    ("prepare-data nosuch --from {t}", "unknown source"),
    ("prepare-data swe-smith --from {t}/nonexistent --out {t}/out", "not found"),
    ("prepare-data swe-smith --from {t}/corrupt.parquet --out {t}/out", "not a readable parquet"),
    ("prepare-data swe-smith --from {t}/wrong_fields.jsonl --out {t}/out", "no tasks left"),
    ("prepare-data swe-smith --from tests/fixtures/swe_smith --limit 0 --out {t}/out", "--limit 0"),
    ("prepare-data embedded --pull-images --out {t}/out", "nothing to pull"),
    ("prepare-data swe-smith --from tests/fixtures/swe_smith --pull-images --max-parallel-pulls 0 --out {t}/out",
     "--max-parallel-pulls 0"),
    ("data show {t}/nonexistent", "no such dataset"),
    ("data check {t}/plain_dir", "no manifest.json"),
    ("data check {t}/corrupt_manifest", "not valid JSON"),
    ("env exec --workdir {t}/nonexistent -- true", "not a directory"),
    ("env exec -- true", "--task ID"),
    ("env exec --workdir {t} --timeout-s 0 -- true", "must be positive"),
    ("env exec --task x -- true", "--dataset"),
    ("env exec --workdir {t} --base-image a=b -- true", "only with --task"),
    ("env exec --task x --dataset {t}/nonexistent -- true", "no such dataset"),
    ("env list --dataset {t}/nonexistent", "no such dataset"),
    ("policy probe --model {t}/nonexistent --out {t}/out", "not a policy directory"),
    ("policy probe --model {t}/tokenless --tasks {t}/nonexistent --out {t}/out", "no such dataset"),
    ("policy probe --model {t}/tokenless --samples 0 --out {t}/out", "--samples 0"),
    ("policy probe --model {t}/tokenless --tasks {t}/dataset --out {t}/out", "tokenizer"),
    ("policy probe --model {t}/corrupt_policy --tasks {t}/dataset --out {t}/out", "could not load the model"),
    ("policy probe --model {t}/tokenless --tasks {t}/dataset --device cuda:99 --out {t}/out", "cuda:99"),
    ("policy probe --model {t}/tokenless --tasks {t}/dataset --device bogus --out {t}/out", "not a device list"),
    ("train {t}/nonexistent.yaml", "not found"),
    ("train {t}/corrupt.yaml", "not valid YAML"),
    ("train {t}/types.yaml", "expected an integer"),
    ("train {t}/unknown.yaml", "did you mean group_size"),
    ("train --set rollout.group_size=abc --out {t}/out", "expected an integer"),
    ("train --set nosuch=1 --out {t}/out", "unknown config key"),
    ("train --set rollout --out {t}/out", "expected key=value"),
    ("train --rounds 0 --out {t}/out", "rounds: must be >= 1"),
    ("train --lr -1 --out {t}/out", "optim.lr"),
    ("train --schedule fast --out {t}/out", "schedule"),
    ("train --objective ppo --out {t}/out", "objective"),
    ("train --dtype float16 --out {t}/out", "model.dtype"),
    ("train --objective opd --set devices.teacher=0-3 --out {t}/out", "names 4 devices"),
    ("train --set rollout.engine=openai --out {t}/out", "rollout.servers"),
    ("train --set rollout.engine=openai --set rollout.servers=[ftp://x/y] --out {t}/out", "not a base URL"),
    ("train --set rollout.tensor_parallel=2 --out {t}/out", "only the vllm engine"),
    ("serve --model {t}/nonexistent --port 0", "not a model directory"),
    ("serve --model {t}/tokenless --host 0.0.0.0 --port 0", "without an API key"),  # (TSRL_API_KEY unset)
    ("serve --model {t}/tokenless --api-key 'two words' --port 0",
     "--api-key (or TSRL_API_KEY): an API key is visible"),
    ("serve --model {t}/tokenless --max-body-mb 0 --port 0", "--max-body-mb 0"),
    (("train --set rollout.engine=openai --set rollout.servers=[http://127.0.0.1:1] "
      "--set 'rollout.server_api_key=two words' --out {t}/out"), "rollout.server_api_key"),
    ("train --rollout-devices gpu --out {t}/out", "not a device list"),
    ("train --set model.policy={t}/nonexistent --set data.train=[builtin:echo] --out {t}/out", "not a model directory"),
    ("train --set model.policy={t}/tokenless --set data.train=[builtin:echo] --out {t}/out", "ChatML tokenizer"),
    (("train --set model.policy={t}/corrupt_policy --set data.train=[builtin:echo] --set rollout.thinking=true "
      "--out {t}/out"), "rollout.thinking true: this tokenizer's chat template declares no tools"),
    ("train --set data.train=[{t}/nonexistent] --set model.policy=builtin:toy --out {t}/out", "no such dataset"),
    ("train --set loss.ppo_epochs=2 --out {t}/out", "not exact under gradient streaming"),
    ("train --resume --out {t}/out", "holds no run"),
    ("bench speedup --schedules fast --out {t}/out", "--schedules"),
    ("bench speedup --repeats 0 --out {t}/out", "--repeats"),
    ("sweep {t}/nonexistent.yaml --dry-run", "not found"),
    ("sweep {t}/unknown.yaml --dry-run", "unknown config key"),
    ("sweep experiments/smoke/tiny_cpu.yaml --seeds a,b --dry-run", "--seeds"),
    ("sweep experiments/smoke/tiny_cpu.yaml --schedules fast --dry-run", "--schedules"),
    ("plan {t}/nonexistent.yaml", "experiment file not found"),
    ("plan {t}/unknown.yaml", "did you mean group_size"),
    ("plan experiments/node8/grpo_full.yaml --set model.policy_config={t}/plain_dir", "no config.json"),
    ("plan experiments/node8/grpo_full.yaml --set model.policy_config={t}/corrupt_config", "not a config transformers"),
    ("plan experiments/node8/grpo_full.yaml --capacity-gib nan", "--capacity-gib nan: must be a finite number"),
    ("predict --trace {t}/nonexistent", "not found"),
    ("predict --trace {t}/corrupt.jsonl", "not JSON"),
    ("calibrate {t}/nonexistent --out {t}/out", "not a folder"),
    ("calibrate {t}/plain_dir --out {t}/out", "no paired sync/stream rounds"),
    ("report {t}/nonexistent", "not found"),
    ("report {t} --warmup 40", "--warmup"),
    ("eval embedded --model {t}/nonexistent --out {t}/out", "no policy directory"),
    ("eval embedded --model {t}/tokenless --datasets {t}/nonexistent --out {t}/out", "no such dataset"),
    ("eval embedded --model {t}/tokenless --datasets {t}/plain_dir --out {t}/out", "no manifest.json"),
    ("eval embedded --model {t}/tokenless --datasets {t}/dataset --samples 0 --out {t}/out", "--samples 0"),
    ("eval embedded --model {t}/tokenless --datasets {t}/dataset --out {t}/out", "tokenizer"),
    ("eval embedded --model {t}/corrupt_policy --datasets {t}/dataset --out {t}/out", "could not load the model"),
    ("eval embedded --model {t}/corrupt_policy --datasets {t}/dataset --thinking --out {t}/out",
     "--thinking: this tokenizer's chat template declares no tools"),
    ("eval embedded --model {t}/corrupt_policy --datasets {t}/dataset --chat-template jinja --out {t}/out",
     "--chat-template 'jinja': use one of auto, chatml"),
    ("eval embedded --model {t}/tokenless --datasets {t}/dataset --device cuda:99 --out {t}/out", "cuda:99"),
    ("eval embedded --model {t}/tokenless --datasets {t}/dataset --device bogus --out {t}/out", "not a device list"),
    ("eval embedded --model {t}/tokenless --datasets {t}/dataset --device 0-1 --out {t}/out", "names 2 devices"),
    ("eval swebench --model x --device cuda:99 --out {t}/out", "cuda:99"),
    ("eval swebench --model x --engine tgi --out {t}/out", "--engine 'tgi'"),
    ("eval swebench --out {t}/out", "--model"),
    ("eval swebench --model x --dataset {t}/nonexistent --out {t}/out", "no such dataset"),
    ("eval swebench --grade-only {t}/nonexistent.jsonl --out {t}/out", "no such file"),
    ("eval swebench --grade-only {t}/corrupt.jsonl --out {t}/out", "not valid JSON"),
    ("eval tbench --dataset {t}/nonexistent --out {t}/out", "no such dataset"),
    ("eval tbench --dataset {t}/dataset --executor mars --model x --out {t}/out", "--executor"),
    ("eval tbench --dataset {t}/dataset --executor local --model {t}/tokenless --device bogus --out {t}/out",
     "not a device list"),
    ("eval tbench --dataset {t}/dataset --executor local --model {t}/tokenless --out {t}/out", "tokenizer"),
]
COMMANDS = {"verify", "prepare-data", "data show", "data check", "env exec", "env list", "policy probe", "train",
            "bench speedup", "sweep", "predict", "calibrate", "report", "eval embedded", "eval swebench", "eval tbench",
            "serve", "plan"}


@pytest.fixture(scope="module")
def bad(tmp_path_factory, prepare_fixture, tok):
    t = tmp_path_factory.mktemp("bad")
    (t / "corrupt.parquet").write_text("not parquet")
    (t / "corrupt.jsonl").write_text('{"group_id": "g", "sample_index": 0}\n{torn')
    (t / "wrong_fields.jsonl").write_text('{"a": 1}\n')
    (t / "corrupt.yaml").write_text(": : :\n")
    (t / "types.yaml").write_text("rollout:\n  group_size: abc\n")
    (t / "unknown.yaml").write_text("rollout:\n  grop_size: 4\n")
    (t / "plain_dir").mkdir()
    (t / "corrupt_manifest").mkdir()
    (t / "corrupt_manifest" / "manifest.json").write_text("{")
    (t / "corrupt_config").mkdir()
    (t / "corrupt_config" / "config.json").write_text("{")  # a model folder's config.json, torn
    (t / "corrupt_model").mkdir()
    (t / "corrupt_model" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (t / "corrupt_model" / "model.safetensors").write_text("junk")
    build_tiny_model(0, torch.float32).save_pretrained(t / "tokenless")  # weights, no tokenizer
    shutil.copytree(t / "corrupt_model", t / "corrupt_policy")  # corrupt weights beside a good ChatML tokenizer
    tok.save_pretrained(t / "corrupt_policy")
    prepare_fixture("terminal-bench", "tests/fixtures/terminal_bench", t / "dataset")
    return t


def test_every_command_is_in_the_table():
    covered = {next(c for c in COMMANDS if line.startswith(c + " ") and not any(
        d != c and d.startswith(c) and line.startswith(d + " ") for d in COMMANDS)) for line, _ in CASES}
    assert covered == COMMANDS


@pytest.mark.parametrize("line,word", CASES, ids=[c[0].replace("{t}/", "") for c in CASES])
def test_bad_input_is_one_line_and_exit_2(bad, line, word):
    shutil.rmtree(bad / "out", ignore_errors=True)  # each case starts without an output folder
    before = {p for p in bad.rglob("*")}
    res = CliRunner().invoke(app, shlex.split(line.format(t=bad)))
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, (res.exit_code, res.output[-2000:], res.exception)
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines  # one error line, last
    assert word in errors[0] and "Traceback" not in res.output and res.stdout == "", res.output[-2000:]
    made = {p for p in bad.rglob("*")} - before
    assert not [p for p in made if ".tmp" in p.name], made  # no temporary left behind
    assert not (bad / "out").exists() or not any((bad / "out").iterdir()), sorted((bad / "out").rglob("*"))
