"""The one home of a policy: build, load and save it, and compute its token log-probs.

    load_policy(spec, dtype=, device=, lora=, base=)   -> (model, tokenizer)   every process and command
    save_policy(model, tokenizer, out_dir, ...)        a save_pretrained folder, written atomically
    build_tiny_model(seed, ...)                        a Qwen3 with seeded random weights (no hub)
    model_config(folder) / build_from_config(config)   a model's architecture from its config.json alone (tsrl plan)
    parameter_names(model)                             the names a full-weight sync carries (vllm engine)
    forward_logprobs(model, ids_B_T, ...)              (B, T) log-probs (with grad) for the losses
    score_tokens(model, ids, start, end)               log-probs of some tokens (no grad): teacher, reference

A spec is `builtin:tiny` / `builtin:tiny-teacher` (random tiny Qwen3s, no tokenizer), a directory
written by save_pretrained, or a hub id (online only). Models load in the run's dtype; a float64
model gets float64 RMSNorms (transformers' compute in float32 whatever the dtype, which alone
limits float64 agreement to ~1e-7). Models are put in eval mode: no dropout, so the lazy and the
streamed gradient see the same function.

LoRA (`lora.rank` > 0): the base is wrapped in PEFT adapters drawn from `seed` (B = 0, so the
wrapped model samples exactly as the base); only adapter parameters require grad. A LoRA
checkpoint holds the merged model (loadable with AutoModelForCausalLM, as every checkpoint) plus
`adapter/` in PEFT format, which `load_policy(checkpoint, base=BASE, lora=...)` reads back.

Alignment (core.losses.token_logprobs): position j of a (T,) row is log pi(ids[j] | ids[:j]);
position 0 predicts nothing and is 0.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import shutil
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils.checkpoint
import transformers
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tsrl_cli.config import DTYPES
from tsrl_cli.core.losses import chunked_token_logprobs, selected_token_logprobs, token_entropy, token_logprobs
from tsrl_cli.errors import UsageError
from tsrl_cli.files import atomic_dir, file_sha256

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES names -> torch dtypes
BUILTIN_TINY = "builtin:tiny"
BUILTIN_TINY_TEACHER = "builtin:tiny-teacher"
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's PEFT adapter, beside the merged model


# ---------------------------------------------------------------------------- building


def tiny_qwen3_config(vocab_size: int = 128, hidden: int = 64, layers: int = 2, max_positions: int = 512,
                      pad_id: int | None = None, eos_id: int | None = None):
    """A small Qwen3 architecture (~0.1 M parameters at the defaults; the embedded policy is h256, 2 layers)."""
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    # the pad id matters for the weights: the embedding row of padding_idx is initialized to zero
    cfg.pad_token_id, cfg.eos_token_id = pad_id, eos_id
    return cfg


def build_tiny_model(seed: int = 0, dtype: str | torch.dtype = torch.float32, **cfg):
    """Qwen3ForCausalLM with random weights drawn from `seed` (the same seed gives the same model).

    `cfg`: tiny_qwen3_config's arguments (vocab_size, hidden, layers, max_positions, pad_id, eos_id).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_qwen3_config(**cfg))
    return _prepare(model, _dtype(dtype))


def keep_float64_norms(model) -> int:
    """Make RMSNorm layers compute in float64 when the model is float64; returns how many were changed."""
    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "weight"):
            eps_attr = "variance_epsilon" if hasattr(mod, "variance_epsilon") else "eps"
            if not hasattr(mod, eps_attr):
                continue

            def forward(self, hidden_states, _eps_attr=eps_attr):
                var = hidden_states.pow(2).mean(-1, keepdim=True)
                return self.weight * (hidden_states * torch.rsqrt(var + getattr(self, _eps_attr)))

            mod.forward = types.MethodType(forward, mod)
            n += 1
    return n


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in TORCH_DTYPES:
        raise UsageError(f"dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    return TORCH_DTYPES[dtype]


def _prepare(model, dtype: torch.dtype):
    model = model.to(dtype)
    if dtype == torch.float64:
        keep_float64_norms(model)
    return model.eval()


def model_config(folder: str | Path) -> PretrainedConfig:
    """The architecture in a model folder's config.json (no weights are read); exit 2 when the folder has none or
    its model type is one this transformers does not know."""
    f = Path(folder) / "config.json"
    if not f.is_file():
        raise UsageError(f"{folder}: no config.json; point at a model folder (or a folder holding only its "
                         "config.json, e.g. experiments/node8/models/Qwen3-8B)")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError) as e:  # an unknown model_type, malformed JSON
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{f}: not a config transformers can build ({first[:200]})") from None


