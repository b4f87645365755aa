"""Rendering through the model's own chat template (tokenizer.apply_chat_template), token in / token out.

    prompt       the template's rendering of [system + tools, user] with the generation prompt    mask 0
    model turn   the sampled ids as sampled, ending at the template's end-of-turn token           mask 1
    (length cut) the end-of-turn token, appended                                                mask 0
    observation  what the template writes after an assistant turn for one tool message (a tool
                 result) or user message (a tool-call error), then the next generation prompt      mask 0

The tools (bash, submit) go in as JSON schemas (agent/toolcalls.py), `rollout.thinking` as the
template's `enable_thinking`, and the model's calls are parsed in the Hermes format.

An observation is the difference of two renderings: the template renders a conversation ending in an
assistant turn followed by the message, with the generation prompt, and everything through that
assistant turn's end-of-turn token is cut off. verl's agent loop (ToolAgentLoop) takes the same kind of
delta, rendering the new messages alone and cutting off the template's own system prefix; cutting
through the end of an assistant turn also keeps the separator a template writes after it (Qwen3: the
"\\n" after <|im_end|>). The trajectory is only ever appended to, so a template that rewrites earlier
turns never changes tokens already sampled: Qwen3's drops the empty think block of every assistant turn
but the last, so a full re-rendering would differ from the tokens each turn was sampled after.

Checked when the renderer is made (UsageError, exit 2): the template ends an assistant turn with one
special token (the turn's stop token), writes a tool call that parses back to the same call, and renders
a tool result the same whatever came before it (so the delta does not depend on the conversation).
"""

from __future__ import annotations

import hashlib
import json

from tsrl_cli.agent.actions import Action
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.agent.toolcalls import TOOL_SYSTEM_PROMPT, TOOLS, error_message, parse_tool_call
from tsrl_cli.config import CHAT_TEMPLATES
from tsrl_cli.errors import UsageError

_MARK = "TSRL-ASSISTANT-TURN"  # an assistant turn's content, found again in the rendered text
_WHERE = "model.chat_template auto"


def _tool_call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def template_text(tokenizer) -> str | None:
    """The tokenizer's chat template as one string (a dict of named templates as sorted JSON), or None."""
    t = getattr(tokenizer, "chat_template", None)
    if not t:
        return None
    return t if isinstance(t, str) else json.dumps(t, sort_keys=True)


