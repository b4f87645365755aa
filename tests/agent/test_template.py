"""The agent through a model's own chat template: Qwen3's (tests/fixtures/chat_templates), on the local BPE.

The references are the template itself: `tokenizer.apply_chat_template(..., tokenize=True)` for the first
prompt, and for a tool result the token suffix of the template's rendering of the whole conversation
after the assistant turn's <|im_end|>, found in token space (the renderer cuts in text space). Each check
has a positive control that shows it can fail: a prompt without tools, a rendering Qwen3 rewrites, a
template whose tool results depend on the history.
"""

import asyncio
from pathlib import Path

import pytest

from tsrl_cli.agent.actions import Action
from tsrl_cli.agent.loop import AgentLimits, RewardResult, ToolResult, observation_text, run_agent
from tsrl_cli.agent.oracle import OracleSession, oracle_turns
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.agent.template import TemplateRenderer, make_renderer
from tsrl_cli.agent.toolcalls import TOOL_SYSTEM_PROMPT, TOOLS, parse_tool_call
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.errors import UsageError
from tsrl_cli.rollouts import parse_rollout
from tsrl_cli.tokenizer import with_chat_template

QWEN3 = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
QWEN3_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's generation prompt with enable_thinking false


@pytest.fixture(scope="module")
def qtok(tok):
    """The project's local BPE (tests/conftest.py `tok`) with Qwen3's template and the tokens it writes."""
    return with_chat_template(tok, QWEN3, QWEN3_TOKENS)


class ScriptedEnv:
    """A test double: answers commands from a dict, records them, reward 1."""

    def __init__(self, answers=None):
        self.task_id, self.instruction = "t1", "List the files, then submit."
        self.answers, self.calls = answers or {}, []

    async def run(self, command, timeout_s):
        self.calls.append(command)
        out, code = self.answers.get(command, ("", 0))
        return ToolResult(out, code, 0.0)

    async def reward(self):
        return RewardResult(1.0, "ok")

    async def close(self):
        pass


def play(env, renderer, replies, max_turns=8):
    """run_agent with a scripted engine (a test double: replies, not samples); also returns what it sampled."""
    engine = ScriptedEngine(renderer.tok, lambda ctx, k: replies[min(k, len(replies) - 1)])
    sampled, snapshots = [], []

    async def generate(request):
        out = engine.generate([request])[0]
        sampled.append(list(out.token_ids))
        return out

    res = asyncio.run(run_agent(env, generate, renderer, group_id="g", sample_index=0,
                                limits=AgentLimits(max_turns=max_turns, max_turn_tokens=512,
                                                   max_trajectory_tokens=8192),
                                on_turn=lambda traj, k, last: snapshots.append(list(traj.input_ids))))
    parse_rollout(res.rollout.to_json(), "test")
    return res, sampled, snapshots


