"""Configuration: YAML under ``configs/``, overridden by ``RP_…`` env vars, overridden by dotted CLI flags.

Precedence (highest first): ``a.b=c`` CLI overrides, ``RP_A__B=c`` environment, the YAML file, defaults;
:func:`load_config` builds a :class:`Config` from them, and every error names the key and the layer
its value came from.  The public names are all importable from here (``from rolloutpipe.config import
Config, load_config``); each lives in one module of this package:

- ``schema.py``: the sections (``TaskConfig``, ``RolloutConfig``, ``ControllerConfig``,
  ``TrainerConfig`` …) and ``Config``, their defaults and checks; ``parse_listen``.
- ``load.py``: the layered sources (file, environment, command line), the blame, ``load_config``
  and ``parse_overrides``.
- ``presets.py``: ``controller.mode``, the paper's names (``MODES``, ``PRESETS``, ``mode_label``),
  expanded into ``controller.policy`` and ``trainer.schedule`` in one place.
- ``aliases.py``: verl's and TRL's names of trainer keys (``TRAINER_ALIASES``), read as ours.
- ``env.py``: ``TOOL_VARIABLES``, the ``RP_…`` variables that are the tools' and not config.
"""

from rolloutpipe.config.aliases import KL_ESTIMATORS, TRAINER_ALIASES, VERL_KL_LOSS_COEF
from rolloutpipe.config.env import TOOL_VARIABLES
from rolloutpipe.config.load import load_config, parse_overrides
from rolloutpipe.config.presets import MODES, PRESETS, Mode, Schedule, mode_label
from rolloutpipe.config.schema import (
    Config,
    ControllerConfig,
    DeepSpeedConfig,
    EmulatedEngineConfig,
    EmulatedTrainerConfig,
    EvalConfig,
    MetricsConfig,
    MigrationConfig,
    ModelConfig,
    PoolConfig,
    RedisConfig,
    RolloutConfig,
    TaskConfig,
    TrainerConfig,
    VllmEngineConfig,
    WarmStartConfig,
    parse_listen,
)

__all__ = [
    "KL_ESTIMATORS",
    "MODES",
    "PRESETS",
    "TOOL_VARIABLES",
    "TRAINER_ALIASES",
    "VERL_KL_LOSS_COEF",
    "Config",
    "ControllerConfig",
    "DeepSpeedConfig",
    "EmulatedEngineConfig",
    "EmulatedTrainerConfig",
    "EvalConfig",
    "MetricsConfig",
    "MigrationConfig",
    "Mode",
    "ModelConfig",
    "PoolConfig",
    "RedisConfig",
    "RolloutConfig",
    "Schedule",
    "TaskConfig",
    "TrainerConfig",
    "VllmEngineConfig",
    "WarmStartConfig",
    "load_config",
    "mode_label",
    "parse_listen",
    "parse_overrides",
]