class TemplateRenderer:
    """Renders agent turns through the tokenizer's own chat template; the same methods as ChatMLRenderer."""

    name = "template"
    system_prompt = TOOL_SYSTEM_PROMPT

    def __init__(self, tokenizer, thinking: bool = False):
        self.tok, self.thinking = tokenizer, thinking
        self._base = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": "The task."}]
        self.end_of_turn, self.end_text = self._find_end_of_turn()
        if thinking and self._render(self._base, True) == self._render(self._base, True, thinking=False):
            raise UsageError("rollout.thinking true: the chat template has no thinking switch (enable_thinking changes "
                             "nothing it renders); use rollout.thinking false")
        probe = Action("bash", "echo 'a \"b\"' && ls")
        if parse_tool_call(self.call_text("bash", {"command": probe.command})) != probe:
            raise UsageError(f"{_WHERE}: the chat template writes tool calls in a format tsrl does not parse (it reads "
                             "Hermes <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> JSON); use "
                             "model.chat_template chatml")
        result = {"role": "tool", "content": "[exit code 0]\nprobe"}
        longer = self._base + [{"role": "assistant", "content": "",
                                "tool_calls": [_tool_call("bash", {"command": "ls"})]},
                               {"role": "tool", "content": "[exit code 0]\na.py"}]
        if self._after_turn(result) != self._after_turn(result, longer):
            raise UsageError(f"{_WHERE}: the chat template renders a tool result differently after different "
                             "conversations, so it cannot be appended token by token; use model.chat_template chatml")

    # ---- text and tokens ------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool, thinking: bool | None = None) -> str:
        return self.tok.apply_chat_template(messages, tools=list(TOOLS), add_generation_prompt=generation_prompt,
                                            enable_thinking=self.thinking if thinking is None else thinking,
                                            tokenize=False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _find_end_of_turn(self) -> tuple[int, str]:
        text = self._render(self._base + [{"role": "assistant", "content": _MARK}], False)
        after = self.encode(text[text.rfind(_MARK) + len(_MARK):])
        special = set(self.tok.all_special_ids) | set(self.tok.added_tokens_encoder.values())
        if not after or after[0] not in special:
            raise UsageError(f"{_WHERE}: the chat template does not end an assistant turn with a special token (it "
                             f"writes {self.tok.decode(after[:4])!r}), so a turn has no stop token; use "
                             "model.chat_template chatml")
        return after[0], self.tok.convert_ids_to_tokens(after[0])

    def _after_turn(self, message: dict, history: list[dict] | None = None) -> str:
        """What the template writes after an assistant turn's end-of-turn token for `message`, through the
        next generation prompt: render(history + [assistant, message]) minus the text through that token."""
        text = self._render((history or self._base) + [{"role": "assistant", "content": _MARK}, message], True)
        start = text.rfind(_MARK)
        end = text.find(self.end_text, start)
        if start < 0 or end < 0:
            raise UsageError(f"{_WHERE}: the chat template drops an earlier assistant turn's text, so a tool result "
                             "cannot be appended after it; use model.chat_template chatml")
        return text[end + len(self.end_text):]

    # ---- what the agent loop appends ----------------------------------------------------------
    def prompt(self, system: str, user: str) -> list[int]:
        return self.encode(self._render([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                        True))

    def observation(self, text: str) -> list[int]:
        """A tool result, as the template renders a tool message after the assistant's call."""
        return self.encode(self._after_turn({"role": "tool", "content": text}))

    def feedback(self, text: str) -> list[int]:
        """A tool-call error's message: a user turn (no call was made, so there is no tool result)."""
        return self.encode(self._after_turn({"role": "user", "content": text}))

    def parse(self, ids: list[int]) -> Action:
        ids = ids[:-1] if ids and ids[-1] == self.end_of_turn else ids
        return parse_tool_call(self.tok.decode(ids, skip_special_tokens=False))

    def error_text(self, action: Action) -> str:
        return error_message(action.error)

    def call_text(self, name: str, arguments: dict, thought: str = "") -> str:
        """A model turn's text that calls tool `name`, as the template writes an assistant turn holding that
        call, without the generation prompt before it and the end-of-turn token after it."""
        head = self._render(self._base, True)
        full = self._render(self._base + [{"role": "assistant", "content": thought,
                                           "tool_calls": [_tool_call(name, arguments)]}], False)
        if not full.startswith(head):
            raise UsageError(f"{_WHERE}: the chat template's assistant turn does not start with its generation "
                             "prompt, so a written turn cannot stand for a sampled one; use model.chat_template chatml")
        return full[len(head):full.rindex(self.end_text)]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.end_of_turn,)

    @property
    def label(self) -> str:
        """Which format, for records that must not be mixed: the template's hash and the thinking switch."""
        digest = hashlib.sha256(template_text(self.tok).encode()).hexdigest()[:16]
        return f"template sha256:{digest} thinking={'on' if self.thinking else 'off'}"


def declares_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes declared tools into the prompt. False without a template,
    or for one that ignores them (the builtin policies' ChatML template)."""
    if template_text(tokenizer) is None:
        return False
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    try:
        with_tools, without = (tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                                             tokenize=False) for tools in (list(TOOLS), None))
    except Exception as e:  # noqa: BLE001 - a template that cannot render a system and a user turn
        raise UsageError(f"{_WHERE}: the tokenizer's chat template does not render a system and a user message "
                         f"({type(e).__name__}: {e}); use model.chat_template chatml") from None
    return with_tools != without


# how a command's own flags name the two settings (tsrl eval, tsrl policy probe), for its error lines
FLAG_NAMES = {"model.chat_template": "--chat-template", "rollout.thinking true": "--thinking",
              "rollout.thinking false": "--no-thinking"}


def make_renderer(tokenizer, chat_template: str = "auto", thinking: bool = False, *, flags: bool = False):
    """The agent's renderer for `tokenizer` (model.chat_template, rollout.thinking; with `flags`, errors
    name them as --chat-template and --thinking, the flags of tsrl eval and tsrl policy probe).

    auto: the tokenizer's own chat template when it declares tools (Qwen3 and current open models), else
    ChatML. The builtin policies' tokenizer (tsrl_cli/tokenizer.py) has a ChatML template without tools, so
    auto gives them chatml: the fenced-bash text format they were trained on. chatml: that format always.
    """
    try:
        return _make_renderer(tokenizer, chat_template, thinking)
    except UsageError as e:
        if not flags:
            raise
        msg = str(e)
        for key, flag in FLAG_NAMES.items():
            msg = msg.replace(key, flag)
        raise UsageError(msg) from None


def _make_renderer(tokenizer, chat_template: str, thinking: bool):
    if chat_template not in CHAT_TEMPLATES:
        raise UsageError(f"model.chat_template {chat_template!r}: use one of {', '.join(CHAT_TEMPLATES)}")
    if chat_template == "auto" and declares_tools(tokenizer):
        return TemplateRenderer(tokenizer, thinking)
    if thinking:
        why = ("model.chat_template is chatml" if chat_template == "chatml" else
               "this tokenizer's chat template declares no tools, so auto renders ChatML")
        raise UsageError(f"rollout.thinking true: {why}, which has no thinking switch; use rollout.thinking false")
    return ChatMLRenderer(tokenizer)
