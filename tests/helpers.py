"""Helpers for tests that drive real role processes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import PolicyVersion, StepMetrics
from rolloutpipe.broker.streams import Keys
from rolloutpipe.runner import Cluster


def version(r: redis.Redis, run: str) -> int:
    raw: Any = r.get(Keys(run).version)
    return -1 if raw is None else DEFAULT_CODEC.decode_as(raw, PolicyVersion).policy_version


def wait_version(
    r: redis.Redis, run: str, v: int, cluster: Cluster | None = None, timeout: float = 120
) -> None:
    deadline = time.monotonic() + timeout
    while version(r, run) < v:
        if cluster is not None and (bad := cluster.failed()) is not None:
            raise AssertionError(f"{bad.name} died: {bad.log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {v} of {run} not published in {timeout}s")
        time.sleep(0.02)


def step_metrics(r: redis.Redis, run: str) -> list[StepMetrics]:
    out = []
    for _id, fields in r.xrange(Keys(run).control):
        try:
            ev = DEFAULT_CODEC.decode(fields[b"d"])
        except Exception:
            continue
        if isinstance(ev, StepMetrics):
            out.append(ev)
    return out


def load_weights(out: Path, v: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(out / "weights" / f"v{v:06d}" / "model.safetensors"))


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