def build_from_config(config: PretrainedConfig, dtype: str | torch.dtype = torch.float32, *, lora=None,
                      seed: int = 0):
    """The causal LM of `config` in `dtype`, with freshly initialized weights (seeded), in eval mode, and wrapped
    in LoRA adapters when lora.rank > 0, as load_policy would give it. Under FakeTensorMode its parameters are
    fake: the architecture's shapes with no memory behind them (tsrl plan measures memory that way). The
    parameters are created in `dtype` (no cast afterwards, which fake parameters do not allow)."""
    dt = _dtype(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dt)
    if dt == torch.float64:
        keep_float64_norms(model)
    model.eval()
    if lora is not None and lora.rank > 0:
        model = wrap_lora(model, lora.rank, lora.alpha, tuple(lora.targets), seed)
    return model


def parameter_names(model: str | Path) -> set[str]:
    """The names of every parameter of the model at `model` (a folder or a hub id), as trainable_state
    gives them for full fine-tuning (tied weights once): the model is built from its config on the meta
    device, so no weight is read or allocated."""
    with torch.device("meta"):
        built = build_from_config(AutoConfig.from_pretrained(str(model)))
    return {n for n, _ in built.named_parameters()}


# ---------------------------------------------------------------------------- loading


def load_tokenizer(spec: str | Path):
    """The tokenizer saved beside a policy (or a hub id's)."""
    try:
        return AutoTokenizer.from_pretrained(str(spec))
    except Exception as e:  # noqa: BLE001 - missing, corrupt or unknown tokenizer files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{spec}: no tokenizer could be loaded ({first}); a policy directory holds the tokenizer "
                         "it was trained with (tokenizer.save_pretrained)") from None


def load_policy(spec: str | Path, *, dtype: str | torch.dtype = "float32", device: str = "cpu", seed: int = 0,
                lora=None, base: str | Path | None = None, tokenizer: bool = True):
    """(model, tokenizer) of a policy, in `dtype`, on `device`, in eval mode.

    Args:
        spec: builtin:tiny | builtin:tiny-teacher (seeded random weights; tokenizer None), a directory
            written by save_pretrained, or a hub id (needs network).
        seed: the random weights of builtin specs, and the LoRA adapters' initial A matrices.
        lora: a config.LoRAConfig; with rank > 0 the model is `base` (default: spec) wrapped in fresh
            adapters, and when `spec` is another folder (a LoRA checkpoint) its adapter/ is loaded.
        tokenizer: False skips the tokenizer (a model-only directory, e.g. for tsrl verify).
    """
    dt = _dtype(dtype)
    if lora is not None and lora.rank > 0:
        model, tok = load_policy(base or spec, dtype=dt, seed=seed, tokenizer=tokenizer)
        model = wrap_lora(model, lora.rank, lora.alpha, tuple(lora.targets), seed)
        if base is not None and Path(spec).resolve() != Path(base).resolve():
            load_adapter(model, spec)
        return model.to(device), tok
    spec = str(spec)
    if spec == BUILTIN_TINY:
        return build_tiny_model(seed=seed, dtype=dt).to(device), None
    if spec == BUILTIN_TINY_TEACHER:
        return build_tiny_model(seed=seed + 1000, dtype=dt).to(device), None

    transformers.utils.logging.disable_progress_bar()
    p = Path(spec)
    looks_local = p.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1
    if looks_local and not (p / "config.json").is_file():
        raise UsageError(f"{spec}: not a model directory (no config.json); pass a directory written by "
                         f"save_pretrained, a hub id like Qwen/Qwen3-0.6B, or {BUILTIN_TINY}")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dt)
    except Exception as e:  # noqa: BLE001 - hub unreachable, missing or corrupt weights, a bad config.json ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{spec}: could not load the model ({type(e).__name__}: {first[:300]}); pass a directory "
                         "written by save_pretrained") from None
    tok = load_tokenizer(spec) if tokenizer else None
    return _prepare(model, dt).to(device), tok


# ---------------------------------------------------------------------------- LoRA


