"""Redis Cluster: the roles against a real local cluster (3 masters, one replica each).

* every Broker write runs on the cluster, and each command it sends touches only its run's slot
  (the slots of the keys Redis itself names with ``COMMAND GETKEYS``);
* worker discovery through the ``workers`` registry, no SCAN, on one server and on the cluster;
* a run of real role processes against ``redis+cluster://`` trains every group exactly once;
* two runs whose slots are on different masters run side by side, each on its own node;
* a run survives the SIGKILL of the master that serves its slot (its replica takes over).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection
from redis.crc import key_slot
from redis.exceptions import MovedError

from rolloutpipe.broker.connect import cluster_node_url, connect, connect_sync, is_cluster
from rolloutpipe.broker.keys import Keys, one_slot
from rolloutpipe.broker.streams import Broker
from rolloutpipe.broker.trim import trim_run
from rolloutpipe.errors import CrossSlotError
from rolloutpipe.tools import status
from tests.support.cluster import Driver, assert_exactly_once, start_cluster, stop_cluster
from tests.support.config import EMULATED_FAST, make_config
from tests.support.helpers import audit_group_log, version
from tests.support.rediscluster import LocalCluster, Node
from tests.support.writes import WRITES

STEPS = 3
OVERRIDES = (
    *EMULATED_FAST,
    f"controller.steps={STEPS}",
    "controller.mode=cgp-fgd",
    "redis.trim=false",  # the audit reads whole streams
    "trainer.record_groups=true",
)


@pytest.fixture()
async def car(redis_cluster: LocalCluster) -> AsyncIterator[aioredis.Redis]:
    r = connect(redis_cluster.url)
    yield r
    await r.aclose()


@pytest.fixture()
def csr(redis_cluster: LocalCluster) -> Iterator[redis.Redis]:
    r = connect_sync(redis_cluster.url)
    yield r
    r.close()


def run_on(
    lc: LocalCluster, avoid: frozenset[int] = frozenset(), prefix: str = "t", on: Node | None = None
) -> tuple[str, Node]:
    """A fresh run name whose slot is served by ``on`` (else by any master whose port is not in
    ``avoid``), and that master."""
    for _ in range(1000):
        run = f"{prefix}{uuid.uuid4().hex[:10]}"
        owner = lc.slot_owner(Keys(run).slot)
        if (owner is on) if on is not None else owner.port not in avoid:
            return run, owner
    raise AssertionError("no run name found")


# ------------------------------------------------------------------------------ URLs


async def test_cluster_urls_choose_the_cluster_client_tls_included() -> None:
    assert cluster_node_url("redis+cluster://h:7000/0") == "redis://h:7000/0"
    assert cluster_node_url("rediss+cluster://u:p@h:7000/0?ssl_cert_reqs=none") == (
        "rediss://u:p@h:7000/0?ssl_cert_reqs=none"
    )
    assert cluster_node_url("redis://h:6379/0") is None and cluster_node_url("rediss://h/0") is None
    r: Any = connect("rediss+cluster://127.0.0.1:1/0?ssl_cert_reqs=none")  # no connection yet
    try:
        assert is_cluster(r)
        assert r.nodes_manager.connection_kwargs["connection_class"] is SSLConnection
        assert r.nodes_manager.connection_kwargs["ssl_cert_reqs"] == "none"
    finally:
        await r.aclose()
    plain = connect("redis://127.0.0.1:1/0")
    assert not is_cluster(plain)
    await plain.aclose()


# ------------------------------------------------------------------------------ one slot per write


def test_keys_of_a_run_share_its_slot_and_a_foreign_key_is_refused() -> None:
    k = Keys("demo")
    names = [v for v in vars(k).values() if isinstance(v, str) and v.startswith("rp:")]
    names += [*k.step_keys(12), k.heartbeat("w0"), k.op("abc")]
    assert {key_slot(n.encode()) for n in names} == {k.slot}
    one_slot(k, names)
    with pytest.raises(CrossSlotError):
        one_slot(k, [k.version, Keys("other").version])
    with pytest.raises(ValueError, match="non-empty"):
        Keys("")  # ``rp:{}:`` is no hash tag: its keys would scatter over the slots


@pytest.mark.parametrize("write", sorted(WRITES))
async def test_every_write_runs_on_the_cluster_within_its_runs_slot(
    write: str, redis_cluster: LocalCluster, car: aioredis.Redis, run_name: str
) -> None:
    """Each Broker write (the lost-replies cases, ``tests/support/writes.py``) on the cluster: it does
    what it should, and every command it sent names only keys of its run's slot, as Redis itself
    reads them."""
    b = Broker(car, run_name, "test")
    sent: list[tuple[Any, ...]] = []
    real = car.execute_command

    async def recording(*args: Any, **kwargs: Any) -> Any:
        sent.append(args)
        return await real(*args, **kwargs)

    car.execute_command = recording  # type: ignore[method-assign]
    try:
        check = await WRITES[write](b, car, b.keys)
    finally:
        car.execute_command = real  # type: ignore[method-assign]
    await check()
    node = aioredis.Redis(port=redis_cluster.nodes[0].port)
    try:
        writes = [a for a in sent if str(a[0]).upper() in ("EVALSHA", "EVAL")]
        assert writes, f"{write} sent no script: {[a[0] for a in sent]}"
        for args in sent:
            try:
                # redis-py sends a subcommand with its command ("XGROUP CREATE")
                keys = await node.command_getkeys(*str(args[0]).split(), *args[1:])
            except redis.ResponseError as e:
                assert "no key" in str(e).lower(), (args[0], e)
                continue  # a command without keys (SCRIPT LOAD)
            slots = {key_slot(k.encode() if isinstance(k, str) else k) for k in keys}
            assert slots == {b.keys.slot}, (args[0], keys)
    finally:
        await node.aclose()


# ------------------------------------------------------------------------------ worker discovery


@pytest.mark.parametrize("where", ["one server", "cluster"])
async def test_live_workers_come_from_the_registry_without_scan(
    where: str, request: pytest.FixtureRequest, run_name: str
) -> None:
    if where == "cluster":
        url: str = request.getfixturevalue("redis_cluster").url
    else:
        url = request.getfixturevalue("redis_url")
    r, sync = connect(url), connect_sync(url)
    assert is_cluster(r) == is_cluster(sync) == (where == "cluster")
    b = Broker(r, run_name, "test")
    k = b.keys
    try:
        await b.heartbeat("w0", {"capacity": 4, "t": time.time()}, ttl_s=30)
        await b.heartbeat("w1", {"capacity": 2, "t": time.time()}, ttl_s=30)
        await b.heartbeat("w2", {"capacity": 1, "t": time.time()}, ttl_s=30)
        assert await b.capacity() == 7
        assert await b.kv_tokens() == 0  # workers that report no KV cache: no limit to count on
        await b.heartbeat("w0", {"capacity": 4, "kv_tokens": 600, "t": time.time()}, ttl_s=30)
        await b.heartbeat("w1", {"capacity": 2, "kv_tokens": 300, "t": time.time()}, ttl_s=30)
        assert await b.kv_tokens() == 0  # w2 still reports none
        await b.heartbeat("w2", {"capacity": 1, "kv_tokens": 100, "t": time.time()}, ttl_s=30)
        assert await b.kv_tokens() == 1000
        await b.drop_heartbeat("w1")  # a worker that stops says so
        await r.delete(k.heartbeat("w2"))  # one whose key expired (it died)
        assert [w["capacity"] for w in await b.live_workers()] == [4]
        assert {m.decode() for m in await r.zrange(k.workers, 0, -1)} == {"w0", "w2"}
        # a worker registered long ago and dead since is dropped from the registry by the next beat
        await r.zadd(k.workers, {"old": time.time() - 3600})
        await b.heartbeat("w0", {"capacity": 4, "t": time.time()}, ttl_s=30)
        assert {m.decode() for m in await r.zrange(k.workers, 0, -1)} == {"w0", "w2"}
        # ``status`` sees the same, through the sync client
        st = status.collect_status(connect_sync(url, fail_fast=True), run_name)
        assert [(w["id"], w["capacity"]) for w in st["workers"]] == [("w0", 4)]
        assert 0 < st["workers"][0]["ttl_s"] <= 30
        assert status.worker_health(sync, run_name, "w0")[0] == 0
        assert status.worker_health(sync, run_name, "w2")[0] == 1
        # trimming works on the cluster too (DEL of per-step keys, XTRIM)
        await trim_run(r, k, 50, keep_steps=2, control_maxlen=10)
    finally:
        await r.aclose()
        sync.close()


# ------------------------------------------------------------------------------ whole runs


def _on_node(node: Node, key: str) -> bool:
    """Whether ``node`` itself holds ``key`` (a plain client: no redirection followed)."""
    try:
        return bool(node.client().exists(key))
    except MovedError:  # another node serves the slot
        return False


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2], ids=["one-aggregator", "two-aggregator-shards"])
def test_a_run_on_the_cluster_trains_every_group_exactly_once(
    tmp_path: Path, redis_cluster: LocalCluster, csr: redis.Redis, shards: int
) -> None:
    """Also with two aggregators: the shard streams share the run's slot, like every key of it."""
    run, owner = run_on(redis_cluster)
    cfg = make_config(tmp_path, run, *OVERRIDES, f"redis.sample_shards={shards}")
    cluster = start_cluster(cfg, redis_cluster.url)
    try:
        d = Driver(cluster, csr)
        d.until(lambda: bool(status.collect_status(csr, run)["workers"]), 60, "live workers in status")
        d.finish(90)
        assert_exactly_once(csr, cfg, d.metrics)
        audit_group_log(Path(cfg.out), STEPS, cfg.controller.prompts_per_step, cfg.controller.group_size)
        assert _on_node(owner, Keys(run).version)
        for stream in Keys(run).sample_streams(shards):
            assert _on_node(owner, stream), stream
    finally:
        stop_cluster(cluster, csr)


