"""Long-tail migration: the pure rule, the emulated engine's preemption, ``Broker.migrate`` on a real
Redis, and whole runs of real processes in which requests move between workers, one of them
SIGKILLed mid-migration (the source before or after it hands back, or the target).

The independent reference for a migrated sample is the emulated engine's own definition of the
trajectory (its tokens and logprobs are functions of the request id), computed in this process
from the request as the controller released it, never through a worker.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import RolloutRequest, Sample
from rolloutpipe.broker.keys import DATA, Groups, Keys
from rolloutpipe.broker.streams import Broker
from rolloutpipe.config import Config, EmulatedEngineConfig, MigrationConfig
from rolloutpipe.engines.emulated import EmulatedEngine
from rolloutpipe.launch.cluster import Cluster
from rolloutpipe.scheduling.migration import Load, Running, choose
from tests.support.cluster import Driver, assert_exactly_once, pending_count, start_cluster, stop_cluster
from tests.support.config import EMULATED_FAST, ROOT, make_config

ON = MigrationConfig(enabled=True, idle_share=0.5, min_run_s=0.0, max_segments=4)


def _run(*ids_s: tuple[str, float], segment: int = 0) -> list[Running]:
    return [Running(rid, s, segment) for rid, s in ids_s]


# ------------------------------------------------------------------------------------ the pure rule


def test_rule_levels_the_tail_onto_idle_workers_longest_running_first() -> None:
    me = Load("a", 16, 6)
    others = [Load("b", 16, 0), Load("c", 16, 1)]
    running = _run(("r1", 1.0), ("r2", 5.0), ("r3", 3.0), ("r4", 0.5), ("r5", 4.0), ("r6", 2.0))
    # 6 vs 0 and 1: move to b (0->1), b (1->2)? no: to the least loaded each time; stop at gap < 2
    out = choose(me, others, running, ON)
    assert out == ["r2", "r5", "r3"]  # 6,0,1 -> 5,1,1 -> 4,2,1 -> 3,2,2: gap 1, stop


def test_rule_moves_nothing_when_the_pool_is_busy_or_level_or_off() -> None:
    running = _run(("r1", 1.0), ("r2", 2.0), ("r3", 3.0), ("r4", 4.0))
    # most of the pool busy: 4 + 7 of 16 slots taken, 31% free < 50%
    assert choose(Load("a", 8, 4), [Load("b", 8, 7)], running, ON) == []
    # level: 4 vs 3
    assert choose(Load("a", 16, 4), [Load("b", 16, 3)], running, ON) == []
    # off, or alone in the pool
    assert choose(Load("a", 16, 4), [Load("b", 16, 0)], running, MigrationConfig()) == []
    assert choose(Load("a", 16, 4), [], running, ON) == []
    # a target with no free slot takes nothing
    assert choose(Load("a", 16, 4), [Load("b", 1, 1)], running, ON) == []
    assert choose(Load("a", 16, 4), [Load("b", 1, 1), Load("c", 30, 0)], running, ON) == ["r4", "r3"]


def test_rule_respects_min_run_and_max_segments() -> None:
    others = [Load("b", 16, 0)]
    young = _run(("r1", 0.01), ("r2", 0.02), ("r3", 0.03))
    cfg = MigrationConfig(enabled=True, min_run_s=0.05)
    assert choose(Load("a", 16, 3), others, young, cfg) == []
    moved_often = _run(("r1", 9.0), ("r2", 9.0), ("r3", 9.0), segment=3)
    assert choose(Load("a", 16, 3), others, moved_often, MigrationConfig(enabled=True, max_segments=4)) == []
    assert choose(Load("a", 16, 3), others, moved_often, MigrationConfig(enabled=True, max_segments=5)) == [
        "r1"
    ]


# -------------------------------------------------------------------------- the emulated engine


def _req(rid: str = "0:0:0", **kw: object) -> RolloutRequest:
    base: dict[str, object] = dict(
        run="t", step=0, policy_version=0, request_id=rid, group_id="0:0", prompt_index=0, sample_index=0,
        prompt="p", answer="1", seed=7, max_new_tokens=10_000, released_at=0.0,
    )  # fmt: skip
    base.update(kw)
    return RolloutRequest.model_validate(base)


EMU = EmulatedEngineConfig(
    max_num_seqs=8, length_median=400, length_sigma=0.1, max_response_tokens=2000, time_scale=0.002
)


async def test_emulated_preempt_and_resume_on_another_engine_is_the_same_trajectory() -> None:
    whole = EmulatedEngine(EMU, seed=3)
    full = await whole.generate(_req())
    await whole.close()
    src, dst = EmulatedEngine(EMU, seed=3), EmulatedEngine(EMU, seed=3)
    try:
        task = asyncio.create_task(src.generate(_req()))
        await asyncio.sleep(0.3 * len(full.response_ids) * EMU.decode_base_s * EMU.time_scale)
        assert src.preempt("0:0:0") and not src.preempt("nope")
        part = await task
        n = len(part.response_ids)
        assert part.finish_reason == "preempted" and 0 < n < len(full.response_ids), n
        cont = _req(prefix_ids=part.response_ids, prefix_logprobs=part.logprobs, segment=1, origin="1-0")
        resumed = await dst.generate(cont)
    finally:
        await src.close()
        await dst.close()
    np.testing.assert_array_equal(resumed.response_ids, full.response_ids)
    np.testing.assert_array_equal(resumed.logprobs, full.logprobs)
    assert resumed.finish_reason == full.finish_reason != "preempted"


def test_a_continuation_has_a_logprob_per_prefix_token_and_names_its_origin() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        _req(prefix_ids=np.arange(3), prefix_logprobs=np.zeros(2), segment=1, origin="1-0")
    with pytest.raises(ValueError, match="origin"):
        _req(prefix_ids=np.arange(3), prefix_logprobs=np.zeros(3), segment=1)
    with pytest.raises(ValueError, match="origin"):
        _req(origin="1-0")


# ----------------------------------------------------------------------------- Broker.migrate


async def test_migrate_acks_puts_back_once_and_never_after_the_request_finished(broker: Broker) -> None:
    k = broker.keys
    await broker.ensure_group(k.requests, Groups.ROLLOUT)
    req = _req(run=broker.run)
    eid = await broker.publish(k.requests, req)
    got = await broker.read(k.requests, Groups.ROLLOUT, "w0", count=10, block_ms=1)
    assert [e.id for e in got] == [eid]
    prefix = np.arange(5, dtype=np.int32)
    cont = req.model_copy(
        update=dict(prefix_ids=prefix, prefix_logprobs=np.full(5, -0.5, np.float32), segment=1, origin=eid)
    )
    new = await broker.migrate(eid, cont)
    assert new and new != eid
    assert await broker.r.xpending(k.requests, Groups.ROLLOUT) == {
        "pending": 0, "min": None, "max": None, "consumers": []
    }  # fmt: skip
    assert await broker.stat("migrations") == 1 and await broker.stat("migrated_tokens", 0) == 5
    # a second hand-back of the same segment (a worker that reclaimed it) adds nothing
    assert await broker.migrate(eid, cont) == ""
    assert await broker.r.xlen(k.requests) == 2 and await broker.stat("migrations") == 1
    # the continuation, read by another worker, resumes with the prefix
    (e2,) = await broker.read(k.requests, Groups.ROLLOUT, "w1", count=10, block_ms=1)
    back = DEFAULT_CODEC.decode_as(e2.data, RolloutRequest)
    assert e2.id == new and back.segment == 1 and back.origin == eid
    np.testing.assert_array_equal(back.prefix_ids, prefix)
    # the request finishes under its origin: a late copy of segment 0 publishes nothing more ...
    sample = _sample(broker.run, back)
    await broker.publish_sample(sample, e2.id, origin=eid)
    await broker.publish_sample(sample, eid)  # segment 0 redone by a worker that reclaimed it
    assert await broker.r.xlen(k.samples) == 1 and int(await broker.r.get(k.finished(0))) == 1
    # ... and nothing can be migrated any more
    cont2 = back.model_copy(update=dict(segment=2))
    assert await broker.migrate(e2.id, cont2) == ""
    assert await broker.stat("migrations") == 1


def _sample(run: str, req: RolloutRequest) -> Sample:
    ids = np.concatenate([req.prefix_ids, np.array([9, 9], np.int32)])
    return Sample(
        run=run, step=req.step, policy_version=req.policy_version, sample_id=req.request_id,
        request_id=req.request_id, group_id=req.group_id, prompt_index=req.prompt_index,
        sample_index=req.sample_index, worker="w1", prompt_ids=np.zeros(2, np.int32), response_ids=ids,
        logprobs=np.zeros(len(ids), np.float32), reward=0.0, admitted_at=0.0, finished_at=0.0,
        segments=req.segment + 1,
    )  # fmt: skip


async def test_migrate_resent_after_a_lost_reply_applies_once(broker: Broker) -> None:
    from rolloutpipe.broker.once import MIGRATE_LUA

    k = broker.keys
    await broker.ensure_group(k.requests, Groups.ROLLOUT)
    req = _req(run=broker.run)
    eid = await broker.publish(k.requests, req)
    await broker.read(k.requests, Groups.ROLLOUT, "w0", count=10, block_ms=1)
    cont = req.model_copy(
        update=dict(prefix_ids=np.arange(2), prefix_logprobs=np.zeros(2), segment=1, origin=eid)
    )
    keys = [k.ops(0), k.requests, k.migrated(0), k.finished_ids(0), k.stats]
    args = ["tok", Groups.ROLLOUT, eid, eid, broker.encode(cont), 0, 2, 1000]
    first = await broker.r.eval(MIGRATE_LUA, len(keys), *keys, *args)
    again = await broker.r.eval(MIGRATE_LUA, len(keys), *keys, *args)
    assert first == again and first != b"0"
    assert await broker.r.xlen(k.requests) == 2 and await broker.stat("migrations") == 1


# ------------------------------------------------------------------ whole runs with real processes

# Three workers, a long tail (sigma 1.2) and slots enough for a step: toward the end of each step
# most of the pool is idle and one worker still decodes several requests.
OVERRIDES = (
    *EMULATED_FAST,
    "rollout.workers=3",
    "rollout.emulated.length_sigma=1.2",
    "rollout.emulated.length_prompt_share=0",
    "rollout.emulated.time_scale=0.02",
    "rollout.migration.enabled=true",
    "rollout.migration.check_s=0.05",
    "rollout.migration.min_run_s=0.05",
    "rollout.claim_idle_s=1.5",
    "controller.steps=3",
    "controller.mode=cgp",
    "redis.trim=false",
)


def _requests(sr: redis.Redis, run: str) -> dict[str, RolloutRequest]:
    """Each request as the controller released it (segment 0), by request id."""
    out = {}
    for _eid, f in sr.xrange(Keys(run).requests):
        r = DEFAULT_CODEC.decode_as(f[DATA], RolloutRequest)
        if r.segment == 0:
            out[r.request_id] = r
    return out


def _check_trajectories(sr: redis.Redis, run: str, cfg_emu: EmulatedEngineConfig, seed: int) -> int:
    """Every trained sample is its request's one trajectory (the reference: the emulated engine's
    definition, from the released request); returns how many were migrated."""
    from tests.support.cluster import groups_on_stream

    ref_engine = EmulatedEngine(cfg_emu, seed=seed)
    reqs = _requests(sr, run)
    migrated = 0
    for g in groups_on_stream(sr, run):
        for s in g.samples:
            req = reqs[s.request_id]
            length = ref_engine.response_length(req)
            ref = ref_engine._generation(req, length, True)
            np.testing.assert_array_equal(s.response_ids, ref.response_ids, err_msg=s.request_id)
            np.testing.assert_array_equal(s.logprobs, ref.logprobs, err_msg=s.request_id)
            assert s.policy_version == s.step == req.policy_version
            migrated += s.segments > 1
    return migrated


def _cluster(tmp_path: Path, run: str, url: str, *extra: str, fault: str = "") -> tuple[Config, Cluster]:
    cfg = make_config(tmp_path, run, *OVERRIDES, *extra)
    if not fault:
        return cfg, start_cluster(cfg, url)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(cfg, url, out)
    cfg.dump_yaml(out / "config.yaml")
    launcher = [str(ROOT / "tests" / "support" / "migration_faults.py"), fault, str(tmp_path / "fired")]
    cluster.spawn("trainer", "trainer", ["--out", str(out)])
    cluster.spawn("aggregator", "aggregator")
    for i in range(cfg.rollout.workers):
        cluster.spawn("rollout", f"rollout-{i}", ["--worker-id", f"{run}-w{i}"], launcher=launcher)
    cluster.spawn("controller", "controller")
    return cfg, cluster


@pytest.mark.slow
def test_a_run_with_migration_trains_every_group_once_on_whole_trajectories(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Catches: a continuation that drops or repeats its prefix, a request finished twice (once per
    segment), a migrated sample lost, a continuation left pending, a version changed on the way."""
    cfg, cluster = _cluster(tmp_path, run_name, redis_url)
    try:
        d = Driver(cluster, sr)
        d.finish(120)
        assert_exactly_once(sr, cfg, d.metrics)
        keys = Keys(run_name)
        moves = int(sr.hget(keys.stats, "migrations") or 0)
        migrated = _check_trajectories(sr, run_name, cfg.rollout.emulated, cfg.rollout.seed)
        print(f"migrations={moves} migrated samples={migrated}")
        assert moves >= 1 and migrated >= 1, "nothing migrated: the test shows nothing"
        assert pending_count(sr, keys.requests, "rollout") == 0
    finally:
        stop_cluster(cluster, sr)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["source-before", "source-after", "target"])