def template_ids(qtok, messages, thinking=False, tools=True):
    out = qtok.apply_chat_template(messages, tools=list(TOOLS) if tools else None, add_generation_prompt=True,
                                   enable_thinking=thinking, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def system_user(instruction):
    return [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, {"role": "user", "content": instruction}]


def test_auto_is_the_template_for_qwen3_and_chatml_for_the_builtin_tokenizer(tok, qtok):
    assert isinstance(make_renderer(qtok), TemplateRenderer)
    assert isinstance(make_renderer(tok), ChatMLRenderer)  # its ChatML template declares no tools
    assert isinstance(make_renderer(qtok, "chatml"), ChatMLRenderer)
    with pytest.raises(UsageError, match="use one of auto, chatml"):
        make_renderer(qtok, "qwen")
    with pytest.raises(UsageError, match="rollout.thinking true: model.chat_template is chatml"):
        make_renderer(qtok, "chatml", thinking=True)
    with pytest.raises(UsageError, match="declares no tools, so auto renders ChatML"):
        make_renderer(tok, thinking=True)


def test_first_prompt_is_the_templates_rendering(qtok):
    r = make_renderer(qtok)
    ref = template_ids(qtok, system_user("Fix calc.py."))
    assert r.prompt(TOOL_SYSTEM_PROMPT, "Fix calc.py.") == ref
    text = qtok.decode(ref, skip_special_tokens=False)
    assert '"name": "bash"' in text and '"name": "submit"' in text and text.endswith(THINK_OFF)  # tools as schemas
    # positive controls: the same messages without the tools, or with thinking on, are other tokens
    assert template_ids(qtok, system_user("Fix calc.py."), tools=False) != ref
    assert template_ids(qtok, system_user("Fix calc.py."), thinking=True) != ref


def test_a_tool_result_is_the_templates_delta_after_the_sampled_turn(qtok):
    r = make_renderer(qtok)
    call = r.call_text("bash", {"command": "ls"}, "I look first.")
    env = ScriptedEnv({"ls": ("calc.py", 0)})
    res, sampled, _ = play(env, r, [call, r.call_text("submit", {})])
    assert res.exit_reason == "submitted" and env.calls == ["ls"] and res.tool_call_errors == []
    ids, spans = res.rollout.input_ids, res.rollout.turn_spans
    prompt = template_ids(qtok, system_user(env.instruction))
    assert ids[:len(prompt)] == prompt and spans[0] == (len(prompt), len(prompt) + len(sampled[0]))
    assert [ids[s:e] for s, e in spans] == sampled  # the sampled ids are kept as sampled
    # the reference delta: the template renders the whole conversation; take the tokens after the assistant
    # turn's <|im_end|> (the third one: system, user, assistant), found in token space
    obs = observation_text("calc.py", 0, None, AgentLimits().max_observation_chars)
    turn_text = qtok.decode(sampled[0][:-1], skip_special_tokens=False)
    full = template_ids(qtok, system_user(env.instruction) + [{"role": "assistant", "content": turn_text},
                                                              {"role": "tool", "content": obs}])
    im_end = qtok.convert_tokens_to_ids("<|im_end|>")
    third = [i for i, t in enumerate(full) if t == im_end][2]
    delta = full[third + 1:]
    assert ids[spans[0][1]:spans[1][0]] == delta
    assert qtok.decode(delta, skip_special_tokens=False).startswith(
        "\n<|im_start|>user\n<tool_response>\n[exit code 0]")
    # positive control: Qwen3 renders that earlier turn without the generation prompt's empty think block,
    # so the full rendering is not the context the model sampled its turn after
    assert full[:spans[0][1]] != ids[:spans[0][1]]


def test_the_delta_never_changes_tokens_already_sampled(qtok):
    """Four turns through a template that rewrites earlier turns: each turn's context is a prefix of the next."""
    r = make_renderer(qtok)
    env = ScriptedEnv({"ls": ("a.py", 0), "cat a.py": ("x = 1", 0), "pwd": ("/app", 0)})
    replies = [r.call_text("bash", {"command": c}) for c in ("ls", "cat a.py", "pwd")] + [r.call_text("submit", {})]
    res, sampled, snapshots = play(env, r, replies)
    ids = res.rollout.input_ids
    assert len(snapshots) == 4 and all(ids[:len(s)] == s for s in snapshots)
    assert [ids[s:e] for s, e in res.rollout.turn_spans] == sampled
    # positive control: re-rendering the conversation through the template (each turn an assistant message)
    # changes tokens before the last turn: Qwen3 drops every earlier turn's empty think block
    msgs = system_user(env.instruction)
    for out, cmd in zip(sampled[:-1], ("ls", "cat a.py", "pwd"), strict=True):  # each turn before the submit
        msgs += [{"role": "assistant", "content": qtok.decode(out[:-1], skip_special_tokens=False)},
                 {"role": "tool", "content": observation_text(env.answers[cmd][0], 0, None, 2000)}]
    rerendered = template_ids(qtok, msgs)
    assert rerendered[:len(snapshots[1])] != snapshots[1]
    assert qtok.decode(ids, skip_special_tokens=False).count(THINK_OFF) == 4  # every turn's, as it was sampled
    assert qtok.decode(rerendered, skip_special_tokens=False).count(THINK_OFF) == 1  # the last one only


def test_a_template_whose_tool_results_depend_on_the_history_is_refused(qtok):
    """The check behind the delta: a tool result rendered with the message's position in it is refused."""
    counting = QWEN3.replace("{{- '\\n<tool_response>\\n' }}",
                             "{{- '\\n<tool_response>' + loop.index|string + '\\n' }}")
    assert counting != QWEN3
    with pytest.raises(UsageError, match="renders a tool result differently after different conversations"):
        make_renderer(with_chat_template(qtok, counting))


def test_tool_call_kinds():
    ok = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    assert parse_tool_call("THOUGHT\n" + ok) == Action("bash", "ls -la")
    assert parse_tool_call('<tool_call>{"name": "submit", "arguments": {}}</tool_call>') == Action("submit")
    assert parse_tool_call('<tool_call>{"name": "submit"}</tool_call>') == Action("submit")  # no required args
    assert parse_tool_call('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>') \
        == Action("bash", "ls")  # arguments as a JSON string, OpenAI's wire format
    assert parse_tool_call("<think>maybe <tool_call>{}</tool_call></think>" + ok) == Action("bash", "ls -la")
    kinds = {
        "no_call": "I will just think.",
        "multiple_calls": ok + ok,
        "unclosed_call": '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}',
        "invalid_json": '<tool_call>{"name": "bash", "arguments": {"command": "ls"}</tool_call>',
        "unknown_tool": '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',
        "missing_arguments": '<tool_call>{"name": "bash", "arguments": {}}</tool_call>',
        "bad_arguments": '<tool_call>{"name": "bash", "arguments": {"command": 3}}</tool_call>',
    }
    assert {k: parse_tool_call(t).error for k, t in kinds.items()} == {k: k for k in kinds}
    assert parse_tool_call('<tool_call>["bash"]</tool_call>').error == "invalid_json"
    assert parse_tool_call('<tool_call>{"arguments": {"command": "ls"}}</tool_call>').error == "unknown_tool"


def test_each_unparseable_call_is_counted_and_answered(qtok):
    r = make_renderer(qtok)
    env = ScriptedEnv({"ls": ("a.py", 0)})
    replies = ['<tool_call>{"name": "bash", "arguments": {"command": "ls"}</tool_call>',  # invalid JSON
               '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',
               '<tool_call>{"name": "bash", "arguments": {}}</tool_call>',
               r.call_text("bash", {"command": "ls"}), r.call_text("submit", {})]
    res, _, _ = play(env, r, replies)
    assert res.exit_reason == "submitted" and env.calls == ["ls"]
    assert res.tool_call_errors == ["invalid_json", "unknown_tool", "missing_arguments"]
    turns = [e for e in res.events if e["event"] == "turn_close"]
    assert [e["tool_call_error"] for e in turns] == ["invalid_json", "unknown_tool", "missing_arguments", None, None]
    assert next(e for e in res.events if e["event"] == "trajectory_end")["tool_call_errors"] == 3
    text = qtok.decode(res.rollout.input_ids, skip_special_tokens=False)
    for kind in res.tool_call_errors:  # each answered in a user turn naming the kind, then the generation prompt
        assert f"<|im_start|>user\nTool call error ({kind}):" in text
    assert text.count("<tool_response>") == 1  # only the call that ran has a tool result
    # the ChatML format counts its format errors the same way (a reply without one bash block)
    res, _, _ = play(ScriptedEnv(), ChatMLRenderer(qtok), ["no block here", "```bash\nsubmit\n```"])
    assert res.tool_call_errors == ["no_call"] and res.exit_reason == "submitted"


def test_enable_thinking_reaches_the_template(qtok):
    on, off = make_renderer(qtok, thinking=True), make_renderer(qtok, thinking=False)
    assert qtok.decode(off.prompt("S", "U"), skip_special_tokens=False).endswith(THINK_OFF)
    assert qtok.decode(on.prompt("S", "U"), skip_special_tokens=False).endswith("<|im_start|>user\nU<|im_end|>\n"
                                                                               "<|im_start|>assistant\n")
    assert on.prompt("S", "U") == template_ids(qtok, [{"role": "system", "content": "S"},
                                                      {"role": "user", "content": "U"}], thinking=True)
    assert qtok.decode(off.observation("x"), skip_special_tokens=False).endswith(THINK_OFF)
    assert not qtok.decode(on.observation("x"), skip_special_tokens=False).endswith(THINK_OFF)
    assert on.label != off.label
    # a thinking model's reasoning comes first in its turn and is not parsed as the call
    turn = "<think>\nls or pwd? <tool_call>{}</tool_call>\n</think>\n\n" + on.call_text("bash", {"command": "ls"})
    assert on.parse(qtok.encode(turn, add_special_tokens=False) + [on.end_of_turn]) == Action("bash", "ls")
    # a tool template without the switch: thinking true is refused, false is fine
    no_switch = QWEN3.replace("enable_thinking is defined and enable_thinking is false", "true")
    assert no_switch != QWEN3
    with pytest.raises(UsageError, match="no thinking switch"):
        make_renderer(with_chat_template(qtok, no_switch), thinking=True)
    assert isinstance(make_renderer(with_chat_template(qtok, no_switch)), TemplateRenderer)


def test_a_template_with_other_tool_calls_is_refused(qtok):
    other = QWEN3.replace("<tool_call>", "[TOOL_CALLS]").replace("</tool_call>", "[/TOOL_CALLS]")
    with pytest.raises(UsageError, match="Hermes"):
        make_renderer(with_chat_template(qtok, other))


def test_the_oracle_speaks_the_runs_format(tok, qtok):
    chatml = ChatMLRenderer(tok)  # the text format's turns, unchanged
    assert oracle_turns(chatml, "ls") == ["THOUGHT: I play the task's reference solution.\n```bash\nls\n```",
                                          "```bash\nsubmit\n```"]
    r = make_renderer(qtok)
    command = "printf 'a \"b\"\\n$HOME' > x\ncat <<'EOF'\n<tag>\nEOF"  # quotes, newlines, $ and <> survive JSON
    turns = oracle_turns(r, command)
    assert [r.parse(r.encode(t) + [r.end_of_turn]) for t in turns] == [Action("bash", command), Action("submit")]
    assert all(t.count("<tool_call>") == 1 for t in turns)


@pytest.mark.sandboxed
def test_the_oracle_scores_1_on_an_embedded_terminal_task_in_the_qwen3_format(tmp_path, qtok, prepare_fixture):
    from tsrl_cli.datasets.store import open_dataset
    from tsrl_cli.embedded.terminal_suite import build_terminal_suite
    from tsrl_cli.envs.tasks import make_env

    build_terminal_suite(tmp_path / "suite", seed=0, n_train=1, n_heldout=0)
    ds = open_dataset(str(prepare_fixture("seta-env", tmp_path / "suite" / "terminal" / "train", tmp_path / "ds")))
    r = make_renderer(qtok)

    async def main(task):
        env = make_env(task, ds.path)
        await env.start()
        try:
            oracle = OracleSession(r, env.oracle_command(), 0, task.task_id)
            return await run_agent(env, oracle.generate, r, group_id=task.task_id, sample_index=0,
                                   limits=AgentLimits(max_turns=3, max_turn_tokens=100_000,
                                                      max_trajectory_tokens=200_000))
        finally:
            await env.close()

    res = asyncio.run(main(ds.tasks[0]))
    assert res.exit_reason == "submitted" and res.tool_call_errors == [] and res.rollout.reward == 1.0, res.reward
    assert "<tool_response>" in qtok.decode(res.rollout.input_ids, skip_special_tokens=False)


@pytest.mark.parametrize("sets,msg", [
    (["model.chat_template=qwen3"], "config key model.chat_template: 'qwen3' is not one of auto, chatml"),
    (["model.chat_template=chatml", "rollout.thinking=true"],
     "config key rollout.thinking: true, but model.chat_template is chatml"),
    (["rollout.thinking=maybe"], "expected true or false"),
])
def test_the_new_keys_are_validated(sets, msg):
    from tsrl_cli.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=msg):
        load_config(sets=sets)
    cfg = load_config(sets=["rollout.thinking=true"])  # positive control: valid values load
    assert (cfg.model.chat_template, cfg.rollout.thinking) == ("auto", True)


def test_train_refuses_thinking_on_a_chatml_policy_with_one_line_exit_2(tmp_path):
    """auto resolves to chatml on the builtin toy policy, so rollout.thinking true is refused before any worker."""
    from typer.testing import CliRunner

    from tsrl_cli.cli import app

    args = ["train", "experiments/smoke/tiny_cpu.yaml", "--rounds", "1", "--out", str(tmp_path / "run")]
    res = CliRunner().invoke(app, [*args, "--set", "rollout.thinking=true"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert "rollout.thinking true: this tokenizer's chat template declares no tools" in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    res = CliRunner().invoke(app, [*args, "--set", "model.chat_template=jinja"])
    assert res.exit_code == 2 and "model.chat_template" in res.stderr and len(res.stderr.strip().splitlines()) == 1