@pytest.mark.slow
def test_two_runs_land_on_different_masters_and_both_complete(
    tmp_path: Path, redis_cluster: LocalCluster, csr: redis.Redis
) -> None:
    run_a, owner_a = run_on(redis_cluster, prefix="a")
    run_b, owner_b = run_on(redis_cluster, avoid=frozenset({owner_a.port}), prefix="b")
    ka, kb = Keys(run_a), Keys(run_b)
    assert ka.slot != kb.slot and owner_a.port != owner_b.port
    cfgs = [make_config(tmp_path, run, *OVERRIDES) for run in (run_a, run_b)]
    clusters = [start_cluster(cfg, redis_cluster.url) for cfg in cfgs]
    try:
        drivers = [Driver(c, csr) for c in clusters]
        deadline = time.monotonic() + 120
        while not all(len(d.metrics) >= STEPS for d in drivers):
            assert time.monotonic() < deadline, [d.logs() for d in drivers]
            for d in drivers:
                d.pump(block_ms=10)
        for cfg, d in zip(cfgs, drivers, strict=True):
            assert_exactly_once(csr, cfg, d.metrics)
        # each run's keys live on its own master only (the other answers MOVED)
        assert _on_node(owner_a, ka.groups) and not _on_node(owner_b, ka.groups)
        assert _on_node(owner_b, kb.groups) and not _on_node(owner_a, kb.groups)
    finally:
        for c in clusters:
            stop_cluster(c, csr)


