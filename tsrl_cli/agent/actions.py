"""The action format: one fenced bash block per model turn, as in mini-swe-agent's text mode.

    THOUGHT: what I will do
    ```bash
    sed -i 's/a - b/a + b/' calc.py
    ```

Submitting: a block whose command is exactly `submit`, or (mini-swe-agent's convention) a
command whose output's first line is COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You are an agent working in a shell. Each reply: a short THOUGHT, then exactly one ```bash block "
    "with one command. Its output comes back to you. When the task is done, reply with the command `submit`."
)
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_BLOCK = re.compile(r"```(?:bash|sh)[^\n]*\n(.*?)```", re.DOTALL)

FORMAT_ERROR = (
    "Format error: reply with exactly one ```bash block holding one command "
    "(or the command `submit` when you are done)."
)


@dataclass(frozen=True)
class Action:
    kind: str  # "bash" | "submit" | "format_error"
    command: str = ""
    error: str = ""  # format_error: its kind (no_call, multiple_calls, empty_command; agent/toolcalls.py adds more)


def parse_action(text: str) -> Action:
    blocks = _BLOCK.findall(text)
    if len(blocks) != 1:
        return Action("format_error", error="no_call" if not blocks else "multiple_calls")
    cmd = blocks[0].strip()
    if not cmd:
        return Action("format_error", error="empty_command")
    if cmd == "submit":
        return Action("submit")
    return Action("bash", cmd)


def submitted_by_output(stdout: str) -> bool:
    """mini-swe-agent: the command printed the marker as its first output line."""
    return stdout.lstrip().splitlines()[:1] == [SUBMIT_MARKER]
