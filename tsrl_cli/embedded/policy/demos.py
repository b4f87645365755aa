"""Demonstrations for the tiny default policy, made by running real commands in real environments.

A demonstration is what the agent loop would record for a scripted agent: the assistant texts (a
short THOUGHT and one ```bash block each, the action format of agent/actions.py) and, after each
command, the observation the loop would show (`[exit code N]\\n<output>`, clipped as the loop clips
it), produced by running the command in a fresh sandbox of the task (tsrl_cli.envs). The final
reward is the task's own verifier, run when the demonstration ends, so every recorded reward is real.

Variants (per task, drawn from a seeded RNG; fractions in DemoConfig):
  correct    repair: look at the code, fix it with one `sed -i 'Ns/old/new/' file`, maybe run the tests,
             submit. terminal: maybe look at a file, the reference solution's commands, maybe check, submit.
  corrected  a wrong edit first, then a look at the result, then the right fix, submit (usually reward 1)
  wrong      a wrong edit, then submit (reward 0 when the verifier says so: the reward is measured)
  no_fix     repair only: look at the code, then submit without editing (reward 0)

A demo is a dict {task_id, kind, variant, instruction, messages, reward, reason}, `messages` being
[{"role": "assistant" | "observation", "content": str}, ...] in order. `demo_to_trajectory` turns
it into the TokenTrajectory that run_agent would build (token in / token out through ChatMLRenderer).
"""

from __future__ import annotations

import ast
import asyncio
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tsrl_cli.agent.actions import FORMAT_ERROR, parse_action, submitted_by_output
from tsrl_cli.agent.loop import SYSTEM_PROMPT, AgentLimits, observation_text
from tsrl_cli.agent.renderer import ChatMLRenderer, TokenTrajectory
from tsrl_cli.datasets.patches import parse_one_line_patch
from tsrl_cli.embedded.repair_suite import SRC_DIR
from tsrl_cli.embedded.terminal_suite import solution_commands
from tsrl_cli.envs.repair import INSTRUCTION
from tsrl_cli.envs.tasks import make_env
from tsrl_cli.tokenizer import train_chatml_tokenizer

SUBMIT = "```bash\nsubmit\n```"
# pytest prints its duration ("in 0.81s"): cut it so that an observation is a function of the state alone
TESTS_CMD = "python -m pytest -q 2>&1 | tail -n 4 | sed 's/ in [0-9.]*s//'"


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 0
    extra_fraction: float = 0.5  # share of tasks that get a second, non-correct demo besides the correct one
    corrected_share: float = 0.4  # of those extra demos: wrong edit then the right one (the rest fail)
    no_fix_share: float = 0.25  # of the failing extra repair demos: submit without any edit
    run_tests_fraction: float = 0.3  # correct repair demos that run the tests before submitting
    look_fraction: float = 0.5  # terminal demos that look at an input file first
    check_fraction: float = 0.3  # terminal demos that look at the result before submitting
    concurrency: int = 4  # demos run at once (each its own sandbox)
    limits: AgentLimits = field(default_factory=AgentLimits)
    tool_timeout_s: float = 20.0


def say(thought: str, command: str) -> str:
    """One assistant turn in the action format."""
    return f"THOUGHT: {thought}\n```bash\n{command}\n```"


# -- sed commands from a one-line patch --------------------------------------------------------------------

def _bre_escape(s: str) -> str:
    return re.sub(r"([\\/.*\[\]^$])", r"\\\1", s)


def _repl_escape(s: str) -> str:
    return re.sub(r"([\\/&])", r"\\\1", s)


def _sq(s: str) -> str:
    """Body of a single-quoted shell word."""
    return s.replace("'", "'\\''")


def _cls(c: str) -> str | None:
    """Character class for widening an edit to whole tokens: words and operators."""
    if c.isalnum() or c == "_":
        return "w"
    return "o" if c in "<>=!+-*/%&|^~" else None


