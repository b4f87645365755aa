"""The rollout record: one finished trajectory, as JSONL (one object per line).

Fields (the training engine writes the same):
  group_id (str), sample_index (int)
  input_ids (list[int]): prompt, model turns and tool observations, in order
  loss_mask (list[0|1]): 1 on model-generated tokens; loss_mask[j] refers to predicting input_ids[j]
  reward (float)
  turn_spans (list of [start, end)): one per model turn, over input_ids
  teacher_logprobs, behavior_logprobs, ref_logprobs (optional list[float], aligned with input_ids)
  masked (optional bool, written only when true): the trajectory failed for its infrastructure (its sandbox
    did not start, its engine failed), not the agent: left out of its group's statistics and of the loss
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tsrl_cli.errors import UsageError
from tsrl_cli.files import write_jsonl_atomic

_OPTIONAL_FLOATS = ("teacher_logprobs", "behavior_logprobs", "ref_logprobs")


@dataclass
class Rollout:
    group_id: str
    sample_index: int
    input_ids: list[int]
    loss_mask: list[int]
    reward: float
    turn_spans: list[tuple[int, int]]
    teacher_logprobs: list[float] | None = None
    behavior_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    masked: bool = False  # an infrastructure failure (sandbox, engine): out of the group's statistics and the loss

    @property
    def key(self) -> tuple[str, int]:
        return (self.group_id, self.sample_index)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def turn_tokens(self, k: int) -> int:
        s, e = self.turn_spans[k]
        return sum(self.loss_mask[s:e])

    def to_json(self) -> dict:
        d = asdict(self)
        d["turn_spans"] = [list(s) for s in self.turn_spans]
        return {k: v for k, v in d.items() if v is not None and (k != "masked" or v)}


def _fail(where: str, msg: str) -> UsageError:
    return UsageError(f"{where}: {msg}")


def _finite(x: object) -> bool:
    """A JSON number that is a finite float: no bool, NaN, Infinity, or integer past float range."""
    if type(x) not in (int, float):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def parse_rollout(obj: object, where: str) -> Rollout:
    """Validate one decoded JSON object; errors name `where` (file:line) and the field."""
    if not isinstance(obj, dict):
        raise _fail(where, "expected a JSON object (one trajectory per line)")
    known = {"group_id", "sample_index", "input_ids", "loss_mask", "reward", "turn_spans", "masked", *_OPTIONAL_FLOATS}
    for k in obj:
        if k not in known:
            raise _fail(where, f"unknown field {k!r} (known: {', '.join(sorted(known))})")
    for k in ("group_id", "sample_index", "input_ids", "loss_mask", "reward", "turn_spans"):
        if k not in obj:
            raise _fail(where, f"missing field {k!r}")
    gid = obj["group_id"]
    if not isinstance(gid, str) or not gid:
        raise _fail(where, "field 'group_id' must be a non-empty string")
    si = obj["sample_index"]
    if type(si) is not int or si < 0:
        raise _fail(where, "field 'sample_index' must be a non-negative integer")
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise _fail(where, "field 'input_ids' must be a non-empty list of non-negative integers")
    mask = obj["loss_mask"]
    if not isinstance(mask, list) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise _fail(where, "field 'loss_mask' must be a list of 0/1 integers")
    if len(mask) != len(ids):
        raise _fail(where, f"field 'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}")
    if mask[0] != 0:
        raise _fail(where, "field 'loss_mask' must be 0 at position 0 (nothing predicts the first token)")
    r = obj["reward"]
    if not _finite(r):
        raise _fail(where, "field 'reward' must be a finite number")
    spans = obj["turn_spans"]
    if not isinstance(spans, list):
        raise _fail(where, "field 'turn_spans' must be a list of [start, end) pairs")
    prev_end = 0
    clean: list[tuple[int, int]] = []
    for j, sp in enumerate(spans):
        if not (isinstance(sp, list) and len(sp) == 2 and all(type(x) is int for x in sp)):
            raise _fail(where, f"field 'turn_spans'[{j}] must be a pair [start, end) of integers")
        s, e = sp
        if not (prev_end <= s < e <= len(ids)):
            raise _fail(where, f"field 'turn_spans'[{j}] = [{s}, {e}) is not sorted, "
                               f"empty or past len(input_ids)={len(ids)}")
        clean.append((s, e))
        prev_end = e
    covered = [0] * len(ids)
    for s, e in clean:
        for j in range(s, e):
            covered[j] = 1
    stray = [j for j, m in enumerate(mask) if m and not covered[j]]
    if stray:
        raise _fail(where, f"field 'loss_mask' marks position {stray[0]} as a model token but no turn span covers it")
    extras: dict[str, list[float] | None] = {}
    for k in _OPTIONAL_FLOATS:
        v = obj.get(k)
        numbers = isinstance(v, list) and all(_finite(x) for x in v)
        if v is not None and not (numbers and len(v) == len(ids)):
            raise _fail(where, f"field {k!r} must be a list of {len(ids)} finite numbers aligned with 'input_ids'")
        extras[k] = [float(x) for x in v] if v is not None else None
    masked = obj.get("masked", False)
    if type(masked) is not bool:
        raise _fail(where, "field 'masked' must be true or false")
    return Rollout(gid, si, list(ids), list(mask), float(r), clean, **extras, masked=masked)


def read_rollouts(path: str | Path) -> list[Rollout]:
    """Read and validate a rollouts JSONL file; the first bad line raises UsageError (exit 2)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p}: rollouts file not found (pass --rollouts FILE.jsonl, one trajectory per line)")
    out: list[Rollout] = []
    seen: set[tuple[str, int]] = set()
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(where, f"not valid JSON ({e.msg} at column {e.colno})") from None
            ro = parse_rollout(obj, where)
            if ro.key in seen:
                raise _fail(where, f"duplicate (group_id, sample_index) = {ro.key}")
            seen.add(ro.key)
            out.append(ro)
    if not out:
        raise UsageError(f"{p}: no rollouts in file")
    return out


def write_rollouts(rollouts: list[Rollout], path: str | Path) -> None:
    """Write JSONL through a temp file and a rename, so a crash never leaves half a file."""
    write_jsonl_atomic(path, [r.to_json() for r in rollouts])
