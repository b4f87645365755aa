"""Demonstrations run in real environments, rendered as the agent loop renders them; SFT on them."""

import asyncio
import subprocess
from dataclasses import replace

import pytest
import torch

from tsrl_cli.agent.loop import AgentLimits, run_agent
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.datasets.store import open_dataset
from tsrl_cli.embedded.policy.demos import (
    DemoConfig,
    demo_to_trajectory,
    line_edit,
    make_demos,
    run_demo,
    sed_replace,
    train_policy_tokenizer,
)
from tsrl_cli.embedded.policy.sft import SFTConfig, collate, encode_demos, masked_nll, train_sft
from tsrl_cli.embedded.prepare import prepare_embedded
from tsrl_cli.engines.batching import TurnBatcher
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.envs.tasks import make_env
from tsrl_cli.policy import build_tiny_model, load_policy, save_policy

torch.set_num_threads(1)
pytestmark = pytest.mark.sandboxed
SMALL = {"repos": ["roman", "money"], "max_per_repo": 2, "n_terminal_train": 6, "n_terminal_heldout": 3}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prepare_embedded(root, seed=0, **SMALL)
    return open_dataset(root / "embedded_repair_train").pairs, open_dataset(root / "embedded_terminal_train").pairs


@pytest.fixture(scope="module")
def demos(suite):
    repair, terminal = suite
    (rd, rt), (td, tt) = repair[0], terminal[0]
    out = {}
    for d, t, variants in ((rd, rt, ("correct", "wrong", "corrected", "no_fix")), (td, tt, ("correct", "wrong"))):
        for v in variants:
            out[(t.kind, v)] = asyncio.run(run_demo(t, d, v))
    return out


@pytest.fixture(scope="module")
def tok(demos):
    return train_policy_tokenizer(list(demos.values()), vocab_size=600)


def test_line_edit_and_sed_escaping(tmp_path):
    cases = [("    (4, \"IX\"),", "    (4, \"IV\"),"), ("        if balance <= 0:", "        if balance < 0:"),
             ("    return a/b.c & d[0]*2", "    return a/b.c & d[1]*2"), ("x = 'a.b' + y", "x = 'a/b' + y"),
             ("for i in range(n):", "for i in range(n - 1):"), ("s = t[i + 1:]", "s = t[i:]")]
    for old, new in cases:
        a, b = line_edit(old, new)
        assert old.replace(a, b, 1) == new and a.strip()
        f = tmp_path / "f.py"
        f.write_text(f"first\n{old}\nlast {old}\n")
        subprocess.run(["bash", "-c", sed_replace(2, a, b, "f.py")], cwd=tmp_path, check=True)
        assert f.read_text() == f"first\n{new}\nlast {old}\n", (old, new)


def test_demos_are_real(demos):
    assert demos[("repair", "correct")]["reward"] == 1.0
    assert demos[("repair", "corrected")]["reward"] == 1.0
    assert demos[("repair", "wrong")]["reward"] == 0.0
    assert demos[("repair", "no_fix")]["reward"] == 0.0
    assert demos[("terminal", "correct")]["reward"] == 1.0
    assert demos[("terminal", "wrong")]["reward"] == 0.0
    d = demos[("repair", "correct")]
    roles = [m["role"] for m in d["messages"]]
    assert roles[-1] == "assistant" and d["messages"][-1]["content"].endswith("```bash\nsubmit\n```")
    assert all(m["content"].startswith("[exit code ") for m in d["messages"] if m["role"] == "observation")
    assert "sed -i '" in d["messages"][2]["content"]  # turn 2 is the fix


@pytest.mark.slow
def test_trajectory_is_what_the_agent_loop_records(suite, demos, tok):
    """Replaying a demo's assistant turns through run_agent in a fresh environment gives the same tokens."""
    renderer = ChatMLRenderer(tok)
    limits = AgentLimits(max_turn_tokens=1000, max_trajectory_tokens=8000)
    for (kind, variant), demo in demos.items():
        d, task = (suite[0] if kind == "repair" else suite[1])[0]
        turns = [m["content"] for m in demo["messages"] if m["role"] == "assistant"]
        engine = ScriptedEngine(tok, lambda ctx, k, turns=turns: turns[k])
        batcher = TurnBatcher(engine)
        env = make_env(task, d)

        async def go(env=env, batcher=batcher):
            await env.start()
            try:
                return await run_agent(env, batcher.generate, renderer, group_id="g", sample_index=0, limits=limits)
            finally:
                await env.close()

        try:
            res = asyncio.run(go())
        finally:
            batcher.close()
        traj = demo_to_trajectory(demo, renderer)
        assert res.rollout.input_ids == traj.input_ids, (kind, variant)
        assert res.rollout.loss_mask == traj.loss_mask
        assert [tuple(s) for s in res.rollout.turn_spans] == traj.turn_spans
        assert res.rollout.reward == demo["reward"]
        # mask 1 exactly on the assistant turns (with their <|im_end|>)
        masked = [t for t, m in zip(traj.input_ids, traj.loss_mask, strict=True) if m]
        assert masked == [x for t in turns for x in renderer.encode(t) + [renderer.im_end]]


