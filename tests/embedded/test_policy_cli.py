"""`tsrl policy probe` through the CLI: a tiny random ChatML policy on a small embedded slice."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.embedded.prepare import prepare_embedded
from tsrl_cli.models import build_tiny_model
from tsrl_cli.tokenizer import train_chatml_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("p")
    prepare_embedded(root / "data", seed=0, repos=["roman", "money"], max_per_repo=2, n_terminal_train=3,
                     n_terminal_heldout=3)
    tok = train_chatml_tokenizer(["```bash\nls -la\n```", "Make the script executable."] * 20, vocab_size=300)
    build_tiny_model(0, torch.float32, vocab_size=len(tok)).save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    return root


def test_probe_json(setup):
    res = runner.invoke(app, ["policy", "probe", "--model", str(setup / "policy"), "--tasks",
                              str(setup / "data" / "embedded_terminal_train"), "--limit", "1", "--samples", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["all"]["trajectories"] == 2 and len(doc["results"]) == 2
    assert 0.0 <= doc["all"]["success_rate"] <= 1.0 and "p50" in doc["duration_s"]


def test_probe_bad_model_exit_2(setup, tmp_path):
    res = runner.invoke(app, ["policy", "probe", "--model", str(tmp_path), "--tasks", "x"])
    assert res.exit_code == 2 and "not a policy directory" in res.stderr
