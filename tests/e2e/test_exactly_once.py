"""Exactly-once acceptance tests, with every role a real OS process against a real redis-server.

a) duplicate Sample events never duplicate a sample inside a group, nor a group;
b) SIGKILL of the aggregator mid-step, then a fresh aggregator: no sample lost, no group twice;
c) SIGKILL of one of two rollout workers mid-step: the survivor reclaims its pending requests.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import (
    GroupPlan,
    PolicyVersion,
    RolloutRequest,
    Sample,
    StepPlan,
)
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.launch.cluster import Cluster
from tests.support.cluster import (
    Driver,
    assert_exactly_once,
    groups_on_stream,
    pending_count,
    start_cluster,
    step_groups_emitted,
    stop_cluster,
)
from tests.support.config import EMULATED_FAST, make_config

# Slower emulated decoding than EMULATED_FAST so one step lasts ~1-2 s: long enough to kill a
# role while the step is really in flight.
# The checks read whole streams after the run, so trimming (a controller job) is off here.
STEP_OVERRIDES = (*EMULATED_FAST, "controller.steps=4", "rollout.emulated.time_scale=0.1", "redis.trim=false")


# ------------------------------------------------------------------------- a) duplicate sample events


def _sample(run: str, gid: str, s: int, worker: str = "test") -> Sample:
    now = time.time()
    return Sample(
        run=run, step=0, policy_version=0, sample_id=f"{gid}:{s}", request_id=f"{gid}:{s}", group_id=gid,
        prompt_index=int(gid.split(":")[1]), sample_index=s, worker=worker,
        prompt_ids=np.zeros(2, np.int32), response_ids=np.arange(3 + s, dtype=np.int32),
        logprobs=np.full(3 + s, -0.5, np.float32), reward=float(s % 2), admitted_at=now, finished_at=now,
    )  # fmt: skip


def test_duplicate_samples_never_duplicate_a_sample_or_a_group(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Catches: a re-sent sample filling two slots of a group (or completing it early with a repeat),
    a group emitted twice when its samples are replayed after emission, duplicates left pending
    (never acknowledged) or not counted."""
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST)
    out = Path(cfg.out)
    cfg.dump_yaml(out / "config.yaml")
    keys = Keys(run_name)
    G = cfg.controller.group_size
    plan = StepPlan(run=run_name, step=0, policy_version=0, policy="fifo",
                    groups=[GroupPlan(group_id=f"0:{g}", prompt_index=g, n=G) for g in range(3)],
                    minibatches=1, groups_per_minibatch=3, created_at=time.time())  # fmt: skip
    pv = PolicyVersion(run=run_name, step=0, policy_version=0, path="", sha256={}, published_at=time.time())
    sr.set(keys.plan(0), DEFAULT_CODEC.encode(plan))
    sr.set(keys.version, DEFAULT_CODEC.encode(pv))

    def send(gid: str, *idx: int, worker: str = "test") -> None:
        for s in idx:
            sr.xadd(keys.samples, {DATA: DEFAULT_CODEC.encode(_sample(run_name, gid, s, worker))})

    cluster = Cluster(cfg, redis_url, out)
    try:
        agg = cluster.spawn("aggregator", "aggregator")
        d = Driver(cluster, sr)
        # 0:0 -- sample 0 twice before the group is complete (second copy from another "worker")
        send("0:0", 0)
        send("0:0", 0, worker="replayer")
        send("0:0", 1, 2, 3)
        # 0:1 -- out of order, sample 1 twice; 0:2 -- three of four samples only
        send("0:1", 3, 1)
        send("0:1", 1, worker="replayer")
        send("0:1", 0, 2)
        send("0:2", 0, 1, 2)
        d.until(lambda: sr.xlen(keys.groups) >= 2, 30, "groups 0:0 and 0:1")
        # re-sent after their group was emitted: two samples of 0:0 and the whole of 0:1
        send("0:0", 0, 3, worker="replayer")
        send("0:1", 0, 1, 2, 3, worker="replayer")
        # 0:2 completes, and its last sample arrives twice back to back
        send("0:2", 3)
        send("0:2", 3, worker="replayer")
        n_dup = 2 + 2 + 4 + 1
        d.until(
            lambda: (
                int(sr.hget(keys.stats, "duplicate_samples") or 0) >= n_dup
                and pending_count(sr, keys.samples, "aggregator") == 0
            ),
            15,
            f"{n_dup} duplicates counted and every sample acknowledged",
        )
        time.sleep(0.3)  # room for a (wrong) extra group to show up
        d.check_alive()
        assert agg.proc.poll() is None

        groups = groups_on_stream(sr, run_name)
        assert Counter(g.group_id for g in groups) == {"0:0": 1, "0:1": 1, "0:2": 1}
        for g in groups:
            assert len(g.samples) == G
            assert sorted(s.sample_index for s in g.samples) == list(range(G))
            assert len({s.sample_id for s in g.samples}) == G
            assert all(s.worker == "test" for s in g.samples), "a re-sent copy replaced the first one"
            assert len(g.advantages) == G
            assert (g.allocation.initial, g.allocation.counts, g.allocation.status) == (G, [G], "final")
        assert sorted(g.frontier.position for g in groups) == [0, 1, 2]
        assert int(sr.hget(keys.stats, "duplicate_samples") or 0) == n_dup
        assert int(sr.hget(keys.stats, "duplicate_samples:0") or 0) == n_dup
        assert int(sr.hget(keys.stats, "duplicate_groups") or 0) == 0
        assert sr.scard(keys.emitted(0)) == 3
        assert sr.xlen(keys.dlq) == 0
    finally:
        stop_cluster(cluster, sr)