def test_make_demos_is_deterministic(suite):
    tasks = suite[1][:3]
    cfg = DemoConfig(seed=3, extra_fraction=1.0)
    a, b = make_demos(tasks, cfg), make_demos(tasks, cfg)
    strip = [{k: v for k, v in d.items() if k != "seconds"} for d in a]
    assert strip == [{k: v for k, v in d.items() if k != "seconds"} for d in b]
    assert len(a) == 6 and {d["variant"] for d in a} > {"correct"}


def _tiny_cfg(**kw):
    return replace(SFTConfig(hidden=32, layers=1, epochs=4, batch_size=2, lr=3e-3, warmup_steps=2,
                             max_positions=2048, seed=5), **kw)


@torch.no_grad()
def evaluate_nll(model, seqs, pad_id: int) -> float:
    """Mean NLL over the loss tokens of all sequences (one batch each)."""
    tot = n = 0.0
    for i in range(len(seqs)):
        loss, cnt = masked_nll(model, *collate(seqs, [i], pad_id))
        tot, n = tot + float(loss) * cnt, n + cnt
    return tot / n


def test_sft_reduces_loss_and_is_deterministic(demos, tok):
    seqs = encode_demos(list(demos.values()), tok)
    cfg = _tiny_cfg()
    runs = []
    for _ in range(2):
        m = build_tiny_model(cfg.seed, vocab_size=len(tok), hidden=cfg.hidden, layers=cfg.layers,
                             max_positions=cfg.max_positions, pad_id=tok.pad_token_id)
        before = evaluate_nll(m, seqs, tok.pad_token_id)
        log = train_sft(m, seqs, cfg, pad_id=tok.pad_token_id)
        runs.append((before, evaluate_nll(m, seqs, tok.pad_token_id), log, m))
    (b0, a0, log0, m0), (_, a1, log1, m1) = runs
    assert a0 < b0 - 0.5, (b0, a0)
    assert [r["loss"] for r in log0] == [r["loss"] for r in log1] and a0 == a1
    for p, q in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(r["tokens"] > 0 for r in log0)


def test_save_load_round_trip(tmp_path, suite, demos, tok):
    cfg = _tiny_cfg(epochs=1)
    m = build_tiny_model(cfg.seed, vocab_size=len(tok), hidden=cfg.hidden, layers=cfg.layers,
                         max_positions=cfg.max_positions, pad_id=tok.pad_token_id)
    train_sft(m, encode_demos(list(demos.values()), tok), cfg, pad_id=tok.pad_token_id)
    save_policy(m, tok, tmp_path / "pol")
    m2, tok2 = load_policy(tmp_path / "pol")
    ids = torch.tensor([tok.encode("THOUGHT: fix it\n```bash\nsubmit\n```")])
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, m2(input_ids=ids).logits)
    assert tok2.encode("sed -i '3s/a/b/' x.py") == tok.encode("sed -i '3s/a/b/' x.py")


def test_a_timed_out_command_reruns_the_demo_with_a_longer_timeout(suite, demos, monkeypatch):
    """A tool call killed by the timeout (a busy machine) makes the whole demonstration run again with 4x the
    timeout, so its text does not depend on the load; a command that times out on the retry too is kept."""
    import types

    import tsrl_cli.embedded.policy.demos as tasks_mod  # where run_demo finds make_env

    (d, t), real_make_env = suite[0][0], tasks_mod.make_env
    timeouts: list[list[float]] = []

    def patched(always: bool):
        def make(*a, **kw):
            env, calls = real_make_env(*a, **kw), []
            timeouts.append(calls)
            real_run = env.run

            async def run(cmd, timeout):
                calls.append(timeout)
                if always or len(timeouts) == 1:  # the first command of the first attempt is "killed"
                    return types.SimpleNamespace(output="", exit_code=137, limit="wall_clock")
                return await real_run(cmd, timeout)
            env.run = run
            return env
        return make

    monkeypatch.setattr(tasks_mod, "make_env", patched(always=False))
    again = asyncio.run(run_demo(t, d, "correct"))
    assert len(timeouts) == 2 and timeouts[1][0] == 4 * timeouts[0][0] == 40.0
    strip = lambda x: {k: v for k, v in x.items() if k != "seconds"}  # noqa: E731
    assert strip(again) == strip(demos[("repair", "correct")])  # the retry's text is the unloaded one

    timeouts.clear()
    monkeypatch.setattr(tasks_mod, "make_env", patched(always=True))
    hung = asyncio.run(run_demo(t, d, "correct"))
    assert len(timeouts) == 2  # one retry only: a command that hangs every time is the demo's behavior
    assert "[limit: wall_clock]" in next(m["content"] for m in hung["messages"] if m["role"] == "observation")