def test_sigkill_mid_migration_loses_nothing_and_duplicates_nothing(
    fault: str, tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """A worker SIGKILLed at the worst moment of a migration; the others carry on (its pending
    entry, a segment or a continuation, is reclaimed after ``claim_idle_s``).  Catches: a lost
    request (the step never ends), a sample published twice (by a segment and its continuation,
    or by the reclaimed entry and the continuation), a half-built trajectory."""
    cfg, cluster = _cluster(tmp_path, run_name, redis_url, fault=fault)
    try:
        d = Driver(cluster, sr)
        fired = tmp_path / "fired"
        # not ``d.until``: its liveness check would see the planted kill as a crash
        deadline = time.monotonic() + 120
        while not fired.exists():
            assert time.monotonic() < deadline, f"the {fault} fault never fired; {d.logs()}"
            time.sleep(0.02)
        deadline = time.monotonic() + 15  # the kill is at once, or 50 ms into the continuation
        while not any(rp.proc.poll() is not None for rp in cluster.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [rp for rp in cluster.procs if rp.proc.poll() is not None]
        assert [rp.proc.returncode for rp in dead] == [-9], [(rp.name, rp.proc.returncode) for rp in dead]
        d.killed.add(dead[0].proc.pid)
        victim = f"{run_name}-w{dead[0].name.split('-')[1]}"
        stranded = pending_count(sr, Keys(run_name).requests, "rollout", victim)
        d.finish(120)
        assert_exactly_once(sr, cfg, d.metrics)
        _check_trajectories(sr, run_name, cfg.rollout.emulated, cfg.rollout.seed)
        keys = Keys(run_name)
        if fault != "source-before":
            assert int(sr.hget(keys.stats, "migrations") or 0) >= 1
        if fault == "source-before":  # it died holding the request it had preempted
            assert stranded >= 1
        # whatever the dead worker held (a segment, a continuation not finished within 50 ms, or
        # nothing) was taken over by the others
        assert int(sr.hget(keys.stats, "reclaimed_requests") or 0) >= stranded
        assert pending_count(sr, keys.requests, "rollout", victim) == 0
    finally:
        stop_cluster(cluster, sr)