def line_edit(old: str, new: str) -> tuple[str, str]:
    """(a, b) with old == p + a + s, new == p + b + s, a widened to whole words, and `a` first found at
    its own position in `old` (so `s/a/b/` on that line makes exactly this edit)."""
    i = 0
    while i < min(len(old), len(new)) and old[i] == new[i]:
        i += 1
    j = 0
    while j < min(len(old), len(new)) - i and old[len(old) - 1 - j] == new[len(new) - 1 - j]:
        j += 1
    a0, a1, b1 = i, len(old) - j, len(new) - j
    # widen to whole tokens (a word or an operator), never leaving `a` empty
    while a0 > 0 and (a0 == a1 or (_cls(old[a0 - 1]) is not None and _cls(old[a0 - 1]) == _cls(old[a0]))):
        a0 -= 1
    while a1 < len(old) and (_cls(old[a1]) is not None and _cls(old[a1]) == _cls(old[a1 - 1])):
        a1 += 1
        b1 += 1
    while old.find(old[a0:a1]) != a0 or not old[a0:a1].strip():  # first occurrence must be this one
        if a0 > 0 and (a1 >= len(old) or old.find(old[a0:a1]) < a0):
            a0 -= 1
        else:
            a1 += 1
            b1 += 1
        if a0 == 0 and a1 >= len(old):
            break
    b0 = a0
    return old[a0:a1], new[b0:b1]


def sed_replace(line_no: int, a: str, b: str, file: str) -> str:
    return f"sed -i '{line_no}s/{_sq(_bre_escape(a))}/{_sq(_repl_escape(b))}/' {file}"


# -- wrong edits ---------------------------------------------------------------------------------------------

_FAMILIES = [["<", "<=", ">", ">=", "==", "!="], ["+", "-", "*", "//", "%"], ["and", "or"], ["True", "False"]]


def wrong_values(a: str, b: str) -> list[str]:
    """Plausible but wrong replacements for `a` (the right one being `b`)."""
    out = []
    m = re.fullmatch(r"-?\d+", b.strip())
    if m:
        v = int(b)
        out += [str(v + 1), str(v - 1), str(v * 2)]
    for fam in _FAMILIES:
        if b.strip() in fam:
            out += [x for x in fam if x != b.strip()]
    for fam in _FAMILIES:  # an operator inside a wider edit: change it to a third member
        for x in fam:
            if (len(x) > 1 or not x.isalpha()) and f" {x} " in f" {b} " and f" {x} " not in f" {a} ":
                out += [b.replace(x, y, 1) for y in fam if y != x and len(y) <= 2]
    return [x for x in dict.fromkeys(out) if x not in (a, b)]


_TERMINAL_MUTATIONS: list[tuple[str, Callable[[str], str]]] = [
    (r"wc -w", lambda c: c.replace("wc -w", "wc -l")),
    (r"grep -c ", lambda c: c.replace("grep -c ", "grep ")),
    (r"sort -u", lambda c: c.replace("sort -u", "sort")),
    (r"^sort ", lambda c: c.replace("sort ", "sort -r ", 1)),
    (r"/g' ", lambda c: c.replace("/g' ", "/' ")),
    (r"tr a-z A-Z", lambda c: c.replace("tr a-z A-Z", "tr A-Z a-z")),
    (r"^(head|tail) -n \d+", lambda c: re.sub(r"-n (\d+)", lambda m: f"-n {int(m.group(1)) + 1}", c, count=1)),
    (r"cut -d, -f\d", lambda c: re.sub(r"-f(\d)", lambda m: f"-f{int(m.group(1)) % 3 + 1}", c, count=1)),
    (r"chmod \+x", lambda c: c.replace("chmod +x", "chmod +r")),
    (r"^mkdir -p \S+ \S+$", lambda c: c.rsplit(" ", 1)[0]),
    (r"^cat \S+ \S+ \S+ >", lambda c: "cat " + " ".join(reversed(c.split(">")[0].split()[1:])) + " >"
     + c.split(">", 1)[1]),
    (r"^echo '\S+ \S+'", lambda c: re.sub(r"echo '(\S+) (\S+)'", r"echo '\2 \1'", c)),
    (r"print s\}", lambda c: c.replace("print s}", "print NR}")),
    (r'mv "\$f"', lambda c: re.sub(r'"\$\{f%\.\w+\}\.(\w+)"', r'"$f.\1"', c)),
    (r"^rm \S+/\*\.\w+$", lambda c: re.sub(r"/\*\.\w+$", "/*", c)),
    (r"^ls \S+/\*\.\w+ \|", lambda c: re.sub(r"^ls (\S+)/\*\.\w+", r"ls \1", c)),
]


