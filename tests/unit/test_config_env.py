"""``RP_…`` environment variables: the config's namespace is kept apart from the tools' variables.

Config overrides are ``RP_<TOP-LEVEL KEY>`` (``RP_RUN``, ``RP_OUT``, ``RP_LOG_LEVEL``) and
``RP_<SECTION>__<KEY>``; the tools' own variables (``RP_REDIS_URL`` for tail/status/dlq,
``RP_WORKER_ID``, compose's ``RP_STEPS`` …) never reach the config.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from rolloutpipe import config as config_mod
from rolloutpipe.config import load_config
from rolloutpipe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"

# what docs/operations.md tells users to export, and what docker-compose.yml puts in a container
TOOLS_ENV = {
    "RP_REDIS_URL": "redis://127.0.0.1:1/0",  # tail, status, dlq (docs/operations.md)
    "RP_WORKER_ID": "gpu0",  # docker-compose.yml's GPU rollout services
    "RP_REDIS_SERVER": "/usr/bin/redis-server",
    "RP_STEPS": "3",  # compose interpolation variables, often exported in the shell
    "RP_REDIS_HOST": "10.0.0.2",
    "RP_MODELS_DIR": "/models",
    "RP_DATA_DIR": "/data",
    "RP_REDIS_APPENDFSYNC": "always",
    "RP_REDIS_TRAINER_PASSWORD": "secret",
    "RP_REDIS_OBSERVER_PASSWORD": "secret",
}


def test_tools_variables_do_not_reach_the_config(caplog: pytest.LogCaptureFixture) -> None:
    """Exporting ``RP_REDIS_URL`` for ``tail`` used to make ``rolloutpipe run`` abort."""
    plain = load_config(DEMO, environ={})
    with caplog.at_level(logging.WARNING, logger="rolloutpipe.config"):
        cfg = load_config(DEMO, environ=dict(TOOLS_ENV))
    assert cfg == plain
    assert cfg.redis.url == ""  # RP_REDIS_URL is the tools' variable: `run` still starts its own Redis
    assert not caplog.records  # known variables are not worth a warning


def test_tools_variables_in_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's path: ``load_config`` without ``environ`` reads ``os.environ``."""
    for k, v in TOOLS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RP_CONTROLLER__STEPS", "7")
    cfg = load_config(DEMO)
    assert cfg.controller.steps == 7 and cfg.redis.url == ""


def test_config_overrides_from_the_environment() -> None:
    env = {
        "RP_RUN": "envrun",
        "RP_CONTROLLER__STEPS": "7",
        "RP_REDIS__URL": "redis://10.0.0.9:6379/0",
        "RP_ROLLOUT__EMULATED__TIME_SCALE": "0.5",
        "RP_CONTROLLER__POLICY_ARGS__N0": "4",  # a free-form mapping takes any key
        "RP_METRICS__PORT": "9400",
    }
    cfg = load_config(DEMO, environ=env)
    assert cfg.run == "envrun" and cfg.controller.steps == 7
    assert cfg.redis.url == "redis://10.0.0.9:6379/0"
    assert cfg.rollout.emulated.time_scale == 0.5
    assert cfg.controller.policy_args == {"n0": 4}
    assert cfg.metrics.port == 9400
    # precedence: CLI overrides beat the environment
    assert load_config(DEMO, ["controller.steps=9"], environ=env).controller.steps == 9


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("RP_CONTROLLER__STEP", "5", r"controller\.step is not a config key.*RP_CONTROLLER__STEPS"),
        ("RP_FOO__BAR", "1", r"foo is not a config key"),
        ("RP_TASK", "x", r"task is a section.*RP_TASK__"),
        ("RP_CONTROLLER__STEPS__MAX", "1", r"controller\.steps is not a section"),
        ("RP_CONTROLLER__", "1", r"is not a config key"),
    ],
)
def test_a_stray_config_variable_is_named(name: str, value: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, environ={name: value})
    msg = str(e.value)
    assert f"environment variable {name}" in msg, msg
    assert re.search(says, msg), msg
    assert "Extra inputs are not permitted" not in msg


def test_a_bad_value_names_its_variable() -> None:
    with pytest.raises(ConfigError, match=r"controller\.steps.*RP_CONTROLLER__STEPS"):
        load_config(DEMO, environ={"RP_CONTROLLER__STEPS": "many"})
    # the same key from the command line is not blamed on the environment
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["controller.steps=many"], environ={"RP_CONTROLLER__STEPS": "3"})
    assert "RP_CONTROLLER__STEPS" not in str(e.value)


def test_an_unknown_variable_outside_the_namespace_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``RP_CONTROLLER_STEPS`` (one underscore) is no config key; it is ignored, and said so."""
    with caplog.at_level(logging.WARNING, logger="rolloutpipe.config"):
        cfg = load_config(DEMO, environ={"RP_CONTROLLER_STEPS": "5", "RP_SOMETHING_ELSE": "1"})
    assert cfg == load_config(DEMO, environ={})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "RP_CONTROLLER_STEPS" in text and "RP_CONTROLLER__STEPS" in text  # with the likely spelling
    assert "RP_SOMETHING_ELSE" in text


def _referenced_names() -> set[str]:
    """Every single-segment ``RP_…`` name the package, compose, CI and the docs mention."""
    files = [
        ROOT / "docker-compose.yml",
        ROOT / "README.md",
        ROOT / "Makefile",
        *(ROOT / "rolloutpipe").rglob("*.py"),
        *(ROOT / "docs").glob("*.md"),
        *(
            p
            for d in ("docker", "scripts", ".ci")
            for p in (ROOT / d).rglob("*")
            if p.is_file() and p.suffix != ".whl"  # docker/wheels/: the CPU torch wheel, 190 MB
        ),
    ]
    names: set[str] = set()
    for f in files:
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        names |= {n for n in re.findall(r"\bRP_[A-Z0-9_]+", text) if "__" not in n and not n.endswith("_")}
    return names


def test_every_variable_the_project_uses_is_registered() -> None:
    """A new tool variable must be added to ``TOOL_VARIABLES``, or ``run`` would warn about it."""
    top_level = {f"RP_{k.upper()}" for k in config_mod.Config.model_fields}
    names = _referenced_names()
    assert "RP_REDIS_URL" in names and "RP_WORKER_ID" in names  # the scan sees what it should
    examples = {"RP_CONTROLLER_STEPS"}  # docs/operations.md's example of a stray name
    missing = sorted(names - top_level - examples - set(config_mod.TOOL_VARIABLES))
    assert not missing, f"RP_ variables used but not in config.TOOL_VARIABLES: {missing}"
    assert not set(config_mod.TOOL_VARIABLES) & top_level
    documented = (ROOT / "docs" / "operations.md").read_text()
    undocumented = [n for n in config_mod.TOOL_VARIABLES if n not in documented]
    assert not undocumented, f"not in docs/operations.md: {undocumented}"
