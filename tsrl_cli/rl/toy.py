"""builtin:echo tasks and the builtin:toy policy: a self-contained workload for tests and benchmarks.

The task: "Print the word W with echo, then submit." The environment runs in-process (no sandbox):
`echo X` prints X, anything else is "command not found". The reward is the best similarity
(difflib ratio, in [0, 1]) between a printed line and W, so a partly trained policy gets graded,
varied rewards and GRPO groups have non-zero variance.

The toy policy is a tiny Qwen3 (tsrl_cli.policy.build_tiny_model) with a tokenizer trained on
the task's own text, warm-started by a few SFT steps on demonstrations in the agent's action format
(some with the wrong word), and cached under data/cache/toy/. The teacher is the same model
trained longer. Deterministic for a spec; built in seconds on one CPU thread.

    builtin:toy                     hidden 32, 2 layers, short SFT (the student)
    builtin:toy-teacher             same size, 3x the SFT epochs
    builtin:toy:h64:l4[:teacher]    other sizes (the benchmark's model-size knob)
"""

from __future__ import annotations

import difflib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tsrl_cli.agent.loop import SYSTEM_PROMPT, RewardResult, ToolResult
from tsrl_cli.agent.renderer import ChatMLRenderer
from tsrl_cli.embedded.policy.sft import SFTConfig, train_sft
from tsrl_cli.errors import UsageError
from tsrl_cli.policy import build_tiny_model, save_policy
from tsrl_cli.tokenizer import train_chatml_tokenizer

ECHO = "builtin:echo"
TOY_PREFIX = "builtin:toy"
WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "amber", "lemon", "piano", "comet",
         "delta", "ember", "frost", "grape", "honey", "igloo", "jelly", "koala", "lunar", "mango", "noble",
         "olive", "pearl")
INSTRUCTION = "Print the word {word} with echo, then submit."


@dataclass(frozen=True)
class EchoTask:
    task_id: str
    word: str
    kind: str = "echo"


def echo_tasks() -> list[EchoTask]:
    return [EchoTask(f"echo-{w}", w) for w in WORDS]


class EchoEnv:
    """One trajectory of an EchoTask (the AgentEnv protocol, no sandbox)."""

    def __init__(self, task: EchoTask):
        self.task, self.task_id = task, task.task_id
        self.instruction = INSTRUCTION.format(word=task.word)
        self.printed: list[str] = []

    async def start(self) -> None:
        pass

    async def run(self, command: str, timeout_s: float) -> ToolResult:
        head, _, rest = command.strip().partition(" ")
        if head != "echo":
            return ToolResult(f"bash: {head}: command not found\n", 127, 0.0)
        out = rest.strip().strip("'\"")
        self.printed.append(out)
        return ToolResult(out + "\n", 0, 0.0)

    async def reward(self) -> RewardResult:
        best = max((difflib.SequenceMatcher(None, p, self.task.word).ratio() for p in self.printed), default=0.0)
        return RewardResult(round(best, 6), f"best match {best:.3f}")

    async def close(self) -> None:
        pass


# ---- the toy policy -----------------------------------------------------------------------------------

def _demos(seed: int) -> list[list[tuple[str, int]]]:
    """(text, mask) pieces per demonstration: right answers, wrong words, and a stray command."""
    rng = random.Random(seed)
    out = []
    for w in WORDS:
        for variant in ("right", "right", "wrong", "stray"):
            said = w if variant != "wrong" else rng.choice([x for x in WORDS if x != w])
            turns = []
            if variant == "stray":
                turns.append(("THOUGHT: look first.\n```bash\nls\n```", "[exit code 127]\nbash: ls: command not found"))
            turns.append((f"THOUGHT: print it.\n```bash\necho {said}\n```", f"[exit code 0]\n{said}"))
            turns.append(("```bash\nsubmit\n```", None))
            out.append((INSTRUCTION.format(word=w), turns))
    return out


def _render(demo, renderer) -> tuple[list[int], list[int]]:
    instruction, turns = demo
    ids = renderer.prompt(SYSTEM_PROMPT, instruction)
    mask = [0] * len(ids)
    for reply, obs in turns:
        r = renderer.encode(reply) + [renderer.im_end]
        ids, mask = ids + r, mask + [1] * len(r)
        if obs is not None:
            o = renderer.observation(obs)
            ids, mask = ids + o, mask + [0] * len(o)
    return ids, mask


def parse_toy_spec(spec: str) -> tuple[int, int, bool]:
    """builtin:toy[-teacher] or builtin:toy:h<H>:l<L>[:teacher] -> (hidden, layers, teacher)."""
    if spec == TOY_PREFIX:
        return 32, 2, False
    if spec == TOY_PREFIX + "-teacher":
        return 32, 2, True
    parts = spec[len(TOY_PREFIX):].split(":")
    try:
        assert parts[0] == ""
        hidden = int(parts[1].removeprefix("h"))
        layers = int(parts[2].removeprefix("l"))
        teacher = parts[3:] == ["teacher"]
        assert parts[3:] in ([], ["teacher"]) and hidden >= 8 and hidden % 4 == 0 and layers >= 1
    except (AssertionError, IndexError, ValueError):
        raise UsageError(f"{spec}: use builtin:toy, builtin:toy-teacher or builtin:toy:h<hidden>:l<layers>[:teacher] "
                         "(hidden a multiple of 4)") from None
    return hidden, layers, teacher


def build_toy_policy(out_dir: str | Path, hidden: int = 32, layers: int = 2, teacher: bool = False, seed: int = 0):
    """Train the toy tokenizer and policy and save them (model + tokenizer) to out_dir."""
    demos = _demos(seed)
    corpus = [SYSTEM_PROMPT] + [INSTRUCTION.format(word=w) for w in WORDS]
    corpus += [t for _, turns in demos for pair in turns for t in pair if t]
    tok = train_chatml_tokenizer(corpus * 4, vocab_size=400)
    renderer = ChatMLRenderer(tok)
    seqs = [_render(d, renderer) for d in demos]
    cfg = SFTConfig(hidden=hidden, layers=layers, max_positions=2048, epochs=24 if teacher else 8, batch_size=8,
                    lr=1e-2, warmup_steps=4, max_len=1024, seed=seed)
    with torch.random.fork_rng(devices=[]):
        model = build_tiny_model(seed, vocab_size=len(tok), hidden=hidden, layers=layers,
                                 max_positions=cfg.max_positions, pad_id=tok.pad_token_id, eos_id=renderer.im_end)
        log = train_sft(model, seqs, cfg, pad_id=tok.pad_token_id)
    info = {"log": log, "spec": {"hidden": hidden, "layers": layers, "teacher": teacher}}
    return save_policy(model, tok, out_dir, extra=lambda d: (d / "sft_log.json").write_text(json.dumps(info, indent=1)))


def ensure_toy_policy(spec: str, cache_root: str | Path = "data/cache/toy") -> Path:
    """The cached policy directory for a builtin:toy spec, built on first use (atomically)."""
    hidden, layers, teacher = parse_toy_spec(spec)
    d = Path(cache_root) / f"h{hidden}-l{layers}{'-teacher' if teacher else ''}"
    if not (d / "config.json").is_file():
        build_toy_policy(d, hidden, layers, teacher)
    return d
