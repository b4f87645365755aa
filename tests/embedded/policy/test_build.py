"""The default-policy build: made-up-name terminal instances, the validated-state reward shortcut
(checked against the real verifier), a tiny end-to-end build, bit-identical to its branches run in
one process, and the build key that lets a fresh checkout keep the shipped policy."""

import asyncio
import json
from dataclasses import replace

import pytest
import torch

from tsrl_cli.datasets.patches import apply_one_line_patch, parse_one_line_patch
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.embedded.policy.build import PolicyBuildConfig, augment_terminal, build_key, key_config, pseudo_words
from tsrl_cli.embedded.policy.copy_curriculum import CopyCurriculum
from tsrl_cli.embedded.policy.demos import DemoConfig, run_demo
from tsrl_cli.embedded.prepare import prepare_embedded
from tsrl_cli.embedded.terminal_suite import POOLS
from tsrl_cli.envs import repair as repair_env
from tsrl_cli.policy import load_policy

torch.set_num_threads(1)
pytestmark = pytest.mark.sandboxed
SMALL = {"repos": ["roman", "money"], "max_per_repo": 3, "n_terminal_train": 4, "n_terminal_heldout": 2}
# the shipped recipe at toy size: every phase runs, in seconds
TINY = PolicyBuildConfig(aug_terminal=6, vocab_size=400, hidden=32, layers=1, max_positions=2048, student_epochs=1,
                         teacher_epochs=2, demos=DemoConfig(concurrency=2),
                         copy=CopyCurriculum(drill_steps=2, family_steps=2, drill_batch=4, family_batch=2, sft_batch=4,
                                             repair_repeat=2),
                         teacher_repair_repeat=3)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("data")
    prepare_embedded(r, seed=0, **SMALL)
    return r


