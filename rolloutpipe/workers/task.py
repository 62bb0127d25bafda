"""Shipped verifiable tasks.  A dataset is a dotted path to ``f(num_prompts, seed) -> list[Prompt]``."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolloutpipe.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str


def mod10_addition(num_prompts: int, seed: int) -> list[Prompt]:
    """``a+b=`` with single digits; the answer is ``(a+b) mod 10``.  100 distinct prompts."""
    rng = random.Random(seed)
    base = [Prompt(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    return [base[rng.randrange(len(base))] for _ in range(num_prompts)]


def successor(num_prompts: int, seed: int) -> list[Prompt]:
    """``a+1=`` -> ``(a+1) mod 10``: the easiest task, learnt in seconds."""
    rng = random.Random(seed)
    return [Prompt(f"{a}+1=", str((a + 1) % 10)) for a in (rng.randrange(10) for _ in range(num_prompts))]


def import_string(dotted: str) -> Any:
    """``pkg.mod:attr`` or ``pkg.mod.attr`` -> the object (plug-ins are dotted import paths)."""
    mod, sep, attr = dotted.partition(":")
    if not sep:
        mod, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"cannot import {dotted!r}: {e}") from e


def load_dataset(dotted: str, num_prompts: int, seed: int) -> list[Prompt]:
    fn: Callable[[int, int], list[Prompt]] = import_string(dotted)
    prompts = fn(num_prompts, seed)
    if not prompts:
        raise ConfigError(f"dataset {dotted!r} returned no prompts")
    return prompts
