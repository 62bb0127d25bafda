"""Helpers for tests that drive real role processes."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC, iter_events
from rolloutpipe.broker.events import Group, PolicyVersion, StepMetrics
from rolloutpipe.broker.keys import Keys
from rolloutpipe.launch.cluster import Cluster
from rolloutpipe.launch.follow import ControlFollower


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
    return [m for _run, m in ControlFollower(r, [run]).drain()]  # a corrupt entry raises CodecError


def load_weights(out: Path, v: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(out / "weights" / f"v{v:06d}" / "model.safetensors"))


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def audit_group_log(
    out: Path, steps: int, groups_per_step: int, group_size: int
) -> tuple[list[Group], dict[str, int]]:
    """Exactly-once and on-policy, from the trainer's committed-group log (``OUT/groups.msgpack``).

    Every planned group (``step:index`` for ``steps`` steps of ``groups_per_step``) trained once,
    none twice, none unplanned, no sample twice; each group whole (``group_size`` samples), of its
    step's own version, and the log in commit order.  Returns the groups and the counts.
    """
    trained = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
    planned = {(s, f"{s}:{g}") for s in range(steps) for g in range(groups_per_step)}
    counts = Counter((g.step, g.group_id) for g in trained)
    samples = Counter(s.sample_id for g in trained for s in g.samples)
    result = {
        "groups_planned": len(planned),
        "groups_trained": len(trained),
        "groups_duplicated": sum(n - 1 for n in counts.values()),
        "groups_lost": len(planned - set(counts)),
        "groups_unexpected": len(set(counts) - planned),
        "samples_duplicated": sum(n - 1 for n in samples.values()),
    }
    assert result["groups_duplicated"] == 0, [k for k, n in counts.items() if n > 1]
    assert result["groups_lost"] == 0, sorted(planned - set(counts))[:20]
    assert result["groups_unexpected"] == 0
    assert result["samples_duplicated"] == 0
    for g in trained:  # whole groups, each sample once, all of the step's own version
        assert sorted(s.sample_index for s in g.samples) == list(range(group_size)), g.group_id
        assert g.policy_version == g.step and all(s.policy_version == s.step == g.step for s in g.samples)
    # the log is in commit order: step by step, each step's groups together
    assert [g.step for g in trained] == sorted(g.step for g in trained)
    return trained, result