def test_one_line_patch_round_trip(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nif x <= 0:\n    y = 2\n")
    patch = "--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n a = 1\n-if x <= 0:\n+if x < 0:\n     y = 2\n"
    assert parse_one_line_patch(patch) == ("m.py", 2, "if x <= 0:", "if x < 0:")
    assert apply_one_line_patch(tmp_path, patch)
    assert (tmp_path / "m.py").read_text() == "a = 1\nif x < 0:\n    y = 2\n"
    assert not apply_one_line_patch(tmp_path, patch)  # the old line is gone: no silent second edit


def test_made_up_names_avoid_every_split(tmp_path):
    words = pseudo_words(__import__("random").Random(0), 200)
    assert len(set(words)) == 200 and not set(words) & (set(POOLS["train"]) | set(POOLS["heldout"]))
    a = augment_terminal(tmp_path / "a", 8, seed=0)
    b = augment_terminal(tmp_path / "b", 8, seed=0)
    assert [t.instruction for _, t in a] == [t.instruction for _, t in b]  # deterministic for a seed
    assert len({t.instruction for _, t in a}) == len(a) >= 7


@pytest.mark.slow
def test_validated_states_give_the_verifiers_reward(root, monkeypatch):
    """Start, gold and a wrong state: the shortcut's reward equals pytest's; a wrong state runs pytest."""
    d, t = open_dataset(root / "embedded_repair_train").pairs[0]
    fast = {v: asyncio.run(run_demo(t, d, v)) for v in ("correct", "no_fix", "wrong")}
    assert "validated at build" in fast["correct"]["reason"] and fast["correct"]["reward"] == 1.0
    assert "validated at build" in fast["no_fix"]["reason"] and fast["no_fix"]["reward"] == 0.0
    from tsrl_cli.envs.tasks import make_env

    async def other_state():  # the gold edit plus one extra file: not a validated state, pytest must run
        env = make_env(t, d)
        await env.start()
        try:
            apply_one_line_patch(env.sandbox.workdir, t.gold_patch)
            (env.sandbox.workdir / "notes.txt").write_text("x")
            return env._known_reward(), await env.reward()
        finally:
            await env.close()

    known, rew = asyncio.run(other_state())
    assert known is None and rew.reward == 1.0 and "validated" not in rew.reason
    monkeypatch.setattr(repair_env.RepairEnv, "_known_reward", lambda self: None)
    for v, res in fast.items():
        real = asyncio.run(run_demo(t, d, v))
        assert real["reward"] == res["reward"] and "validated" not in real["reason"], (v, real, res)


@pytest.mark.slow
def test_tiny_build_end_to_end_reuse_and_branches(root, tmp_path):
    """The recipe end to end: word-stable tokenizer, the student's phase C without the terminal training
    split's demonstrations, the teacher's with only the solved ones (its own repair repeat); kept when built
    again from the same data and config; both branches bit-identical to a reference run in this process."""
    res = prepare_embedded(root, seed=0, build_policy=True, policy=TINY, policy_out=tmp_path / "pol", **SMALL)
    pol = res["policy"]
    assert not pol["unchanged"] and pol["recipe"] == "copy" and pol["key"] == build_key(root, TINY)
    again = prepare_embedded(root, seed=0, build_policy=True, policy=TINY, policy_out=tmp_path / "pol", **SMALL)
    assert again["policy"]["unchanged"]  # same training sets and config: kept
    assert build_key(root, replace(TINY, teacher_epochs=3)) != pol["key"]
    demos = [json.loads(x) for x in (tmp_path / "pol" / "demos.jsonl").read_text().splitlines()]
    assert any(d["task_id"].startswith("aug-") for d in demos)
    train_terminal = [d for d in demos if d["kind"] == "terminal" and not d["task_id"].startswith("aug-")]
    repair = [d for d in demos if d["kind"] == "repair"]
    solved = [d for d in demos if d["reward"] == 1.0]
    solved_repair = [d for d in solved if d["kind"] == "repair"]
    assert train_terminal and repair and len(solved_repair) < len(repair)  # some failed attempts to leave out
    assert pol["sequences_per_epoch"] == {"teacher": len(solved) + 2 * len(solved_repair),
                                          "student": len(demos) - len(train_terminal) + len(repair)}
    s, tok = load_policy(tmp_path / "pol" / "student")
    te, tok_t = load_policy(tmp_path / "pol" / "teacher")
    assert next(s.parameters()).dtype == torch.float32  # stored in bf16, loaded in the asked dtype
    assert tok.get_vocab() == tok_t.get_vocab()  # OPD needs one tokenizer
    assert tok("`plum`")["input_ids"][1:-1] == tok(" plum")["input_ids"][1:]  # word-stable: same ids in any context
    assert len(s.model.layers) == 1
    assert any(not torch.equal(a, b) for a, b in zip(s.parameters(), te.parameters(), strict=True))
    for role in ("student", "teacher"):
        info = json.loads((tmp_path / "pol" / role / "policy.json").read_text())
        assert info["role"] == role and info["sft_epochs"] == {"student": 1, "teacher": 2}[role]

    # reference: both branches again in this process, one after the other from one phase-B state (the
    # build ran the teacher's in a spawned process from a saved state); the weights must be equal bit for bit
    from tsrl_cli.embedded.policy.build import new_model
    from tsrl_cli.embedded.policy.copy_curriculum import CopyTrainer
    from tsrl_cli.embedded.policy.demos import train_policy_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rtok = train_policy_tokenizer(demos, TINY.vocab_size, word_stable=True)
        ref_s = CopyTrainer(new_model(rtok, TINY), rtok, TINY.copy, 0)
        ref_s.pretrain()
        ref_t = ref_s.fork()
        ref_s.sft([d for d in demos if d not in train_terminal] + repair, 1)  # repair_repeat=2: twice per epoch
        ref_t.sft(solved + solved_repair * 2, 2)  # teacher: solved demos only, the repair ones 3 times
    finally:
        torch.set_num_threads(threads)
    for built, ref in ((s, ref_s.model), (te, ref_t.model)):
        for (name, a), b in zip(built.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b.detach().to(torch.bfloat16).float()), name


def test_default_config_is_the_shipped_build():
    """data/embedded_policy/build.json records the config and key of the shipped policy; the default config
    hashes to that key (with the training records' hashes it stored), so `tsrl prepare-data embedded` on a
    fresh checkout keeps the shipped policy instead of retraining it (about 45 min on 2 cores)."""
    from pathlib import Path

    from tsrl_cli.embedded.policy.build import key_of

    shipped = json.loads((Path(__file__).parents[3] / "data" / "embedded_policy" / "build.json").read_text())
    assert key_config(PolicyBuildConfig()) == shipped["config"]
    assert key_of(shipped["train_records_sha256"], PolicyBuildConfig(), shipped["torch"]) == shipped["key"]
    assert key_of(shipped["train_records_sha256"], replace(PolicyBuildConfig(), layers=3), shipped["torch"]) \
        != shipped["key"]  # positive control: the config is part of the key
