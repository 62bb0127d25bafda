"""Loading the config in layers: the YAML file < ``RP_…`` environment < dotted command-line overrides.

Precedence (highest first): ``a.b=c`` CLI overrides, ``RP_A__B=c`` environment, the YAML file, defaults.
Loaded (:func:`load_config`) before any event loop starts.  Each layer is a pydantic-settings source
and the library merges them (a deep merge: a layer that sets one key of a section keeps the others
from the layers below): the file through ``YamlConfigSettingsSource``, the environment through
``EnvSettingsSource`` (prefix ``RP_``, ``__`` between levels, any case) over the given mapping, the
overrides through a small source of our own; ``Config.settings_customise_sources`` orders them.
``Config(...)`` outside ``load_config`` reads neither a file nor the environment.

What the library does not do is done here, per layer: values (of variables and overrides alike) are
YAML scalars, so ``RP_CONTROLLER__POLICY_ARGS__K=0.5`` is a float and an empty value stays ``""``;
``controller.mode`` is expanded into ``controller.policy`` and ``trainer.schedule`` within its layer
(``config/presets.py``), so a later layer's preset overrides an earlier layer's policy, while a preset
and a different policy in one layer is an error naming the layer; verl's and TRL's trainer keys are
read as ours within their layer (``config/aliases.py``); and every error names the key and where its
value came from (the blame): ``(from the config file PATH)``, ``(from RP_CONTROLLER__STEPS)``,
``(from the command line)``.

The environment's config namespace is ``RP_<KEY>`` for a top-level key (``RP_RUN``, ``RP_OUT``,
``RP_LOG_LEVEL``) and ``RP_<SECTION>__<KEY>[__<KEY>…]`` (a double underscore between levels) for
everything else.  A variable of that namespace that names no config key is an error that names the
variable, with the likely spelling; so is an override ``a.b=c`` that names none.  The tools' own
variables (``TOOL_VARIABLES``, ``config/env.py``: ``RP_REDIS_URL`` for ``tail`` and ``status``,
``RP_WORKER_ID``, compose's ``RP_STEPS`` …) are outside it and never reach the config; any other
``RP_…`` name outside it is ignored with a warning.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    YamlConfigSettingsSource,
)

from rolloutpipe.config.aliases import trainer_aliases
from rolloutpipe.config.env import TOOL_VARIABLES
from rolloutpipe.config.presets import expand_preset
from rolloutpipe.config.schema import _LOAD_SOURCES, Config
from rolloutpipe.errors import ConfigError

log = logging.getLogger("rolloutpipe.config")  # the package's logger, as before the split


def _scalar(raw: str, where: str) -> Any:
    """A value as written in a variable or an override: a YAML scalar (or flow list/mapping); "" stays ""."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: {raw!r} is not a YAML value ({why})") from e


def _env_name(parts: list[str]) -> str:
    return "RP_" + "__".join(parts).upper()


def _dotted_name(parts: list[str]) -> str:
    return ".".join(parts)


def _key_error(
    parts: list[str], value: Any = None, name: Callable[[list[str]], str] = _env_name
) -> str | None:
    """Why the path ``parts`` names no config value (None: it names one); ``name`` spells a path as the
    user wrote it (``RP_A__B`` or ``a.b``).  A section takes only a mapping."""
    model: type[BaseModel] = Config
    for i, part in enumerate(parts):
        fields = model.model_fields
        here = ".".join(parts[: i + 1])
        if part in getattr(model, "ALIASES", ()):
            return None  # another project's name of a key, read as ours (TRAINER_ALIASES)
        hints: dict[str, str] = getattr(model, "HINTS", {})
        if part in hints:
            return f"{here} is not a config key ({hints[part]})"
        if part not in fields:
            near = difflib.get_close_matches(part, list(fields), n=1)
            hint = f" (did you mean {name([*parts[:i], near[0]])}?)" if near else ""
            return f"{here or repr(part)} is not a config key{hint}"
        ann = fields[part].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
            continue
        if i < len(parts) - 1 and get_origin(ann) is not dict and ann is not dict:
            return f"{here} is not a section, so {name(parts)} names nothing"
        return None  # a value, or a key inside a free-form mapping (policy_args, extra_args, …)
    if isinstance(value, dict):
        return None
    return f"{'.'.join(parts)} is a section: set one of its keys, {name([*parts, 'KEY'])}"


class _Layer(PydanticBaseSettingsSource):
    """What load_config adds to each of its sources: per-layer preset expansion, and the layer the
    source gave, to say where a bad value came from."""

    label: str
    data: dict[str, Any]

    def _expanded(self, data: dict[str, Any]) -> dict[str, Any]:
        try:  # the layer's preset, within the layer that asked for it
            data = expand_preset(data)
        except ValueError as e:
            raise ConfigError(f"{self.label}: {e}") from e
        if isinstance(data.get("trainer"), dict):  # verl's and TRL's names, within the layer that used them
            try:
                data = {**data, "trainer": trainer_aliases(data["trainer"])}
            except ValueError as e:
                raise ConfigError(f"{self.label}: trainer.{e}") from e
        self.data = data
        return self.data

    def origins(self, parts: list[str]) -> list[str]:
        """Who, within this layer, set the value at ``parts`` (or above it, or below it)."""
        return [self.label]