def wrong_terminal_command(cmd: str) -> str | None:
    for pat, f in _TERMINAL_MUTATIONS:
        if re.search(pat, cmd):
            new = f(cmd)
            if new != cmd:
                return new
    return None


# -- running a demonstration ----------------------------------------------------------------------------------

class _Session:
    """Runs assistant turns in a real environment and records them as the agent loop would."""

    def __init__(self, env, cfg: DemoConfig):
        self.env, self.cfg, self.messages, self.done = env, cfg, [], False

    async def turn(self, text: str) -> str | None:
        """Record one assistant turn; run its command; record and return the observation (None at the end)."""
        assert not self.done, "the demonstration already ended"
        self.messages.append({"role": "assistant", "content": text})
        action = parse_action(text)
        if action.kind == "submit":
            self.done = True
            return None
        if action.kind == "format_error":
            obs = FORMAT_ERROR
        else:
            res = await self.env.run(action.command, min(self.cfg.tool_timeout_s, self.cfg.limits.tool_timeout_s))
            if res.exit_code == 0 and submitted_by_output(res.output):
                self.done = True
                return None
            obs = observation_text(res.output, res.exit_code, res.limit, self.cfg.limits.max_observation_chars)
        self.messages.append({"role": "observation", "content": obs})
        return obs


def _function_span(source: str, qualname: str) -> tuple[int, int] | None:
    tree = ast.parse(source)

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if prefix + child.name == qualname:
                    return child.lineno, child.end_lineno
                r = visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                r = visit(child, prefix + child.name + ".")
            else:
                r = visit(child, prefix)
            if r:
                return r
        return None

    return visit(tree, "")


def repair_plan(task, dataset_dir: Path) -> dict:
    """What a demonstrator knows about a repair task: where the bug is, how to look, how to fix."""
    file, line, bug_line, gold_line = parse_one_line_patch(task.gold_patch)
    source = (Path(dataset_dir) / task.start_dir / file).read_text()
    if source.splitlines()[line - 1] != bug_line:
        raise ValueError(f"{task.task_id}: line {line} of {file} is not the patch's")
    func = task.meta.get("function", "<module>")
    span = _function_span(source, func) if func != "<module>" else None
    if span and span[0] <= line <= span[1]:
        name = func.split(".")[-1]
        after = max(line - span[0] + 1, min(span[1] - span[0], 14))
        look = (f"The failing tests point to `{func}` in {file}. Let me read it with line numbers.",
                f"grep -n -A {after} 'def {name}(' {file}")
    else:
        lo, hi = max(1, line - 8), line + 4
        look = (f"The failing tests point to module-level code in {file}. Let me read it with line numbers.",
                f"cat -n {file} | sed -n '{lo},{hi}p'")
    a, b = line_edit(bug_line, gold_line)
    return {"file": file, "line": line, "bug_line": bug_line, "gold_line": gold_line, "look": look, "a": a, "b": b}


