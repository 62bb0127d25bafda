"""Admission and allocation policies behind one seam (``base.py``): one pure file each.

``controller.policy`` names one of :data:`BUILTIN` or gives a dotted path ``pkg.module:Class`` to a
class of your own; ``controller.policy_args`` go to its constructor after the controller config.
"""

from __future__ import annotations

from typing import Any, cast

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.scheduling.base import Policy

BUILTIN = {
    "fifo": "rolloutpipe.scheduling.fifo:FifoPolicy",
    "fifo-late": "rolloutpipe.scheduling.fifo:LateFifoPolicy",
    "fgd": "rolloutpipe.scheduling.fgd:FrontierPolicy",
    "fixed": "rolloutpipe.scheduling.fgd:FrontierPolicy",  # allocation's name for fgd: G a prompt
    "dynamic-sampling": "rolloutpipe.scheduling.dynamic_sampling:DynamicSamplingPolicy",
    "vigor": "rolloutpipe.scheduling.vigor:VigorPolicy",
    "pilot-commit": "rolloutpipe.scheduling.pilot_commit:PilotCommitPolicy",
}


def make_policy(cfg: ControllerConfig) -> Policy:
    from rolloutpipe.plugins import import_string

    path = BUILTIN.get(cfg.policy, cfg.policy)
    try:
        cls: Any = import_string(path)
    except Exception as e:
        raise ConfigError(
            f"controller.policy {cfg.policy!r}: not one of {sorted(BUILTIN)} and not an importable "
            f"'module:Class' ({e})"
        ) from e
    policy = cls(cfg, **cfg.policy_args)
    for attr in ("plan", "admit", "on_stats", "engine_queue", "changes_groups", "history"):
        if not hasattr(policy, attr):
            raise ConfigError(f"controller.policy {cfg.policy!r} has no {attr!r} (see scheduling/base.py)")
    return cast(Policy, policy)
