"""Shared fixtures for the evaluation tests: a small held-out embedded suite and a tiny random policy folder
(the ChatML tokenizer `tok` is the root conftest's)."""

import json
from dataclasses import asdict

import pytest


@pytest.fixture(scope="session")
def suite(tmp_path_factory):
    """The two held-out embedded sets, small: 3 repair tasks (repository `money`), 3 terminal tasks.

    Built like `tsrl prepare-data embedded` (validated tasks, then the same prepare path), minus the
    training sets, which these tests do not need.
    """
    from tsrl_cli.datasets.prepare import PrepareOptions, prepare
    from tsrl_cli.embedded.repair_suite import build_repair_suite
    from tsrl_cli.embedded.terminal_suite import build_terminal_suite

    root = tmp_path_factory.mktemp("data")
    stage = tmp_path_factory.mktemp("stage")
    repair = build_repair_suite(stage, 0, repos=["money"], heldout=("money",), max_per_repo=3)
    with open(stage / "repair_heldout.jsonl", "w") as f:
        f.writelines(json.dumps(asdict(t)) + "\n" for t in repair["heldout"])
    build_terminal_suite(stage, 0, n_train=0, n_heldout=3)
    for name, source, origin in [
            ("embedded_repair_heldout", "embedded-repair-heldout", stage / "repair_heldout.jsonl"),
            ("embedded_terminal_heldout", "embedded-terminal-heldout", stage / "terminal" / "heldout")]:
        prepare(PrepareOptions(source=source, origin=str(origin), out=str(root / name), on_error="fail"))
    return root


@pytest.fixture(scope="session")
def ckpt(tok, tmp_path_factory):
    """A policy directory as `tsrl train` writes one (save_pretrained model + tokenizer): tiny, random."""
    from tsrl_cli.policy import build_tiny_model, save_policy

    model = build_tiny_model(0, vocab_size=len(tok), hidden=32, layers=1, max_positions=2048, pad_id=tok.pad_token_id,
                             eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return save_policy(model, tok, tmp_path_factory.mktemp("ckpt") / "policy")
