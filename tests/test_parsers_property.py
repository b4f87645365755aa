"""Property tests of the two parsers users feed by hand: the rollout record (tsrl verify --rollouts) and the
training config (YAML file and --set). Random input is either accepted, and then well-formed, or refused
with a UsageError naming the place; any other exception is a defect. Each strategy is shown to reach both
outcomes (hypothesis.find), so a parser that refused everything, or a strategy that only ever produced
garbage, would fail here. docs/reliability.md lists these properties."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import yaml
from hypothesis import HealthCheck, example, find, given, settings
from hypothesis import strategies as st

from tsrl_cli.config import (
    ConfigError,
    TrainConfig,
    _merge,
    config_to_dict,
    dump_config,
    load_config,
    parse_set,
    validate_config,
)
from tsrl_cli.errors import UsageError
from tsrl_cli.rollouts import parse_rollout, read_rollouts

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# hypothesis.find: a first call slowed by a busy machine is not a failure; 2000 examples, because a valid
# override of 1-3 random keys among the config's ~100 is rare (at 100 examples the search missed 1 time in 3)
FIND = settings(deadline=None, max_examples=2000)

# JSON as Python decodes it: json.loads also reads NaN, Infinity and integers of any size
scalars = st.none() | st.booleans() | st.integers() | st.integers(-2**1100, 2**1100) | st.floats() | st.text(max_size=8)
json_values = st.recursive(scalars,
                           lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)

GOOD = {"group_id": "q1", "sample_index": 0, "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0],
        "reward": 1.0, "turn_spans": [[2, 4]], "teacher_logprobs": [0.0, -1.0, -0.5, -0.25, 0.0]}
FIELDS = [*GOOD, "behavior_logprobs", "ref_logprobs"]


@st.composite
def rollout_objects(draw):
    """A valid record with up to three fields replaced by near-valid or random values, removed, or added."""
    obj = json.loads(json.dumps(GOOD))
    n = len(obj["input_ids"])
    near = {
        "group_id": st.sampled_from(["", "g", 0, None]),
        "sample_index": st.sampled_from([-1, 0, 3, True, 1.0, "0", 2**70]),
        "input_ids": st.lists(st.integers(-2, 2**65) | st.booleans() | st.floats(), max_size=n + 1),
        "loss_mask": st.lists(st.sampled_from([0, 1, 2, True, 1.0, -1]), min_size=n - 1, max_size=n + 1),
        "reward": st.sampled_from([0.0, -3, 1e308, math.inf, math.nan, 2**1100, True, "1"]),
        "turn_spans": st.lists(st.lists(st.integers(-1, n + 1) | st.booleans(), min_size=1, max_size=3), max_size=3),
        "teacher_logprobs": st.lists(st.sampled_from([0.0, -1, math.nan, -math.inf, 2**1100, True, None]),
                                     min_size=n - 1, max_size=n + 1),
        "behavior_logprobs": st.lists(st.floats(), min_size=n, max_size=n),
        "ref_logprobs": st.just(None) | st.lists(st.floats(-50, 0), min_size=n, max_size=n),
    }
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(["near", "near", "random", "drop", "extra"]))
        key = draw(st.sampled_from(FIELDS))
        if how == "near":
            obj[key] = draw(near[key])
        elif how == "random":
            obj[key] = draw(json_values)
        elif how == "drop":
            obj.pop(key, None)
        else:
            obj[draw(st.text(max_size=6))] = draw(json_values)
    return obj


def rollout_outcome(obj) -> str:
    """'ok' (and the record is well formed), or 'refused' (a UsageError naming the place); anything else raises."""
    try:
        ro = parse_rollout(obj, "r.jsonl:7")
    except UsageError as e:
        assert str(e).startswith("r.jsonl:7: "), e
        return "refused"
    ints = [ro.sample_index, *ro.input_ids, *ro.loss_mask, *(x for s in ro.turn_spans for x in s)]
    assert all(type(x) is int for x in ints), ro  # no bool, no float slips through as an index
    assert set(ro.loss_mask) <= {0, 1} and len(ro.loss_mask) == len(ro.input_ids) and math.isfinite(ro.reward)
    for k in ("teacher_logprobs", "behavior_logprobs", "ref_logprobs"):
        v = getattr(ro, k)
        assert v is None or (len(v) == len(ro.input_ids) and all(math.isfinite(x) for x in v)), (k, v)
    assert parse_rollout(json.loads(json.dumps(ro.to_json())), "again") == ro  # what it writes, it reads back
    return "ok"


@SETTINGS
@given(rollout_objects())
@example({**GOOD, "reward": 2**1100})  # once an OverflowError
@example({**GOOD, "loss_mask": [0, 0, 1.0, 1, 0]})  # once accepted as a float
@example({**GOOD, "behavior_logprobs": [0.0, 0.0, 0.0, 0.0, math.inf]})  # once accepted
def test_rollout_record_is_accepted_well_formed_or_refused(obj):
    rollout_outcome(obj)


@SETTINGS
@given(json_values)
def test_any_json_value_as_a_rollout_record(obj):
    rollout_outcome(obj)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=40) | rollout_objects().map(json.dumps), min_size=1, max_size=4))
def test_rollouts_file_of_random_lines(tmp_path_factory, lines):
    p = tmp_path_factory.mktemp("r") / "r.jsonl"
    p.write_text("\n".join(x.replace("\n", " ") for x in lines) + "\n", encoding="utf-8")
    try:
        read_rollouts(p)
    except UsageError as e:
        assert str(e).startswith(str(p)), e


def test_rollout_strategy_reaches_both_outcomes():
    find(rollout_objects(), lambda o: rollout_outcome(o) == "ok" and o != GOOD, settings=FIND)
    find(rollout_objects(), lambda o: rollout_outcome(o) == "refused", settings=FIND)


def test_the_harness_catches_a_crashing_parser(monkeypatch):
    """Positive control: an exception other than UsageError is not counted as a refusal."""
    monkeypatch.setitem(globals(), "parse_rollout", lambda obj, where: math.isfinite(obj["reward"]))
    with pytest.raises(OverflowError):
        rollout_outcome({"reward": 2**1100})


# ---- the config ---------------------------------------------------------------------------------------
SECTIONS = {f: list(config_to_dict(getattr(TrainConfig(), f))) for f, v in config_to_dict(TrainConfig()).items()
            if isinstance(v, dict)}
TOP = list(config_to_dict(TrainConfig()))
KEYS = TOP + [f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks]
config_values = (st.sampled_from([0, 1, -1, 2, 0.5, 1e-3, "1.0e-3", "1e400", "nan", "-inf", True, None, "", "grpo",
                                  "stream", "float64", "builtin:toy", "cpu", "cpu:0", [], ["a"], [1, 2], 2**1100])
                 | json_values)


def config_outcome(make) -> str:
    """'ok' (and the config is valid and survives a YAML round trip) or 'refused' (a ConfigError)."""
    try:
        cfg = make()
    except ConfigError:
        return "refused"
    assert isinstance(cfg, TrainConfig) and validate_config(cfg) is cfg
    for v in _leaves(config_to_dict(cfg)):
        assert not isinstance(v, float) or math.isfinite(v), cfg  # no NaN or infinity reaches training
    unsaved = replace(cfg, rollout=replace(cfg.rollout, server_api_key=""))  # config.SECRET_KEYS are saved as ""
    assert _merge(TrainConfig(), yaml.safe_load(dump_config(cfg))) == unsaved  # the saved config.yaml reloads
    return "ok"


def _leaves(d):
    for v in (d.values() if isinstance(d, dict) else d):
        if isinstance(v, (dict, list)):
            yield from _leaves(v)
        else:
            yield v


@st.composite
def overrides(draw):
    """A nested override mapping: known keys (mostly) and unknown ones, with near-valid and random values."""
    out: dict = {}
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS) | st.text(max_size=6))
        node = out
        parts = key.split(".") if key else [key]
        for p in parts[:-1]:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else node
        node[parts[-1]] = draw(config_values)
    return out


@SETTINGS
@given(overrides())
def test_config_mapping_is_valid_or_refused(o):
    config_outcome(lambda: validate_config(_merge(TrainConfig(), o)))


@SETTINGS
@given(st.sampled_from(KEYS) | st.text(max_size=10), st.text(max_size=12) | config_values.map(json.dumps))
@example("optim.lr", str(2**1100))  # once an OverflowError
@example("rollout.temperature", "1E1000")  # once accepted as infinity
def test_set_item_is_valid_or_refused(key, raw):
    config_outcome(lambda: load_config(sets=[f"{key}={raw}"]))


@SETTINGS
@given(st.text(max_size=30))
def test_set_of_any_text(item):
    config_outcome(lambda: load_config(sets=[item]))


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60) | overrides().map(lambda o: yaml.safe_dump(o, allow_unicode=True)))
def test_experiment_file_of_any_text(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("c") / "exp.yaml"
    p.write_text(text, encoding="utf-8")
    config_outcome(lambda: load_config(p))


def test_config_strategies_reach_both_outcomes():
    find(overrides(), lambda o: config_outcome(lambda: validate_config(_merge(TrainConfig(), o))) == "ok"
         and _merge(TrainConfig(), o) != TrainConfig(), settings=FIND)
    find(overrides(), lambda o: config_outcome(lambda: validate_config(_merge(TrainConfig(), o))) == "refused",
         settings=FIND)
    assert parse_set("rollout.group_size=4") == {"rollout": {"group_size": 4}}