def require_peft() -> None:
    """Exit 2 with the install line when LoRA is asked for without peft."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UsageError("lora.rank > 0 needs the peft package: pip install -e '.[lora]'") from None


def wrap_lora(model, rank: int, alpha: float, targets: tuple[str, ...], seed: int):
    """The base model wrapped in LoRA adapters (PEFT); only adapter parameters require grad.

    The adapters' A matrices are drawn from `seed` on the CPU generator (every process gets identical
    ones, whatever its device); B starts at zero. Adapters take the base weights' dtype when it is
    float64 (peft keeps them float32 otherwise, which is what it does for bf16 bases too).
    """
    require_peft()
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        raise UsageError(f"lora.targets: no module named {', '.join(missing)} in this model "
                         f"(its linear layers include: {', '.join(sorted(linear))})")
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                      lora_dropout=0.0, bias="none"))
    if dtype == torch.float64:
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.float64)
    return peft_model.eval()


def load_adapter(model, ckpt_dir: str | Path) -> None:
    """Load the adapter weights of a LoRA checkpoint (<ckpt>/adapter/) into a wrapped model."""
    from peft import set_peft_model_state_dict

    f = Path(ckpt_dir) / ADAPTER_DIR / "adapter_model.safetensors"
    if not f.is_file():
        raise UsageError(f"{ckpt_dir}: a LoRA run's checkpoint needs {ADAPTER_DIR}/adapter_model.safetensors "
                         "(was it written by a full fine-tuning run?)")
    res = set_peft_model_state_dict(model, load_file(str(f)))
    if getattr(res, "unexpected_keys", None):
        raise UsageError(f"{f}: adapter weights do not fit this model ({res.unexpected_keys[0]} ...)")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's transformer blocks (Qwen3, Llama, ... and their PEFT wrappers): the units that activation
    checkpointing recomputes and a learner group shards (rl/group.py)."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return mod
    raise ValueError(f"{type(model).__name__}: no `layers` ModuleList of decoder blocks")


def _checkpointed_forward(self, *args, **kwargs):
    """A decoder layer's forward under torch.utils.checkpoint (non-reentrant): the backward recomputes it."""
    return torch.utils.checkpoint.checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(model) -> int:
    """Activation checkpointing (learner.activation_checkpointing): each decoder layer keeps only its input
    for the backward and recomputes the rest there; returns the number of layers.

    torch.utils.checkpoint per layer, not transformers' gradient_checkpointing_enable, which checkpoints only
    in train mode (tsrl's models stay in eval mode: no dropout). The layer's forward is replaced on the
    instance, inside its module hooks, so on a learner group FSDP2's unshard (a hook of the same layer,
    the FSDP unit) runs before the forward and before its recomputation; parameter names do not change,
    and a deepcopy keeps it (a bound method is rebound to the copy).
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = types.MethodType(_checkpointed_forward, layer)
    return len(layers)


def is_lora(model) -> bool:
    return getattr(model, "peft_config", None) is not None


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The parameters the learner updates, by name: every parameter (full fine-tuning) or the adapters."""
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def param_bytes(model, trainable_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable_only)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------- saving


