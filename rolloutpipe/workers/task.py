"""Shipped verifiable tasks.  A dataset is a dotted path to ``f(num_prompts, seed) -> list[Prompt]``.

A dataset that reads a file takes a third argument, ``path`` (``task.path`` in the config).
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


def jsonl(num_prompts: int, seed: int, path: str = "") -> list[Prompt]:
    """Prompts from a JSON-lines file with ``prompt`` and ``answer`` fields (GSM8K's ``question``
    and ``#### answer`` are understood too), shuffled with ``seed`` and cycled to ``num_prompts``."""
    if not path:
        raise ConfigError("the jsonl dataset needs task.path (a .jsonl file)")
    rows: list[Prompt] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read task.path {path!r}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            prompt = d["prompt"] if "prompt" in d else d["question"]
            answer = str(d["answer"]).rsplit("####", 1)[-1].strip()
        except (ValueError, KeyError, TypeError) as e:
            msg = f"{path}:{n}: expected an object with prompt (or question) and answer: {e}"
            raise ConfigError(msg) from e
        rows.append(Prompt(str(prompt), answer))
    if not rows:
        raise ConfigError(f"{path} holds no prompts")
    random.Random(seed).shuffle(rows)
    return [rows[i % len(rows)] for i in range(num_prompts)]


def import_string(dotted: str) -> Any:
    """``pkg.mod:attr`` or ``pkg.mod.attr`` -> the object (plug-ins are dotted import paths)."""
    mod, sep, attr = dotted.partition(":")
    if not sep:
        mod, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"cannot import {dotted!r}: {e}") from e


def load_dataset(dotted: str, num_prompts: int, seed: int, path: str = "") -> list[Prompt]:
    fn: Callable[..., list[Prompt]] = import_string(dotted)
    prompts = fn(num_prompts, seed, path=path) if path else fn(num_prompts, seed)
    if not prompts:
        raise ConfigError(f"dataset {dotted!r} returned no prompts")
    return prompts