def _offsets(lc: LocalCluster, master: Node) -> dict[str, int]:
    """The master's replication offset and each replica's (bytes of the replication stream)."""
    out = {"master": int(lc._replication(master)["master_repl_offset"])}
    for rep in lc.replicas_of(master):
        out[f"replica {rep.port}"] = int(lc._replication(rep)["slave_repl_offset"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "cluster failover"])
def test_a_run_survives_the_failover_of_the_master_of_its_slot(
    how: str, tmp_path: Path, redis_cluster: LocalCluster, csr: redis.Redis
) -> None:
    """SIGKILL the master serving the run's slot mid-step (or ``CLUSTER FAILOVER`` on its replica,
    which turns the master into a replica under blocked XREADGROUPs): its replica is promoted,
    every role's client waits the failover out, and every planned group is still trained exactly
    once.

    The master failed over also serves slot 0, so it is every client's "default node" (redis-py's
    first master), which redis-py asks for the keys of XREAD/XREADGROUP: the harder case (before
    ``_AsyncCluster`` forced a new slot map on each retry, the roles died of it)."""
    lc, steps = redis_cluster, 6
    run, owner = run_on(lc, on=lc.slot_owner(0))
    assert lc.replicas_of(owner), "the run's master has no replica"
    slot = Keys(run).slot
    cfg = make_config(
        tmp_path, run, *OVERRIDES, f"controller.steps={steps}", "rollout.emulated.time_scale=0.05"
    )
    cluster = start_cluster(cfg, lc.url)
    try:
        d = Driver(cluster, csr)
        d.until(lambda: version(csr, run) >= 2, 60, "version 2")
        pause = time.monotonic() + 0.3
        d.until(lambda: time.monotonic() >= pause, 5, "mid-step")
        at_kill = version(csr, run)
        offsets = _offsets(lc, owner)
        (rep,) = lc.replicas_of(owner)
        t0 = time.monotonic()
        if how == "sigkill":
            lc.kill(owner)
        else:
            assert rep.client().execute_command("CLUSTER", "FAILOVER") in (b"OK", "OK", True)
        while lc.slot_owner(slot).port == owner.port:
            assert time.monotonic() - t0 < 30, "no replica took over the slot in 30 s"
            time.sleep(0.02)
        promoted_s = time.monotonic() - t0
        d.until(lambda: version(csr, run) > at_kill, 60, "the next version after the failover")
        next_version_s = time.monotonic() - t0
        d.finish(120)
        assert_exactly_once(csr, cfg, d.metrics)
        _trained, counts = audit_group_log(
            Path(cfg.out), steps, cfg.controller.prompts_per_step, cfg.controller.group_size
        )
        assert lc.slot_owner(slot) is rep
        print(
            f"failover ({how}):",
            json.dumps(
                {
                    "killed_in_step": at_kill,
                    "replication_offsets_at_kill": offsets,
                    "replica_promoted_s": round(promoted_s, 2),
                    "next_version_s": round(next_version_s, 2),
                    **counts,
                }
            ),
        )
    finally:
        stop_cluster(cluster, csr)
        if not owner.alive():
            lc.restart(owner)  # it rejoins as a replica of the promoted node: the cluster whole again
        lc.wait_ok()