class _FileSource(_Layer, YamlConfigSettingsSource):
    """The config file, through the library's YAML source; it must exist and hold a mapping."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        if not path.is_file():
            raise ConfigError(f"config file {path} {'is not a file' if path.exists() else 'does not exist'}")
        self.label = f"the config file {path}"
        super().__init__(settings_cls, yaml_file=path)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            loaded = super()._read_file(file_path)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {file_path}: not YAML ({e})") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file_path} must hold a mapping, not {type(loaded).__name__}")
        return loaded

    def __call__(self) -> dict[str, Any]:
        return self._expanded(super().__call__())


def _config_variables(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``RP_…`` variables that are config overrides, by name, with their values read as YAML.

    Config namespace: ``RP_<TOP-LEVEL KEY>`` and ``RP_<SECTION>__<KEY>…``.  Everything else that
    starts with ``RP_`` belongs to a tool (:data:`TOOL_VARIABLES`) or to nobody (a warning); a name of
    the namespace that names no key is an error.
    """
    out: dict[str, Any] = {}
    for k, raw in sorted(environ.items()):
        if not k.upper().startswith("RP_") or k.upper() in TOOL_VARIABLES:
            continue
        parts = k[3:].lower().split("__")
        if len(parts) == 1 and parts[0] not in Config.model_fields:
            near = [
                _env_name([s, rest])
                for s in Config.model_fields
                if (rest := parts[0].removeprefix(s + "_")) != parts[0] and not _key_error([s, rest])
            ]
            hint = f"; for the config key write {near[0]}" if near else ""
            log.warning("environment variable %s is neither a config override nor a known tool's "
                        "variable: ignored%s", k, hint)  # fmt: skip
            continue
        v = _scalar(raw, f"environment variable {k}")
        why = _key_error(parts, v)
        if why is not None:
            raise ConfigError(
                f"environment variable {k}: {why}.  Config overrides are RP_<KEY> for a top-level key "
                "and RP_<SECTION>__<KEY> below it; unset the variable if it is not meant for the config"
            )
        out[k] = v
    return out


class _EnvSource(_Layer, EnvSettingsSource):
    """``RP_…`` variables, through the library's env source (prefix ``RP_``, ``__`` between levels,
    any case) over the given mapping, less the names that are not config; values are YAML scalars."""

    label = "the environment"

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._config_vars = _config_variables(environ)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, Any]:
        return {k.lower(): v for k, v in self._config_vars.items()}

    def decode_complex_value(self, field_name: str, field: FieldInfo | None, value: Any) -> Any:
        return value  # already parsed, as YAML, by _load_env_vars

    def __call__(self) -> dict[str, Any]:
        return self._expanded(super().__call__())

    def origins(self, parts: list[str]) -> list[str]:
        def related(var: list[str]) -> bool:  # one path is a prefix of the other
            return var[: len(parts)] == parts[: len(var)]

        return [k for k in self._config_vars if related(k[3:].lower().split("__"))]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=3", "c=x"]`` -> nested dict; values are parsed as YAML scalars, keys checked."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"command-line override {item!r} is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        value = _scalar(raw, f"command-line override {item!r}")
        why = _key_error(parts, value, name=_dotted_name)
        cur = out
        for i, part in enumerate(parts[:-1]):
            nxt = cur.setdefault(part, {})
            if not isinstance(nxt, dict):
                why = why or f"{'.'.join(parts[: i + 1])} is set to a value by an earlier override"
                break
            cur = nxt
        if why is not None:
            raise ConfigError(f"command-line override {item!r}: {why}")
        cur[parts[-1]] = value
    return out


class _OverridesSource(_Layer):
    """``dotted.key=value`` arguments (the command line), a source of our own."""

    label = "the command line"

    def __init__(self, settings_cls: type[BaseSettings], items: list[str]) -> None:
        super().__init__(settings_cls)
        self._values = parse_overrides(items)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._expanded(self._values)


def _touches(data: Any, parts: list[str]) -> str | None:
    """``"sets"``: ``data`` holds the value at ``parts`` or one above it; ``"below"``: only keys under
    it (the error is about a whole section); None: nothing there."""
    for part in parts:
        if not isinstance(data, dict):
            return "sets"
        if part not in data:
            return None
        data = data[part]
    return "below" if isinstance(data, dict) and data else "sets"


def _blame(loc: tuple[int | str, ...], layers: tuple[_Layer, ...]) -> str:
    """``controller.steps (from RP_CONTROLLER__STEPS)``: the key, and which layers (highest first)
    gave the value that failed; a layer that sets the value itself hides the ones below it."""
    parts = [str(x) for x in loc]
    who: list[str] = []
    for layer in layers:
        how = _touches(getattr(layer, "data", {}), parts)
        if how is not None:
            who += layer.origins(parts)
            if how == "sets":
                break
    dotted = ".".join(parts) or "config"
    return f"{dotted} (from {', '.join(who)})" if who else dotted


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, environ: dict[str, str] | None = None
) -> Config:
    """The config file, then ``RP_…`` variables (``environ``, else ``os.environ``), then ``dotted.key=value``
    overrides, each a pydantic-settings source; errors name the key and where its value came from."""
    lowest_first: list[_Layer] = [_FileSource(Config, Path(path))] if path else []
    lowest_first.append(_EnvSource(Config, os.environ if environ is None else environ))
    lowest_first.append(_OverridesSource(Config, overrides or []))
    sources = tuple(reversed(lowest_first))
    token = _LOAD_SOURCES.set(sources)
    try:
        return Config()
    except ValidationError as e:
        msgs = "; ".join(f"{_blame(err['loc'], sources)}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid config: {msgs}") from e
    finally:
        _LOAD_SOURCES.reset(token)
