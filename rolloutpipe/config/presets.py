"""The paper's modes as presets: ``controller.mode`` names a (schedule, policy) pair.

A preset is expanded in one place, :func:`expand_preset`, on a mapping of config values: on each layer
of ``load_config`` (the file, the environment, the command line) before the library merges them, so a
later layer's preset overrides an earlier layer's policy and a later layer's policy overrides an
earlier layer's preset; and on ``Config(...)``'s own arguments (``Config``'s validator).  A preset
given together with a different policy or schedule is an error; the caller says where it came from.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

Mode = Literal["sync", "cgp", "cgp-fgd"]
MODES: tuple[Mode, ...] = ("sync", "cgp", "cgp-fgd")
Schedule = Literal["barrier", "pipelined"]
# The paper's names, as presets of the trainer's schedule and the controller's policy.
PRESETS: dict[str, tuple[Schedule, str]] = {
    "sync": ("barrier", "fifo"),
    "cgp": ("pipelined", "fifo"),
    "cgp-fgd": ("pipelined", "fgd"),
}


def mode_label(schedule: str, policy: str) -> str:
    """The preset's name for a (schedule, policy) pair, else ``schedule/policy``."""
    for name, pair in PRESETS.items():
        if pair == (schedule, policy):
            return name
    return f"{schedule}/{policy}"


def _given(section: Any) -> dict[str, Any] | None:
    """The keys a section was given: a mapping's, or the fields set on a section model; None for a
    value that is neither (validation names it)."""
    if isinstance(section, BaseModel):
        return {k: getattr(section, k) for k in section.model_fields_set}
    return section if isinstance(section, dict) else None


def expand_preset(data: dict[str, Any], *, keep_mode: bool = False) -> dict[str, Any]:
    """``controller.mode`` -> ``controller.policy`` + ``trainer.schedule``: a copy of ``data`` with the
    preset's two values (and without ``controller.mode`` unless ``keep_mode``), or ``data`` itself
    when it asks for no preset (or for one that does not exist: validation names the bad value).

    A ValueError if ``data`` also gives a policy or a schedule other than the preset's.
    """
    ctl = _given(data.get("controller", {}))
    tr = _given(data.get("trainer", {}))
    if ctl is None or tr is None:
        return data
    mode = ctl.get("mode")
    if not isinstance(mode, str) or mode not in PRESETS:
        return data
    schedule, policy = PRESETS[mode]
    clash = [f"{k}={v!r}" for k, v, want in (("controller.policy", ctl.get("policy", policy), policy),
                                              ("trainer.schedule", tr.get("schedule", schedule), schedule))
             if v != want]  # fmt: skip
    if clash:
        raise ValueError(
            f"controller.mode={mode} means trainer.schedule={schedule!r} and controller.policy="
            f"{policy!r}, but {', '.join(clash)} is set too: drop controller.mode to choose the two "
            "separately"
        )
    controller = {k: v for k, v in ctl.items() if keep_mode or k != "mode"}
    return {**data, "controller": {**controller, "policy": policy}, "trainer": {**tr, "schedule": schedule}}