def _fix_turn(p: dict, a: str, b: str) -> str:
    return say(f"Line {p['line']} of {p['file']} has `{a.strip()}` where it should be `{b.strip()}`. Fix it.",
               sed_replace(p["line"], a, b, p["file"]))


async def _repair_demo(env, task, dataset_dir, variant: str, rng: random.Random, cfg: DemoConfig) -> list[dict]:
    p = repair_plan(task, dataset_dir)
    s = _Session(env, cfg)
    await s.turn(say(*p["look"]))
    if variant == "no_fix":
        if rng.random() < 0.5:
            await s.turn(say("Let me run the tests.", TESTS_CMD))
        await s.turn(SUBMIT)
        return s.messages
    if variant in ("wrong", "corrected"):
        wrong = wrong_values(p["a"], p["b"])
        if wrong:
            w = rng.choice(wrong)
            await s.turn(_fix_turn(p, p["a"], w))
            wrong_line = p["bug_line"].replace(p["a"], w, 1)
        else:  # the right edit on a neighbouring line: a no-op or a new bug, never the fix
            other = p["line"] + rng.choice([-1, 1])
            await s.turn(say(f"Line {other} of {p['file']} has `{p['a'].strip()}` where it should be "
                             f"`{p['b'].strip()}`. Fix it.", sed_replace(other, p["a"], p["b"], p["file"])))
            wrong_line = None
        if variant == "wrong":
            if rng.random() < 0.5:
                await s.turn(say("Let me run the tests.", TESTS_CMD))
            await s.turn(SUBMIT)
            return s.messages
        await s.turn(say("Let me run the tests.", TESTS_CMD))
        await s.turn(say(f"The tests still fail. Let me look at line {p['line']} again.",
                         f"sed -n '{p['line']}p' {p['file']}"))
        if wrong_line is not None:
            a, b = line_edit(wrong_line, p["gold_line"])
        else:
            a, b = p["a"], p["b"]
        await s.turn(_fix_turn(p, a, b))
    else:
        await s.turn(_fix_turn(p, p["a"], p["b"]))
    if variant == "corrected" or rng.random() < cfg.run_tests_fraction:
        await s.turn(say("Let me run the tests.", TESTS_CMD))
    await s.turn(SUBMIT)
    return s.messages


_BACKTICKED = re.compile(r"`([^`\s]+)`")


def _inputs_outputs(task, dataset_dir: Path) -> tuple[list[str], list[str]]:
    """Names in the instruction that exist in the start state (inputs) and those that do not (outputs)."""
    env_dir = Path(dataset_dir) / task.task_dir / task.environment_dir
    names = _BACKTICKED.findall(task.instruction)
    ins = [n for n in names if (env_dir / n).exists()]
    outs = [n for n in names if not (env_dir / n).exists() and re.fullmatch(r"[\w./-]+\.\w+", n)]
    return ins, outs


async def _terminal_demo(env, task, dataset_dir, variant: str, rng: random.Random, cfg: DemoConfig) -> list[dict]:
    cmds = solution_commands(Path(dataset_dir) / task.task_dir)
    ins, outs = _inputs_outputs(task, dataset_dir)
    s = _Session(env, cfg)
    if ins and (variant != "correct" or rng.random() < cfg.look_fraction):
        target = ins[0]
        is_dir = (Path(dataset_dir) / task.task_dir / task.environment_dir / target).is_dir()
        await s.turn(say(f"Let me look at `{target}` first.", f"ls {target}" if is_dir else f"cat {target}"))
    if variant in ("wrong", "corrected"):
        k = next((i for i, c in enumerate(cmds) if wrong_terminal_command(c)), None)
        if k is None:
            raise ValueError(f"{task.task_id}: no wrong variant of its solution")
        for c in cmds[:k]:
            await s.turn(say("Next step.", c))
        await s.turn(say("This should do it.", wrong_terminal_command(cmds[k])))
        if variant == "wrong":
            await s.turn(SUBMIT)
            return s.messages
        check = f"cat {outs[0]}" if outs else (f"stat -c '%A %n' {ins[0]}" if ins else "ls -R")
        await s.turn(say("Let me check the result.", check))
        await s.turn(say("That is not what was asked. Let me redo it correctly.", cmds[k]))
        for c in cmds[k + 1:]:
            await s.turn(say("Next step.", c))
    else:
        for i, c in enumerate(cmds):
            await s.turn(say("This does what the task asks." if i == 0 else "Next step.", c))
        if outs and rng.random() < cfg.check_fraction:
            await s.turn(say("Let me check the result.", f"cat {outs[0]}"))
    await s.turn(SUBMIT)
    return s.messages


