"""The evaluation runner in the model's chat format: each record's tool-call errors and chat format;
records of another format are refused on resume rather than mixed in."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from tsrl_cli.agent.loop import RewardResult, ToolResult
from tsrl_cli.agent.template import make_renderer
from tsrl_cli.engines.scripted import ScriptedEngine
from tsrl_cli.errors import UsageError
from tsrl_cli.evals.runner import Job, RecordLog, run_jobs, summarize_eval
from tsrl_cli.tokenizer import with_chat_template

QWEN3 = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
QWEN3_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@dataclass(frozen=True)
class Task:
    task_id: str
    kind: str = "terminal"


class Env:
    """A test double: every command prints `ok`; reward 1 once `ls` ran."""

    def __init__(self, job):
        self.task_id, self.instruction, self.ran = job.task.task_id, "List the files.", []

    async def start(self):
        pass

    async def run(self, command, timeout_s):
        self.ran.append(command)
        return ToolResult("ok", 0, 0.0)

    async def reward(self):
        return RewardResult(float("ls" in self.ran), "")

    async def close(self):
        pass


def test_records_count_tool_call_errors_in_the_templates_format(tok, tmp_path):
    qtok = with_chat_template(tok, QWEN3, QWEN3_TOKENS)
    r = make_renderer(qtok)
    replies = ["<tool_call>{not json}</tool_call>", r.call_text("bash", {"command": "ls"}), r.call_text("submit", {})]
    engine = ScriptedEngine(qtok, lambda ctx, k: replies[min(k, 2)])
    jobs = [Job("d", tmp_path, Task("t1"), 0, 0)]
    log = RecordLog(tmp_path / "records.jsonl")
    [rec] = run_jobs(engine, qtok, jobs, make_env=Env, log=log)
    assert rec["resolved"] and rec["exit_reason"] == "submitted" and rec["turns"] == 3
    assert rec["tool_call_errors"] == 1 and rec["tool_call_error_kinds"] == {"invalid_json": 1}
    assert rec["chat_format"] == r.label and r.label.startswith("template sha256:")
    assert summarize_eval([rec], label="x", datasets=["d"])["all"]["tool_call_errors"] == 1
    # the same folder in another format (chatml) is refused, before anything runs
    with pytest.raises(UsageError, match="holds records made in chat format template sha256:.*now chatml"):
        run_jobs(engine, qtok, jobs + [Job("d", tmp_path, Task("t2"), 0, 0)], make_env=Env, log=log,
                 chat_template="chatml")
    # positive control: the same format resumes (nothing left to run)
    assert run_jobs(engine, qtok, jobs, make_env=Env, log=log) == [rec]
