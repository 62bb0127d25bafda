"""Plug-ins are dotted import paths (``pkg.mod:attr`` or ``pkg.mod.attr``): datasets, verifiers,
reward functions, policies, engines.  This module loads them.

Release 0.2 moved RolloutPipe's own modules (``docs/architecture.md`` has the map).  A config that
still names an old path (``rolloutpipe.workers.task:digit_ops``) keeps working for one release: the
path is rewritten to the new module and a ``DeprecationWarning`` says which name to use.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any

from rolloutpipe.errors import ConfigError

# old module -> new module (0.1 -> 0.2); longest prefix wins
MOVED = {
    "rolloutpipe.allocation_bench": "rolloutpipe.bench.allocation",
    "rolloutpipe.bench": "rolloutpipe.bench.paper",
    "rolloutpipe.bound": "rolloutpipe.bench.bound",
    "rolloutpipe.broker_bench": "rolloutpipe.bench.broker",
    "rolloutpipe.dlq": "rolloutpipe.tools.dlq",
    "rolloutpipe.evaluate": "rolloutpipe.roles.trainer.evaluate",
    "rolloutpipe.multiplex": "rolloutpipe.launch.pool",
    "rolloutpipe.multiplex_bench": "rolloutpipe.bench.multiplex",
    "rolloutpipe.ops": "rolloutpipe.tools.tail",  # split in 0.2: also tools.status, tools.view
    "rolloutpipe.policy": "rolloutpipe.model.lm",
    "rolloutpipe.report": "rolloutpipe.tools.report",
    "rolloutpipe.runner": "rolloutpipe.launch.cluster",
    "rolloutpipe.timeline": "rolloutpipe.tools.timeline",
    "rolloutpipe.trainer.backends": "rolloutpipe.roles.trainer.backends",
    "rolloutpipe.trainer.checkpoint": "rolloutpipe.roles.trainer.checkpoint",
    "rolloutpipe.trainer.ds_backend": "rolloutpipe.roles.trainer.ds_backend",
    "rolloutpipe.trainer.fence": "rolloutpipe.roles.trainer.fence",
    "rolloutpipe.trainer.grpo": "rolloutpipe.rl.grpo",
    "rolloutpipe.trainer.loggers": "rolloutpipe.roles.trainer.loggers",
    "rolloutpipe.trainer.trainer": "rolloutpipe.roles.trainer.trainer",
    "rolloutpipe.trainer.weights": "rolloutpipe.model.weights",
    "rolloutpipe.trainer.weights_http": "rolloutpipe.roles.trainer.weights_http",
    "rolloutpipe.workers.aggregator": "rolloutpipe.roles.aggregator",
    "rolloutpipe.workers.controller": "rolloutpipe.roles.controller",
    "rolloutpipe.workers.data": "rolloutpipe.tasks.formats",
    "rolloutpipe.workers.engines": "rolloutpipe.engines",
    "rolloutpipe.workers.engines.base": "rolloutpipe.engines.base",
    "rolloutpipe.workers.engines.emulated": "rolloutpipe.engines.emulated",
    "rolloutpipe.workers.engines.hf": "rolloutpipe.engines.hf",
    "rolloutpipe.workers.engines.vllm_engine": "rolloutpipe.engines.vllm_engine",
    "rolloutpipe.workers.engines.vllm_ext": "rolloutpipe.engines.vllm_ext",
    "rolloutpipe.workers.policies": "rolloutpipe.scheduling",
    "rolloutpipe.workers.policies.base": "rolloutpipe.scheduling.base",
    "rolloutpipe.workers.policies.dynamic_sampling": "rolloutpipe.scheduling.dynamic_sampling",
    "rolloutpipe.workers.policies.fgd": "rolloutpipe.scheduling.fgd",
    "rolloutpipe.workers.policies.fifo": "rolloutpipe.scheduling.fifo",
    "rolloutpipe.workers.policies.migration": "rolloutpipe.scheduling.migration",
    "rolloutpipe.workers.policies.pilot_commit": "rolloutpipe.scheduling.pilot_commit",
    "rolloutpipe.workers.policies.pool": "rolloutpipe.scheduling.leases",
    "rolloutpipe.workers.policies.vigor": "rolloutpipe.scheduling.vigor",
    "rolloutpipe.workers.pool": "rolloutpipe.roles.pool",
    "rolloutpipe.workers.reward": "rolloutpipe.tasks.reward",
    "rolloutpipe.workers.rollout": "rolloutpipe.roles.rollout",
    "rolloutpipe.workers.task": "rolloutpipe.tasks.datasets",
    "rolloutpipe.workers.verifiers": "rolloutpipe.tasks.verifiers",
    "rolloutpipe.workers.weights_fetch": "rolloutpipe.model.fetch",
}


def current_path(dotted: str) -> str:
    """``dotted`` with a module moved in 0.2 replaced by its new name (warns once per call site)."""
    mod, sep, attr = dotted.partition(":")
    for old in sorted(MOVED, key=len, reverse=True):
        if mod == old or mod.startswith(old + "."):
            new = MOVED[old] + mod[len(old) :] + sep + attr
            warnings.warn(
                f"{dotted!r}: this module moved in rolloutpipe 0.2; write {new!r} (the old path "
                "is accepted until 0.3)",
                DeprecationWarning,
                stacklevel=3,
            )
            return new
    return dotted


def import_plugin_module(name: str) -> Any:
    """``importlib.import_module``, with the working directory importable as under ``python -m``: a
    user's ``my_project.reward`` resolves from where they run ``rolloutpipe`` (a console script
    does not put that directory on ``sys.path`` by itself)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    return importlib.import_module(current_path(name))


def import_string(dotted: str) -> Any:
    """``pkg.mod:attr`` or ``pkg.mod.attr`` -> the object (plug-ins are dotted import paths)."""
    dotted = current_path(dotted)
    mod, sep, attr = dotted.partition(":")
    if not sep:
        mod, _, attr = dotted.rpartition(".")
    try:
        return getattr(import_plugin_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"cannot import {dotted!r}: {e}") from e
