"""The tool-call format of models trained on their chat template's tools (Qwen3 and the Hermes family).

The system turn declares two tools as JSON schemas (OpenAI's function format, which
`tokenizer.apply_chat_template(tools=...)` writes into the template's system turn):

    bash(command: string)   run one shell command in the task's sandbox; exit code and output come back
    submit()                the task is done: its final state is scored

A model turn calls exactly one of them, in the Hermes format that Qwen3's template describes:

    <tool_call>
    {"name": "bash", "arguments": {"command": "ls -la"}}
    </tool_call>

Anything else is a tool-call error with one of the kinds in ERROR_KINDS; the loop counts it and
answers with that kind's message. A thinking model's reasoning (`<think>...</think>`, ahead of the
answer) is not parsed.
"""

from __future__ import annotations

import json
import re

from tsrl_cli.agent.actions import Action

TOOL_SYSTEM_PROMPT = (
    "You are an agent working in a shell. Each reply: a short thought, then exactly one tool call: bash with "
    "one command (its output comes back to you), or submit when the task is done."
)

TOOLS = (
    {"type": "function", "function": {
        "name": "bash",
        "description": "Run one shell command in the task's sandbox; its exit code and output come back.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "the command, as one line of bash"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "submit",
        "description": "Submit: the task is done; its final state is scored.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
)
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

# kind -> what the model is told (and what the metrics count)
ERROR_KINDS = {
    "no_call": "no <tool_call> block",
    "multiple_calls": "more than one <tool_call> block; call one tool per turn",
    "unclosed_call": "a <tool_call> block without its closing </tool_call>",
    "invalid_json": "the text inside <tool_call> is not a JSON object",
    "unknown_tool": f"the call names no known tool (the tools: {', '.join(TOOL_NAMES)})",
    "missing_arguments": "a required argument is missing (bash needs a command)",
    "bad_arguments": "the arguments are not an object of the declared types (bash's command is a non-empty string)",
}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _error(kind: str) -> Action:
    return Action("format_error", error=kind)


def parse_tool_call(text: str) -> Action:
    """One model turn's text (its end-of-turn token removed) -> bash, submit, or format_error with its kind."""
    answer = text.rsplit("</think>", 1)[-1]  # with thinking on, the reasoning comes first
    calls = _CALL.findall(answer)
    if not calls:
        return _error("unclosed_call" if "<tool_call>" in answer else "no_call")
    if len(calls) > 1:
        return _error("multiple_calls")
    try:
        call = json.loads(calls[0])
    except json.JSONDecodeError:
        return _error("invalid_json")
    if not isinstance(call, dict):
        return _error("invalid_json")
    name = call.get("name")
    if name not in TOOL_NAMES:
        return _error("unknown_tool")
    args = call.get("arguments", {})
    if isinstance(args, str):  # OpenAI's wire format carries the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return _error("bad_arguments")
    if not isinstance(args, dict):
        return _error("bad_arguments")
    if name == "submit":
        return Action("submit")
    if "command" not in args:
        return _error("missing_arguments")
    command = args["command"]
    if not isinstance(command, str) or not command.strip():
        return _error("bad_arguments")
    return Action("bash", command.strip())


def error_message(kind: str) -> str:
    """The observation for a turn whose call could not be run."""
    return (f"Tool call error ({kind}): {ERROR_KINDS[kind]}. Reply with exactly one "
            '<tool_call>{"name": "bash", "arguments": {"command": "..."}}</tool_call>, '
            'or <tool_call>{"name": "submit", "arguments": {}}</tool_call> when the task is done.')