# --------------------------------------------------------------------- b) SIGKILL of the aggregator


def test_aggregator_sigkill_mid_step_loses_nothing_duplicates_nothing(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Catches: samples held in the dead aggregator's partial groups being lost (a step that never
    completes, or a group short of samples), and a group emitted by both aggregators."""
    cfg = make_config(tmp_path, run_name, *STEP_OVERRIDES)
    keys = Keys(run_name)
    B = cfg.controller.prompts_per_step
    cluster = start_cluster(cfg, redis_url)
    try:
        d = Driver(cluster, sr)
        agg = next(rp for rp in cluster.procs if rp.name == "aggregator")
        # mid-step 1: some of its groups out, others partial (their samples pending on the aggregator)
        d.until(
            lambda: (
                1 <= step_groups_emitted(sr, run_name, 1) < B - 1
                and pending_count(sr, keys.samples, "aggregator") > 0
            ),
            60,
            "step 1 partly aggregated",
        )
        d.kill(agg)
        stranded = pending_count(sr, keys.samples, "aggregator")
        emitted_at_kill = step_groups_emitted(sr, run_name, 1)
        assert stranded > 0 and emitted_at_kill < B
        time.sleep(0.5)  # samples keep arriving with no aggregator
        assert step_groups_emitted(sr, run_name, 1) == emitted_at_kill  # it really is dead
        cluster.spawn("aggregator", "aggregator-2")
        d.finish(60)
        assert_exactly_once(sr, cfg, d.metrics)
        assert pending_count(sr, keys.samples, "aggregator") == 0
        assert "recovering" in (Path(cfg.out) / "logs" / "aggregator-2.log").read_text()
    finally:
        stop_cluster(cluster, sr)


# ------------------------------------------------------------------ c) SIGKILL of one rollout worker


def test_rollout_worker_sigkill_mid_step_requests_reclaimed(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Catches: a dead worker's pending requests never taken over (the step hangs), a reclaimed
    request redone twice or its sample lost, and a step finishing without the reclaimed samples.
    (A live worker's requests stolen would also show as duplicate_samples > 0, but only for requests
    lasting longer than claim_idle_s, which are rare at these lengths.)"""
    cfg = make_config(tmp_path, run_name, *STEP_OVERRIDES)
    keys = Keys(run_name)
    victim, survivor = f"{run_name}-w0", f"{run_name}-w1"
    cluster = start_cluster(cfg, redis_url)
    try:
        d = Driver(cluster, sr)
        proc = next(rp for rp in cluster.procs if rp.name == "rollout-0")

        def victim_busy_in_step_1() -> bool:
            if not sr.exists(keys.plan(1)):
                return False
            for p in sr.xpending_range(keys.requests, "rollout", min="-", max="+", count=100,
                                       consumername=victim):  # fmt: skip
                ((_eid, f),) = sr.xrange(keys.requests, p["message_id"], p["message_id"])
                if DEFAULT_CODEC.decode_as(f[DATA], RolloutRequest).step == 1:
                    return True
            return False

        d.until(victim_busy_in_step_1, 60, f"{victim} holding step-1 requests")
        d.kill(proc)
        stranded = sr.xpending_range(keys.requests, "rollout", min="-", max="+", count=10_000,
                                     consumername=victim)  # fmt: skip
        assert stranded, "the killed worker had nothing in flight"
        stranded_ids = set()
        for p in stranded:
            ((_eid, f),) = sr.xrange(keys.requests, p["message_id"], p["message_id"])
            stranded_ids.add(DEFAULT_CODEC.decode_as(f[DATA], RolloutRequest).request_id)

        d.finish(60)
        groups = assert_exactly_once(sr, cfg, d.metrics)
        reclaimed = int(sr.hget(keys.stats, "reclaimed_requests") or 0)
        assert reclaimed >= len(stranded), (reclaimed, len(stranded))
        assert pending_count(sr, keys.requests, "rollout", victim) == 0
        assert pending_count(sr, keys.requests, "rollout") == 0
        # every stranded request was redone by the survivor, and appears once
        by_id = Counter(s.sample_id for g in groups for s in g.samples)
        workers = {s.sample_id: s.worker for g in groups for s in g.samples}
        for rid in stranded_ids:
            assert by_id[rid] == 1
            assert workers[rid] == survivor, (rid, workers[rid])
        # steps after the kill ran on the survivor alone
        assert {s.worker for g in groups if g.step >= 2 for s in g.samples} == {survivor}
    finally:
        stop_cluster(cluster, sr)