def choose_variants(task, rng: random.Random, cfg: DemoConfig) -> list[str]:
    variants = ["correct"]
    if rng.random() < cfg.extra_fraction:
        if rng.random() < cfg.corrected_share:
            variants.append("corrected")
        elif task.kind == "repair" and rng.random() < cfg.no_fix_share:
            variants.append("no_fix")
        else:
            variants.append("wrong")
    return variants


async def run_demo(task, dataset_dir: Path, variant: str, cfg: DemoConfig = DemoConfig(), *,
                   executor: str = "local") -> dict:
    """One demonstration in a fresh environment of the task, with its real final reward."""
    t0 = time.perf_counter()
    for attempt in range(2):
        rng = random.Random(f"tsrl-demo:{cfg.seed}:{task.task_id}:{variant}")
        env = make_env(task, Path(dataset_dir), executor=executor)
        await env.start()
        try:
            fn = _repair_demo if task.kind == "repair" else _terminal_demo
            messages = await fn(env, task, dataset_dir, variant, rng, cfg)
            reward = await env.reward()
        finally:
            await env.close()
        if attempt or not any(_hit_wall_clock(m) for m in messages):
            break
        # A command was killed by the tool timeout: a wrong edit that hangs the tests does that on every
        # run, but a busy machine (a loaded build ran pytest past 10 s) does it by chance, and the
        # demonstration's text, hence the trained weights, would then depend on the load. So the whole
        # demonstration runs again with 4x the timeout, and what that run records is kept.
        t = DEMO_RETRY_TIMEOUT_SCALE * min(cfg.tool_timeout_s, cfg.limits.tool_timeout_s)
        cfg = replace(cfg, tool_timeout_s=t, limits=replace(cfg.limits, tool_timeout_s=t))
    return {"task_id": task.task_id, "kind": task.kind, "variant": variant, "instruction": env.instruction,
            "messages": messages, "reward": float(reward.reward), "reason": reward.reason,
            "seconds": round(time.perf_counter() - t0, 3)}


DEMO_RETRY_TIMEOUT_SCALE = 4.0


def _hit_wall_clock(message: dict) -> bool:
    """An observation whose command the tool timeout killed (the header observation_text writes)."""
    return message["role"] == "observation" and "[limit: wall_clock]" in message["content"].split("\n", 1)[0]


async def make_demos_async(tasks: Iterable[tuple[Path, object]], cfg: DemoConfig = DemoConfig(),
                           progress: Callable[[int, int], None] = lambda done, total: None,
                           executor: str = "local") -> list[dict]:
    """Demos for (dataset_dir, task) pairs, in input order (then variant order): deterministic for cfg.seed."""
    jobs = []
    for d, t in tasks:
        rng = random.Random(f"tsrl-demo-variants:{cfg.seed}:{t.task_id}")
        jobs += [(d, t, v) for v in choose_variants(t, rng, cfg)]
    sem = asyncio.Semaphore(max(1, cfg.concurrency))
    done = 0

    async def one(d, t, v):
        nonlocal done
        async with sem:
            try:
                out = await run_demo(t, d, v, cfg, executor=executor)
            except ValueError:  # no such variant for this task (e.g. no wrong edit of its solution)
                out = None
        done += 1
        progress(done, len(jobs))
        return out

    outs = await asyncio.gather(*(one(*j) for j in jobs))
    return [o for o in outs if o is not None]


