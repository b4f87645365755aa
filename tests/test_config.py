"""Config: precedence, strict keys and types, YAML round trip; CLI exit 2 on a bad key; the choices."""

import typing

import pytest
from typer.testing import CliRunner

from tsrl_cli.cli import app
from tsrl_cli.config import ConfigError, TrainConfig, dump_config, load_config, parse_set


def test_defaults_are_the_embedded_default():
    cfg = load_config()
    assert cfg == TrainConfig()
    assert (cfg.objective, cfg.schedule, cfg.rollout.group_size) == ("grpo", "stream", 8)
    assert cfg.data.train == ("embedded_repair_train", "embedded_terminal_train")
    assert str(cfg.run_dir()) == "results/embedded_default/stream/seed0"


def test_precedence_defaults_yaml_set_flags(tmp_path):
    y = tmp_path / "exp.yaml"
    y.write_text("name: exp\nseed: 1\nrollout: {group_size: 2, max_turns: 5}\noptim: {lr: 0.5}\n")
    cfg = load_config(y)
    assert (cfg.name, cfg.seed, cfg.rollout.group_size, cfg.rollout.max_turns, cfg.optim.lr) == ("exp", 1, 2, 5, 0.5)
    cfg = load_config(y, ["seed=2", "rollout.group_size=3"])
    assert (cfg.seed, cfg.rollout.group_size, cfg.rollout.max_turns) == (2, 3, 5)
    cfg = load_config(y, ["seed=2"], {"seed": 7, "optim.lr": None})  # None: the flag was not given
    assert (cfg.seed, cfg.optim.lr) == (7, 0.5)


def test_round_trip(tmp_path):
    cfg = load_config(sets=["optim.betas=[0.9, 0.95]", "data.train=[a, b]", "offpolicy.tis_cap=2"])
    p = tmp_path / "config.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg
    assert cfg.optim.betas == (0.9, 0.95) and cfg.offpolicy.tis_cap == 2.0