def save_policy(model, tokenizer, out_dir: str | Path, *, dtype: str | torch.dtype | None = None,
                extra: Callable[[Path], None] | None = None) -> Path:
    """Write a policy folder atomically: save_pretrained (safetensors) + tokenizer + whatever `extra`
    writes into the folder before it is renamed into place (a crash never leaves half a folder).

    dtype: save a copy cast to it (the model itself is untouched). A LoRA model is saved merged
    (loadable with AutoModelForCausalLM) with its PEFT adapter in adapter/.
    A full disk is OSError(ENOSPC) naming the folder, whichever library was writing (torch.save reports
    it as a RuntimeError); nothing of the folder is left.
    """
    out = Path(out_dir)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar on stderr: runs print their own
    try:
        with atomic_dir(out) as tmp:
            if is_lora(model):
                merged = copy.deepcopy(model).merge_and_unload()
                (merged if dtype is None else merged.to(_dtype(dtype))).save_pretrained(str(tmp))
                del merged
                model.save_pretrained(str(tmp / ADAPTER_DIR))
            elif dtype is not None:
                copy.deepcopy(model).to(_dtype(dtype)).save_pretrained(str(tmp))
            else:
                model.save_pretrained(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            if extra is not None:
                extra(tmp)
    except (OSError, RuntimeError) as e:
        if getattr(e, "errno", None) != errno.ENOSPC and shutil.disk_usage(out.parent).free >= (1 << 20):
            raise
        raise OSError(errno.ENOSPC, f"no space left on the disk of {out.parent} while writing {out.name} "
                                    "(nothing of it was kept)") from None
    return out


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over a policy folder's config.json and weight files (names and their sha256): which weights."""
    d = Path(model_dir)
    files = [d / "config.json", *sorted(d.glob("*.safetensors")), *sorted(d.glob("*.bin"))]
    return hashlib.sha256("".join(f"{f.name} {file_sha256(f)}\n" for f in files if f.is_file()).encode()).hexdigest()


# ---------------------------------------------------------------------------- log-probs


def forward_logprobs(model, ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor | None = None, *,
                     entropy: bool = False, chunk_tokens: int | None = None, scored_B_T: torch.Tensor | None = None,
                     position_ids_B_T: torch.Tensor | None = None,
                     past_key_values=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log-probs of the given tokens (with grad), and (B, T) entropies when asked.

    Computed from raw logits (core.losses.token_logprobs), never through transformers' `labels=`
    loss, which upcasts to float32: a float64 model keeps float64 here.
    chunk_tokens (learner.logits_chunk_tokens): the LM head, log-softmax and entropy, and their backward,
    run that many positions at a time (core.losses): the same values and gradients, and no
    full-vocabulary tensor longer than chunk_tokens positions.
    scored_B_T: the positions whose log-probs are needed (a loss's scored tokens): with a plain linear head the
    head runs over those alone (core.losses.selected_token_logprobs; the rest are 0), else over every position.
    position_ids_B_T: positions restarting at 0 inside a row mark packed sequences (transformers attends within
    each only); with them the attention mask is None.
    past_key_values: a transformers Cache the rows attend to before their own positions (rl/prefix.py: a group's
    prompt); the attention mask then covers the past's positions and the rows', and position_ids_B_T continue it.
    """
    plain_head = type(model.get_output_embeddings()) is torch.nn.Linear
    if chunk_tokens is None and (scored_B_T is None or not plain_head):
        logits = model(input_ids=ids_B_T, attention_mask=attention_mask_B_T, position_ids=position_ids_B_T,
                       past_key_values=past_key_values, use_cache=False).logits
        return token_logprobs(logits, ids_B_T), (token_entropy(logits) if entropy else None)
    hidden, head = _last_hidden(model, ids_B_T, attention_mask_B_T, position_ids_B_T, past_key_values)
    # a learner group: FSDP2 reshards the root unit (the head) after each backward, and a second backward of
    # the same forward (the learner's regularizer pass) reaches the head before any FSDP hook gathers it again
    regather = model.unshard if isinstance(model, FSDPModule) else None
    if scored_B_T is not None:
        return selected_token_logprobs(hidden, head.weight, head.bias, ids_B_T, scored_B_T, chunk_tokens, entropy,
                                       regather)
    return chunked_token_logprobs(hidden, head.weight, head.bias, ids_B_T, chunk_tokens, entropy, regather)


def _last_hidden(model, ids_B_T, attention_mask_B_T, position_ids_B_T=None, past_key_values=None):
    """((B, T, H) hidden states the LM head reads, the head): the model's own forward, asked for no logits.

    The forward runs through the model's __call__ (on a learner group, FSDP's root hooks gather the head
    and keep it unsharded for the backward); a hook on the decoder takes its last hidden state, and
    `logits_to_keep` with no index makes the head compute nothing.
    """
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise UsageError(f"learner.logits_chunk_tokens needs a plain linear LM head; this model's is "
                         f"{type(head).__name__} (a LoRA-wrapped lm_head?): set learner.logits_chunk_tokens=null")
    box = []
    hook = model.get_decoder().register_forward_hook(lambda mod, args, out: box.append(out[0]))
    try:
        model(input_ids=ids_B_T, attention_mask=attention_mask_B_T, position_ids=position_ids_B_T,
              past_key_values=past_key_values, use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=ids_B_T.device))
    finally:
        hook.remove()
    return box[0], head


@torch.no_grad()
def score_tokens(model, ids_T: list[int], start: int = 0, end: int | None = None) -> list[float]:
    """log pi(ids[j] | ids[:j]) for j in [start, end), as float64 Python floats (position 0: 0.0).

    Only the logits that predict those tokens are computed (positions max(start, 1) - 1 .. end - 2):
    the OPD teacher scores one turn of a long prefix at the cost of the prefix's forward alone.
    By causality, scoring a prefix equals scoring the whole sequence at those positions.
    """
    end = len(ids_T) if end is None else end
    first = max(start, 1)
    lead = [0.0] * (first - start)  # position 0 predicts nothing
    if end <= first:
        return lead
    ids = torch.tensor([ids_T[:end]], dtype=torch.long, device=next(model.parameters()).device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=end - first + 1).logits  # (1, end-first+1, V)
    # the kept logits sit at positions first-1 .. end-1: aligned with ids[first-1:end], whose column 0 predicts nothing
    lp = token_logprobs(logits, ids[:, first - 1:end])[0, 1:]
    return lead + lp.double().tolist()