@pytest.mark.slow
def test_with_wait_replicas_a_failover_that_drops_unreplicated_writes_loses_nothing(
    tmp_path: Path, redis_cluster: LocalCluster, csr: redis.Redis
) -> None:
    """The failover that asynchronous replication allows to lose acknowledged writes, made to
    happen: the replica is stopped and its link cut (``CLIENT KILL TYPE replica``) 0.5 s before
    its master is SIGKILLed, so what the master accepted in that time never reaches it.

    With ``?wait_replicas=1`` a write is done only once ``WAIT`` says a replica has it; the writes
    of that half second wait, their master dies, and their retries (same tokens) apply them on the
    promoted replica.  The killed master rejoins as the new master's replica (else every write
    would wait ``wait_timeout_ms`` for a replica that does not exist).  Nothing is lost: both the
    trainer's log and Redis's own record (streams, ``emitted:k``, acknowledgements) are exact.
    Without ``wait_replicas`` the same experiment lost six trained groups from Redis's record in
    most trials and stalled the run in some (docs/operations.md, "Redis Cluster")."""
    lc, steps = redis_cluster, 6
    run, owner = run_on(lc)
    (rep,) = lc.replicas_of(owner)
    assert rep.proc is not None
    slot = Keys(run).slot
    cfg = make_config(
        tmp_path, run, *OVERRIDES, f"controller.steps={steps}", "rollout.emulated.time_scale=0.05"
    )
    cluster = start_cluster(cfg, lc.url + "?wait_replicas=1&wait_timeout_ms=2000")
    try:
        d = Driver(cluster, csr)
        d.until(lambda: version(csr, run) >= 2, 60, "version 2")
        at_kill = version(csr, run)
        os.kill(rep.proc.pid, signal.SIGSTOP)
        try:
            assert owner.client().execute_command("CLIENT", "KILL", "TYPE", "replica") == 1
            cut = int(lc._replication(owner)["master_repl_offset"])
            time.sleep(0.5)  # the master accepts writes its replica will never see
            unreplicated = int(lc._replication(owner)["master_repl_offset"]) - cut
            lc.kill(owner)
        finally:
            os.kill(rep.proc.pid, signal.SIGCONT)
        t0 = time.monotonic()
        while lc.slot_owner(slot).port == owner.port:
            assert time.monotonic() - t0 < 30, "no replica took over the slot in 30 s"
            time.sleep(0.02)
        assert lc.slot_owner(slot) is rep
        lc.restart(owner)  # back as the promoted node's replica
        d.finish(120)
        assert_exactly_once(csr, cfg, d.metrics)
        _trained, counts = audit_group_log(
            Path(cfg.out), steps, cfg.controller.prompts_per_step, cfg.controller.group_size
        )
        print(
            "lossy failover with WAIT:",
            json.dumps({"killed_in_step": at_kill, "unreplicated_bytes": unreplicated, **counts}),
        )
    finally:
        stop_cluster(cluster, csr)
        lc.wait_ok()
