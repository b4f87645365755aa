"""Where each process runs, and what the learner trains: devices and LoRA adapters.

Devices. The rollout side (engine + agent sessions), the learner and the OPD teacher are separate
processes; each is placed on one device given as `cpu`, a CUDA index (`4`), a range (`4-7`), a
list (`0,1`) or a torch name (`cuda:1`). One device per side for now: sharding the learner
(FSDP) or running several rollout engines over a range is not implemented, and a range of more
than one device is refused with that message rather than silently using its first device.

LoRA (`lora.rank` > 0). Both the learner and the rollout engine wrap the same base policy in the
same PEFT LoRA adapters (seeded init; B = 0, so round 1 samples from the base policy exactly).
Only the adapter parameters require grad, so the streaming accumulators, the optimizer state and
the per-round weight sync cover the adapters alone. A LoRA checkpoint `round-<k>/` holds the
merged model (loadable with AutoModelForCausalLM, as every checkpoint) plus `adapter/` (PEFT
format: PeftModel.from_pretrained(base, path)) from which `--resume` continues.
"""

from __future__ import annotations

import re
from pathlib import Path

from tsrl_cli.errors import UsageError

ADAPTER_DIR = "adapter"


def parse_devices(spec: str, key: str) -> tuple[str, ...]:
    """'cpu' | 'mps' | '3' | '4-7' | '0,2' | 'cuda:1' -> torch device names, in order."""
    s = str(spec).strip().lower()
    if s in ("cpu", "mps"):
        return (s,)
    out: list[str] = []
    for part in s.split(","):
        part = part.strip()
        if re.fullmatch(r"cuda:\d+", part):
            out.append(part)
        elif re.fullmatch(r"\d+", part):
            out.append(f"cuda:{int(part)}")
        elif m := re.fullmatch(r"(\d+)-(\d+)", part):
            a, b = int(m[1]), int(m[2])
            if b < a:
                raise UsageError(f"{key}: range {part!r} runs backwards; write it low-high, e.g. 4-7")
            out += [f"cuda:{i}" for i in range(a, b + 1)]
        else:
            raise UsageError(f"{key}: {spec!r} is not a device list; use cpu, a CUDA index (4), a range (4-7), "
                             "a list (0,1) or cuda:N")
    if len(set(out)) != len(out):
        raise UsageError(f"{key}: {spec!r} names a device twice")
    return tuple(out)


def one_device(spec: str, key: str) -> str:
    """The single device of a side; several are refused (no learner sharding or engine replicas yet)."""
    devs = parse_devices(spec, key)
    if len(devs) != 1:
        raise UsageError(f"{key}: {spec!r} names {len(devs)} devices, but each side runs on one device for now "
                         "(learner sharding and rollout engine replicas are not implemented); name one, e.g. "
                         f"{devs[0].removeprefix('cuda:')}")
    return devs[0]


def device_of(cfg, side: str) -> str:
    """The torch device name of one side (rollout | learner | teacher) of a TrainConfig."""
    spec = getattr(cfg.devices, side)
    if spec is None:  # the teacher defaults to the rollout device
        spec = cfg.devices.rollout
    return one_device(spec, f"devices.{side}")


def check_available(device: str, key: str) -> None:
    """Fail early (exit 2) when a CUDA device is named on a machine that has fewer."""
    if not device.startswith("cuda"):
        return
    import torch

    idx = int(device.split(":")[1])
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if idx >= n:
        raise UsageError(f"{key}: {device} is not available here ({n} CUDA device(s)); use cpu or an index below {n}"
                         if n else f"{key}: {device} asked for, but this torch build sees no CUDA device; use cpu")


# ---------------------------------------------------------------------------- LoRA


def require_peft() -> None:
    """Exit 2 with the install line when LoRA is asked for without peft."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UsageError("lora.rank > 0 needs the peft package: pip install -e '.[lora]'") from None


def wrap_lora(model, rank: int, alpha: float, targets: tuple[str, ...], seed: int):
    """The base model wrapped in LoRA adapters (PEFT); only adapter parameters require grad.

    The adapters' A matrices are drawn from `seed` (rollout and learner get identical ones); B starts
    at zero. Adapters take the base weights' dtype when it is float64 (peft keeps them float32
    otherwise, which is what it does for bf16 bases too).
    """
    import torch

    require_peft()
    from peft import LoraConfig, get_peft_model
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise UsageError(f"lora.targets: no module named {', '.join(missing)} in this model "
                         f"(its linear layers include: {', '.join(sorted(_linear_names(model)))})")
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


def _linear_names(model) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def trainable_state(model) -> dict:
    """The parameters the learner updates, by name: every parameter (full fine-tuning) or the adapters."""
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def load_adapter(model, ckpt_dir: str | Path) -> None:
    """Load the adapter weights of a LoRA checkpoint (round-<k>/adapter/) into a wrapped model."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    f = Path(ckpt_dir) / ADAPTER_DIR / "adapter_model.safetensors"
    if not f.is_file():
        raise UsageError(f"{ckpt_dir}: a LoRA run's checkpoint needs {ADAPTER_DIR}/adapter_model.safetensors "
                         "(was it written by a full fine-tuning run?)")
    res = set_peft_model_state_dict(model, load_file(str(f)))
    if getattr(res, "unexpected_keys", None):
        raise UsageError(f"{f}: adapter weights do not fit this model ({res.unexpected_keys[0]} ...)")


def save_merged(model, out_dir: str | Path) -> None:
    """save_pretrained of the base with the adapters folded in, leaving `model` untouched (a copy)."""
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    del merged


def param_bytes(model, trainable_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable_only)


def load_trained_policy(cfg, init_dir: str, policy_dir: str, device: str):
    """(model, tokenizer) of the policy being trained, on `device`: full weights from `init_dir`, or,
    with LoRA, the base from `policy_dir` wrapped in adapters (loaded from `init_dir` when resuming)."""
    from tsrl_cli.rl.rollout_worker import load_policy_model

    lc = cfg.lora
    if lc.rank <= 0:
        return load_policy_model(init_dir, cfg.model.dtype, device)
    model, tok = load_policy_model(policy_dir, cfg.model.dtype, device)
    model = wrap_lora(model, lc.rank, lc.alpha, tuple(lc.targets), cfg.seed)
    if Path(init_dir).resolve() != Path(policy_dir).resolve():
        load_adapter(model, init_dir)
    return model, tok
