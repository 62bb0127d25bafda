"""``load_config``'s layers, one pydantic-settings source each: defaults < the config file < ``RP_…``
variables < ``dotted.key=value`` overrides.  One test per precedence rule and per error message;
every error names the key and where its value came from.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from rolloutpipe.config import Config, load_config
from rolloutpipe.errors import ConfigError


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error(path: Path | None, overrides: list[str] | None = None, *, environ: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides, environ=environ)
    return str(e.value)


# --- precedence ---


def test_defaults_without_any_layer() -> None:
    assert load_config(None, environ={}) == Config()


def test_config_without_load_config_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RP_CONTROLLER__STEPS", "7")
    assert Config().controller.steps == 60  # the default: only load_config reads RP_… variables
    assert load_config(None).controller.steps == 7  # load_config without environ= reads os.environ


def test_file_beats_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "controller:\n  steps: 5\n"), environ={})
    assert cfg.controller.steps == 5


def test_environment_beats_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "controller:\n  steps: 5\n"), environ={"RP_CONTROLLER__STEPS": "6"})
    assert cfg.controller.steps == 6


def test_command_line_beats_environment_and_file(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  steps: 5\n")
    cfg = load_config(f, ["controller.steps=7"], environ={"RP_CONTROLLER__STEPS": "6"})
    assert cfg.controller.steps == 7


def test_nested_sections_merge_keeping_siblings_of_lower_layers(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  steps: 5\n  seed: 3\nrollout:\n  emulated:\n    time_scale: 0.5\n")
    cfg = load_config(
        f,
        ["rollout.emulated.max_num_seqs=8"],
        environ={"RP_CONTROLLER__GROUP_SIZE": "4", "RP_ROLLOUT__EMULATED__LENGTH_MEDIAN": "100"},
    )
    assert (cfg.controller.steps, cfg.controller.seed, cfg.controller.group_size) == (5, 3, 4)
    em = cfg.rollout.emulated
    assert (em.time_scale, em.length_median, em.max_num_seqs) == (0.5, 100, 8)
    assert cfg.controller.prompts_per_step == 16  # untouched: the default


def test_values_are_yaml_scalars_in_every_layer() -> None:
    env = {
        "RP_TASK__REWARD_ARGS__X": "1",
        "RP_CONTROLLER__POLICY_ARGS__K": "0.5",
        "RP_TRAINER__RECORD_GROUPS": "true",
        "RP_ROLLOUT__DEVICES": '["0", "1"]',
        "RP_TRAINER__CLIP_RATIO_C": "null",
        "RP_REDIS__URL": "",  # an empty value stays ""
    }
    cfg = load_config(None, ["controller.policy_args.n0=4", "trainer.log_to=[tensorboard]"], environ=env)
    assert cfg.task.reward_args == {"x": 1}
    assert cfg.controller.policy_args == {"k": 0.5, "n0": 4}
    assert cfg.trainer.record_groups is True and cfg.trainer.clip_ratio_c is None
    assert cfg.rollout.devices == ["0", "1"] and cfg.trainer.log_to == ["tensorboard"]
    assert cfg.redis.url == ""


def test_a_preset_in_a_later_layer_overrides_policy_and_schedule_of_an_earlier_one(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  policy: fgd\ntrainer:\n  schedule: pipelined\n")
    assert load_config(f, ["controller.mode=sync"], environ={}).mode == "sync"
    assert load_config(f, environ={"RP_CONTROLLER__MODE": "sync"}).mode == "sync"
    # and the other way round: a policy set in a later layer beats a preset of an earlier one
    g = write(tmp_path, "controller:\n  mode: sync\n", "g.yaml")
    cfg = load_config(g, ["controller.policy=fgd"], environ={})
    assert (cfg.controller.policy, cfg.trainer.schedule) == ("fgd", "barrier")


@pytest.mark.parametrize(
    ("layer", "where"),
    [
        ("file", r"the config file .*c\.yaml"),
        ("env", "the environment"),
        ("cli", "the command line"),
    ],
)
def test_a_preset_and_a_clashing_policy_in_one_layer_is_an_error_naming_it(
    tmp_path: Path, layer: str, where: str
) -> None:
    f = write(tmp_path, "controller:\n  mode: sync\n  policy: fgd\n" if layer == "file" else "run: x\n")
    env = {"RP_CONTROLLER__MODE": "sync", "RP_CONTROLLER__POLICY": "fgd"} if layer == "env" else {}
    over = ["controller.mode=sync", "controller.policy=fgd"] if layer == "cli" else []
    msg = error(f, over, environ=env)
    assert re.match(where + r": controller\.mode=sync means .*controller\.policy='fgd' is set too", msg), msg


def test_a_preset_among_configs_own_arguments_is_expanded_with_the_same_check() -> None:
    """``Config(...)`` without load_config: the same expansion (config/presets.py), as a ValidationError."""
    c = Config(controller={"mode": "sync"})
    assert c.mode == "sync" and c.controller.mode == "sync"  # kept, as given
    assert (c.controller.policy, c.trainer.schedule) == ("fifo", "barrier")
    with pytest.raises(
        ValidationError, match=r"controller\.mode=cgp means .*trainer\.schedule='barrier' is set too"
    ):
        Config(controller={"mode": "cgp"}, trainer={"schedule": "barrier"})


def test_a_preset_that_is_not_a_name_is_a_bad_value_naming_its_layer() -> None:
    msg = error(None, ["controller.mode=[1]"], environ={})  # used to be a TypeError (unhashable)
    assert msg.startswith("invalid config: controller.mode (from the command line): Input should be"), msg


# --- the environment's namespace ---


def test_tool_variables_never_reach_the_config(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rolloutpipe.config"):
        cfg = load_config(None, environ={"RP_REDIS_URL": "redis://h:1/0", "RP_STEPS": "3"})
    assert cfg == Config() and not caplog.records


def test_an_unknown_single_segment_variable_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="rolloutpipe.config"):
        cfg = load_config(None, environ={"RP_CONTROLLER_STEPS": "5"})
    assert cfg == Config()
    (rec,) = caplog.records
    assert "RP_CONTROLLER_STEPS" in rec.getMessage()
    assert "for the config key write RP_CONTROLLER__STEPS" in rec.getMessage()


def test_a_nested_variable_that_names_no_key_is_an_error_with_a_hint() -> None:
    msg = error(None, environ={"RP_TRAINER__LRR": "0.1"})
    assert msg.startswith("environment variable RP_TRAINER__LRR: trainer.lrr is not a config key"), msg
    assert "(did you mean RP_TRAINER__LR?)" in msg


# --- command-line overrides ---


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("controller.steps", r"'controller\.steps' is not of the form dotted\.key=value"),
        ("controller.step=5", r"controller\.step is not a config key \(did you mean controller\.steps\?\)"),
        ("controller.steps.max=5", r"controller\.steps is not a section, so controller\.steps\.max names"),
        ("task=x", r"task is a section: set one of its keys, task\.KEY"),
        ("controller.steps=[1", r"'\[1' is not a YAML value"),
    ],
)
def test_a_bad_override_is_an_error_naming_it(item: str, says: str) -> None:
    msg = error(None, [item], environ={})
    assert msg.startswith("command-line override "), msg
    assert re.search(says, msg), msg


# --- bad values: the key and where it came from ---


def test_a_bad_value_from_the_file_names_the_file(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  steps: many\n")
    msg = error(f, environ={})
    assert f"invalid config: controller.steps (from the config file {f}): Input should be" in msg, msg


def test_an_unknown_key_in_the_file_names_the_file(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  stepz: 5\n")
    assert f"controller.stepz (from the config file {f}): Extra inputs" in error(f, environ={})


def test_a_bad_value_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  steps: 5\n")
    msg = error(f, environ={"RP_CONTROLLER__STEPS": "many"})
    assert "invalid config: controller.steps (from RP_CONTROLLER__STEPS): Input should be" in msg, msg
    assert "config file" not in msg


def test_a_bad_value_from_the_command_line_names_the_command_line(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  steps: many\n")
    msg = error(f, ["controller.steps=lots"], environ={"RP_CONTROLLER__STEPS": "3"})
    assert "invalid config: controller.steps (from the command line): Input should be" in msg, msg
    assert "RP_CONTROLLER__STEPS" not in msg and "config file" not in msg


def test_a_section_error_names_every_layer_that_set_a_key_in_it(tmp_path: Path) -> None:
    f = write(tmp_path, "controller:\n  minibatches: 3\n")
    msg = error(f, ["controller.steps=2"], environ={"RP_CONTROLLER__SEED": "1"})
    assert f"controller (from the command line, RP_CONTROLLER__SEED, the config file {f})" in msg, msg
    assert "must be a multiple of minibatches (3)" in msg


# --- the file itself ---


def test_a_missing_config_file(tmp_path: Path) -> None:
    assert error(tmp_path / "nope.yaml", environ={}) == f"config file {tmp_path / 'nope.yaml'} does not exist"


def test_a_config_file_that_is_not_a_mapping(tmp_path: Path) -> None:
    f = write(tmp_path, "- 1\n- 2\n")
    assert error(f, environ={}) == f"config file {f} must hold a mapping, not list"


def test_a_config_file_that_is_not_yaml(tmp_path: Path) -> None:
    f = write(tmp_path, "a: [\n")
    assert error(f, environ={}).startswith(f"config file {f}: not YAML")


def test_an_empty_config_file_gives_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), environ={}) == Config()


# --- verl's and TRL's names of the loss options (docs/grpo.md) ---


@pytest.mark.parametrize(
    ("given", "want"),
    [
        (["trainer.clip_ratio_low=0.1", "trainer.clip_ratio_high=0.28"],
         {"clip_low": 0.1, "clip_high": 0.28}),
        (["trainer.clip_ratio=0.3"], {"clip_eps": 0.3}),
        (["trainer.use_kl_loss=true", "trainer.kl_loss_coef=0.01"], {"kl_coef": 0.01}),
        (["trainer.use_kl_loss=true"], {"kl_coef": 0.001}),  # verl's kl_loss_coef default
        (["trainer.use_kl_loss=false", "trainer.kl_loss_coef=0.01"], {"kl_coef": 0.0}),  # verl ignores it
        (["trainer.kl_loss_type=low_var_kl"], {"kl_estimator": "k3"}),
        (["trainer.kl_estimator=mse"], {"kl_estimator": "k2"}),
        (["trainer.loss_agg_mode=seq-mean-token-sum-norm"], {"loss_agg": "seq-mean-token-sum-norm"}),
        (["trainer.entropy_coeff=0.001"], {"entropy_coef": 0.001}),
        (["trainer.epsilon=0.25", "trainer.epsilon_high=0.28", "trainer.beta=0.04"],
         {"clip_eps": 0.25, "clip_high": 0.28, "kl_coef": 0.04}),
    ],
)  # fmt: skip
def test_verl_and_trl_names_are_read_as_ours(given: list[str], want: dict[str, object]) -> None:
    """``trainer.clip_ratio_high`` used to be refused with 'did you mean trainer.clip_ratio_c?'."""
    t = load_config(None, given, environ={}).trainer
    assert {k: getattr(t, k) for k in want} == want


def test_a_foreign_name_works_in_every_layer_and_a_later_layer_wins(tmp_path: Path) -> None:
    f = write(tmp_path, "trainer:\n  loss_agg: token-mean\n  clip_ratio_high: 0.3\n")
    env = {"RP_TRAINER__CLIP_RATIO_LOW": "0.15"}
    t = load_config(f, ["trainer.loss_agg_mode=seq-mean-token-mean"], environ=env).trainer
    assert (t.clip_low, t.clip_high, t.loss_agg) == (0.15, 0.3, "seq-mean-token-mean")
    assert load_config(f, ["trainer.clip_high=0.2"], environ={}).trainer.clip_high == 0.2


def test_a_foreign_name_and_ours_disagreeing_in_one_layer_is_an_error(tmp_path: Path) -> None:
    msg = error(None, ["trainer.clip_ratio_high=0.28", "trainer.clip_high=0.3"], environ={})
    assert "clip_ratio_high is verl's name of clip_high: give one of them (0.28 vs 0.3)" in msg
    assert "the command line" in msg
    msg = error(None, ["trainer.loss_type=dapo"], environ={})
    assert "TRL's loss_type is trainer.loss_agg here" in msg