def make_demos(tasks, cfg: DemoConfig = DemoConfig(), progress=lambda done, total: None,
               executor: str = "local") -> list[dict]:
    return asyncio.run(make_demos_async(tasks, cfg, progress, executor))


# -- tokens -------------------------------------------------------------------------------------------------

def demo_to_trajectory(demo: dict, renderer: ChatMLRenderer, system_prompt: str = SYSTEM_PROMPT) -> TokenTrajectory:
    """The TokenTrajectory run_agent builds for these turns: prompt (mask 0), each assistant text with its
    <|im_end|> (mask 1, one turn span each), each observation (mask 0)."""
    traj = TokenTrajectory()
    traj.append(renderer.prompt(system_prompt, demo["instruction"]), 0)
    for m in demo["messages"]:
        if m["role"] == "assistant":
            traj.turn_spans.append(traj.append(renderer.encode(m["content"]) + [renderer.im_end], 1))
        else:
            traj.append(renderer.observation(m["content"]), 0)
    return traj


def demo_texts(demo: dict) -> Iterable[str]:
    yield demo["instruction"]
    for m in demo["messages"]:
        yield m["content"]


def tokenizer_corpus(demos: Iterable[dict], src_root: str | Path | None = None,
                     system_prompt: str = SYSTEM_PROMPT) -> Iterable[str]:
    """The text the project's tokenizer is trained on: the system prompt and the fixed texts of the loop,
    every demo's instruction, assistant turns and observations, and the embedded repositories' sources."""
    yield system_prompt
    yield FORMAT_ERROR
    yield INSTRUCTION
    for d in demos:
        yield from demo_texts(d)
    if src_root is None:
        src_root = SRC_DIR.parent
    for p in sorted(Path(src_root).rglob("*.py")):
        yield p.read_text()


def train_policy_tokenizer(demos: list[dict], vocab_size: int = 2048, out_dir=None, src_root=None,
                           word_stable: bool = False):
    return train_chatml_tokenizer(tokenizer_corpus(demos, src_root), vocab_size=vocab_size, out_dir=out_dir,
                                  word_stable=word_stable)


def demo_stats(demos: list[dict], tokenizer=None, limits: AgentLimits | None = None) -> dict:
    limits = limits or AgentLimits()
    by = {}
    for d in demos:
        k = (d["kind"], d["variant"])
        n, r = by.get(k, (0, 0.0))
        by[k] = (n + 1, r + d["reward"])
    out = {"demos": len(demos), "by_variant": {f"{k[0]}/{k[1]}": {"n": n, "mean_reward": round(r / n, 3)}
                                               for k, (n, r) in sorted(by.items())},
           "mean_reward": round(sum(d["reward"] for d in demos) / max(1, len(demos)), 3),
           "mean_turns": round(sum(sum(m["role"] == "assistant" for m in d["messages"]) for d in demos)
                               / max(1, len(demos)), 2)}
    if tokenizer is not None:
        r = ChatMLRenderer(tokenizer)
        trajs = [demo_to_trajectory(d, r) for d in demos]
        lens = sorted(len(t.input_ids) for t in trajs)
        turn_lens = [e - s for t in trajs for s, e in t.turn_spans]
        out.update(tokens_mean=round(sum(lens) / len(lens), 1), tokens_max=lens[-1],
                   tokens_p50=lens[len(lens) // 2], loss_tokens_mean=round(sum(sum(t.loss_mask) for t in trajs)
                                                                           / len(trajs), 1),
                   turn_tokens_max=max(turn_lens),
                   turns_over_limit=sum(x > limits.max_turn_tokens for x in turn_lens),
                   demos_over_limit=sum(x > limits.max_trajectory_tokens for x in lens))
    return out
