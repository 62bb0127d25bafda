"""The tests' configs and suite switches: the repo root, ``make_config``, ``EMULATED_FAST``.

Also the rules the conftests share: ``engine_suite`` (which engine folders are collected) and ``ci``
(is this a CI run, where a skip is a failure).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from rolloutpipe.bench.harness import EMULATED_FAST as EMULATED_FAST  # the tests import it from here
from rolloutpipe.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent.parent


def engine_suite(module: str) -> list[str]:
    """``collect_ignore_glob`` for an engine's test folder (``tests/deepspeed``, ``tests/vllm``).

    Its script (``scripts/test-deepspeed.sh``, ``scripts/test-vllm.sh``) runs it in the engine's
    own venv with ``RP_SUITE=<module>``: there an engine that cannot be imported stops the run with
    an error, instead of skipping every test.  Elsewhere (the core suite in ``.venv``) the folder is
    not collected unless the engine happens to be installed.
    """
    if os.environ.get("RP_SUITE") == module:
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or an engine that fails while importing
            raise pytest.UsageError(
                f"RP_SUITE={module}: {module} cannot be imported by {sys.executable}: {type(e).__name__}: {e}"
            ) from e
        return []
    return [] if importlib.util.find_spec(module) is not None else ["test_*.py"]


def ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def make_config(tmp_path: Path, run: str, *overrides: str, base: str = "configs/demo.yaml") -> Config:
    return load_config(ROOT / base, [f"run={run}", f"out={tmp_path / run}", *overrides], environ={})
