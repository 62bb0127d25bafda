"""Chaos: every role SIGKILLed at random moments and restarted; the run still trains every planned
group exactly once, on-policy, and finishes every step.

A real multi-process ``cgp-fgd`` run on the emulated engine and trainer.  A seeded RNG (printed;
``RP_CHAOS_SEED`` replays one) picks when to kill and which role: each of controller, aggregator,
rollout worker and trainer at least once, plus extra kills of random roles.  A killed role is
respawned at once (a rollout worker under its old id).  The audit reads the trainer's
consumed-group log (``OUT/groups.msgpack``, written at each step commit) and the streams.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis

from rolloutpipe.broker.keys import Keys
from tests.support.cluster import (
    ROLES,
    Driver,
    groups_on_stream,
    passed,
    reached,
    respawn,
    start_cluster,
    stop_cluster,
)
from tests.support.config import EMULATED_FAST, make_config
from tests.support.helpers import audit_group_log, version

pytestmark = pytest.mark.slow

STEPS = 12
EXTRA_KILLS = 8
OVERRIDES = (
    *EMULATED_FAST,
    "controller.mode=cgp-fgd",
    f"controller.steps={STEPS}",
    "rollout.emulated.time_scale=0.05",  # a step lasts ~0.5-1 s: kills land mid-step
    "trainer.record_groups=true",
)


def audit(sr: redis.Redis, d: Driver) -> dict[str, int]:
    """Counts from the trainer's log and the streams; asserts exactly-once and on-policy."""
    cfg = d.cluster.cfg
    B, G = cfg.controller.prompts_per_step, cfg.controller.group_size
    out, keys = Path(cfg.out), Keys(cfg.run)
    trained, result = audit_group_log(out, STEPS, B, G)
    print("chaos audit:", json.dumps(result))
    planned = {(s, f"{s}:{g}") for s in range(STEPS) for g in range(B)}

    # every step finished once, its metrics once on control and once in metrics.jsonl, and its
    # mini-batches are exactly the groups the log holds for it
    assert version(sr, cfg.run) == STEPS
    assert [m.step for m in d.metrics] == list(range(STEPS)), [m.step for m in d.metrics]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for m, row in zip(d.metrics, rows, strict=True):
        assert row["minibatches"] == m.minibatches
        assert sorted(gid for mb in m.minibatches for gid in mb) == sorted(
            g.group_id for g in trained if g.step == m.step
        )
        assert (m.groups, m.samples) == (B, B * G)
    # The streams and per-step keys (the controller trims acknowledged entries and the keys of all
    # but the last redis.keep_steps steps, so only what is left is checked): no group emitted twice,
    # every group acknowledged by the trainer, every request released once (even by a controller
    # killed mid-release), nothing stale or dead-lettered.
    on_stream = Counter((g.step, g.group_id) for g in groups_on_stream(sr, cfg.run))
    assert set(on_stream) <= planned and max(on_stream.values(), default=1) == 1
    assert int(sr.xpending(keys.groups, "trainer")["pending"]) == 0
    kept = [s for s in range(STEPS) if sr.exists(keys.plan(s))]
    assert kept[-2:] == [STEPS - 2, STEPS - 1], kept
    for s in kept:
        assert int(sr.scard(keys.emitted(s))) == B
        members: Any = sr.smembers(keys.consumed(s))
        assert {m.decode() for m in members} == {f"{s}:{g}" for g in range(B)}
        assert int(sr.get(keys.released(s)) or 0) == B * G
    assert int(sr.hget(keys.stats, "fence_rejections") or 0) == 0
    assert int(sr.hget(keys.stats, "duplicate_groups") or 0) == 0
    assert sr.xlen(keys.dlq) == 0
    result["steps_with_keys_checked"] = len(kept)
    return result


@pytest.mark.parametrize("shards", [1, 2], ids=["one-aggregator", "two-aggregator-shards"])
def test_sigkill_every_role_at_random_moments(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis, shards: int
) -> None:
    """With ``redis.sample_shards=2`` two aggregators split the samples by group id; a killed one is
    respawned on its shard and rebuilds that shard's partial groups, and exactly-once still holds."""
    seed = int(os.environ.get("RP_CHAOS_SEED") or random.randrange(2**31))
    print(f"chaos seed {seed} (replay: RP_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    cfg = make_config(tmp_path, run_name, *OVERRIDES, f"redis.sample_shards={shards}")
    schedule = [*rng.sample(ROLES, len(ROLES)), *(rng.choice(ROLES) for _ in range(EXTRA_KILLS))]
    schedule += ["aggregator"] * (shards - 1)  # room to kill every shard's aggregator
    # kill i lands in step targets[i] (spread over the run, never after the last step), at a random
    # moment inside it
    targets = sorted(rng.randrange(0, STEPS - 1) for _ in schedule)
    kills: Counter[str] = Counter()
    shard_kills: Counter[str] = Counter({f"s{i}": 0 for i in range(shards)})
    t0 = time.monotonic()
    cluster = start_cluster(cfg, redis_url)
    try:
        d = Driver(cluster, sr)
        for n, (role, target) in enumerate(zip(schedule, targets, strict=True)):
            d.until(partial(reached, sr, run_name, target), 60, f"version {target}")
            pause = time.monotonic() + rng.uniform(0.0, 0.8)
            d.until(partial(passed, pause), 5, "a random moment")
            if version(sr, run_name) >= STEPS:
                break
            alive = [rp for rp in cluster.procs if rp.name.split("-")[0] == role and rp.proc.poll() is None]
            victim = rng.choice(alive)
            if role == "aggregator" and shards > 1:  # the shard killed least so far
                victim = min(alive, key=lambda rp: (shard_kills[rp.name.split("-")[1]], rp.name))
                shard_kills[victim.name.split("-")[1]] += 1
            at = version(sr, run_name)
            d.kill(victim)
            kills[role] += 1
            dt = time.monotonic() - t0
            print(f"kill {n}: {victim.name} (pid {victim.proc.pid}) in step {at}, t={dt:.1f}s")
            respawn(d, victim, n)
        d.until(lambda: version(sr, run_name) >= STEPS and len(d.metrics) >= STEPS, 90, f"{STEPS} steps")
        time.sleep(0.3)  # room for a (wrong) extra group or metrics event to show up
        d.pump()
        counts = audit(sr, d)
        # Every respawned trainer that got as far as training resumed from a checkpoint (one killed
        # again while still starting up may have logged nothing yet); the last one always did.
        respawned = [rp for rp in cluster.procs if rp.name.startswith("trainer-r")]
        for rp in respawned:
            log = rp.log_path.read_text()
            if rp.proc.returncode != -signal.SIGKILL or "step " in log:
                assert "resumed from checkpoint" in log, rp.name
        if respawned:
            assert respawned[-1].proc.returncode != -signal.SIGKILL
    finally:
        stop_cluster(cluster, sr)
    print(f"chaos kills per role: {dict(kills)}; {json.dumps(counts)}; {time.monotonic() - t0:.1f}s")
    assert set(kills) == set(ROLES), f"not every role was killed: {dict(kills)}"
    if shards > 1:  # every shard's aggregator was killed, and each shard's stream is fully acknowledged
        assert min(shard_kills.values()) >= 1, dict(shard_kills)
        keys = Keys(run_name)
        for stream in keys.sample_streams(shards):
            assert int(sr.xpending(stream, "aggregator")["pending"]) == 0, stream
            info: Any = sr.xinfo_groups(stream)
            assert info and info[0]["entries-read"] > 0, stream