@pytest.mark.parametrize("sets,msg", [
    (["rollout.gruop_size=3"], "did you mean group_size"),
    (["zzz=1"], "valid here: name, objective"),
    (["seed=abc"], "expected an integer"),
    (["rollout.temperature=hot"], "expected a finite number"),
    (["run.save_rollouts=3"], "expected true or false"),
    (["rollout=3"], "expected a mapping"),
    (["schedule=later"], "not one of sync, stream, async"),
    (["rounds=0"], "must be >= 1"),
    (["offpolicy.tis_cap=-1"], "tis_cap"),
    (["noequals"], "key=value"),
    (["rollout.engine=sglang"], "not one of hf, vllm"),
    (["rollout.engine=vllm", "model.dtype=float64"], "vllm has no float64"),
    (["rollout.engine=vllm", "lora.rank=1024"], "vllm serves LoRA adapters up to rank 512"),
    (["rollout.engine=vllm", "rollout.vllm_memory_fraction=0"], "must be in \\(0, 1\\]"),
    (["lora.targets=q_proj"], "YAML list syntax"),
])
def test_bad_keys_and_values(sets, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(sets=sets)


def test_parse_set_yaml_values():
    assert load_config(sets=["optim.lr=1e-3"]).optim.lr == 1e-3  # YAML 1.1 reads 1e-3 as a string
    assert parse_set("x=[1, 2]") == {"x": [1, 2]}
    assert parse_set("x=null") == {"x": None}


def test_cli_unknown_key_exit_2_one_line():
    res = CliRunner().invoke(app, ["train", "--set", "rollout.gruop_size=3"])
    assert res.exit_code == 2
    assert "did you mean group_size" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_cli_missing_data_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ here
    res = CliRunner().invoke(app, ["train"])
    assert res.exit_code == 2
    assert "tsrl prepare-data embedded" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_cli_help():
    runner = CliRunner()
    assert runner.invoke(app, ["train", "--help"]).exit_code == 0
    assert runner.invoke(app, ["bench", "speedup", "--help"]).exit_code == 0


def test_vllm_engine_missing_exits_2_before_any_process(tmp_path, monkeypatch):
    """Where vllm is not importable (CI), asking for it fails in the main process with the install line."""
    import importlib.util

    from tsrl_cli.errors import UsageError
    from tsrl_cli.rl.train import check_placement

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(UsageError, match=r"pip install -e '\.\[gpu\]'"):
        check_placement(load_config(sets=["rollout.engine=vllm"]))


# ---- choices: each spelled once, as a Literal; the loader and the section checks enforce them ----------------

def test_a_literal_field_refuses_a_name_outside_it_with_its_choices():
    from tsrl_cli.config import OPD_UNITS, LearnerConfig, choices

    assert choices(LearnerConfig, "opd_unit") == OPD_UNITS == ("trajectory", "turn")
    assert load_config(sets=["learner.opd_unit=turn"]).learner.opd_unit == "turn"
    with pytest.raises(ConfigError, match=r"^config key learner.opd_unit: 'turns' is not one of trajectory, turn$"):
        load_config(sets=["learner.opd_unit=turns"])
    with pytest.raises(ConfigError, match="config key loss.loss_agg: 'mean' is not one of token-mean, "):
        load_config(sets=["loss.loss_agg=mean"])  # a LossConfig choice (Annotated[str, Literal]) too


def test_on_and_off_reach_their_choices_however_yaml_reads_them(tmp_path):
    """YAML 1.1 (PyYAML) reads an unquoted on / off as true / false: a key whose choices are on and off takes
    them either way, from --set and from a file; a bool where on / off are no choices is still refused."""
    cfg = load_config(sets=["learner.packing=on", "learner.microbatch=off"])
    assert (cfg.learner.packing, cfg.learner.microbatch) == ("on", "off")
    f = tmp_path / "exp.yaml"
    f.write_text("learner:\n  packing: off\n  microbatch: on\n")
    cfg = load_config(f)
    assert (cfg.learner.packing, cfg.learner.microbatch) == ("off", "on")
    assert load_config(sets=["learner.packing='on'"]).learner.packing == "on"  # quoted: a string already
    with pytest.raises(ConfigError, match=r"^config key learner.granularity: True is not one of trajectory, group$"):
        load_config(sets=["learner.granularity=true"])


def test_validate_config_checks_a_config_made_in_code():
    """dataclasses.replace skips the loader: validate_config checks the leaves and the loss section itself."""
    from dataclasses import replace

    from tsrl_cli.config import validate_config

    cfg = TrainConfig()
    with pytest.raises(ConfigError, match="config key schedule: 'later' is not one of sync, stream, async"):
        validate_config(replace(cfg, schedule="later"))
    with pytest.raises(ConfigError, match="needs an explicit constant"):
        validate_config(replace(cfg, loss=replace(cfg.loss, loss_agg="seq-mean-token-sum-norm")))
    assert validate_config(replace(cfg, schedule="sync")).schedule == "sync"


def _differ(registry, literal) -> set:
    return set(registry) ^ set(typing.get_args(literal))


def test_loss_names_in_config_are_core_registries():
    """core/ (torch only) holds the functions and the names; config.py copies them for torch-free checks."""
    from tsrl_cli.config import AdvNorm, AdvStd, KLType, LossAgg
    from tsrl_cli.core.advantages import ADVANTAGES, STD_KINDS
    from tsrl_cli.core.losses import KL_TYPES, LOSS_AGG_MODES

    for registry, literal in ((LOSS_AGG_MODES, LossAgg), (KL_TYPES, KLType), (ADVANTAGES, AdvNorm),
                              (STD_KINDS, AdvStd)):
        assert _differ(registry, literal) == set(), literal
    assert _differ((*LOSS_AGG_MODES, "seq-sum"), LossAgg) == {"seq-sum"}  # positive control: a name added to core
    assert _differ(tuple(ADVANTAGES)[:1], AdvNorm) == {"center", "rloo"}  # ... or missing there


def test_every_opd_form_is_computed():
    """config.OpdForm has no core registry: each name gives its own loss, and another name is refused."""
    import torch

    from tsrl_cli.config import LossConfig, OpdForm
    from tsrl_cli.errors import UsageError
    from tsrl_cli.rl.objective import Objective, opd_term

    logp, teacher = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -0.5]])
    losses = [opd_term(Objective("opd", LossConfig(opd_form=f)), logp, teacher) for f in typing.get_args(OpdForm)]
    assert len(losses) == 2 and not torch.equal(losses[0], losses[1])
    with pytest.raises(UsageError, match="OPD form 'fkl' is unknown; use one of pg, k3"):
        Objective("opd", LossConfig(opd_form="fkl"))
