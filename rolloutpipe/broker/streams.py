"""The standard Redis-streams recipe, in one small class: ``Broker``, the transport of one run.

* ``XGROUP CREATE ... MKSTREAM`` tolerating only ``BUSYGROUP``;
* ``XADD`` with an approximate ``MAXLEN`` trim, applied once (``once.py``);
* ``XREADGROUP`` with ``BLOCK`` and ``COUNT``;
* ``XAUTOCLAIM`` for entries abandoned by dead consumers;
* ``XACK`` only after the effect is durable (callers decide when);
* dead letters (``dlq``) and the run's counters (``stats``).

The key names are ``keys.py``'s, the connection ``connect.py``'s; the step state and heartbeats
that the roles also call on a ``Broker`` are its mixin ``state.StepState``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from rolloutpipe import metrics
from rolloutpipe.broker.codec import DEFAULT_CODEC, MsgpackCodec
from rolloutpipe.broker.connect import AsyncCluster
from rolloutpipe.broker.events import DeadLetter, Event
from rolloutpipe.broker.keys import DATA, Groups, Keys, as_str, one_slot, shard_of
from rolloutpipe.broker.once import ONCE_LUA, Once
from rolloutpipe.broker.state import StepState
from rolloutpipe.errors import CodecError, ConfigError

log = logging.getLogger("rolloutpipe.broker")

E = TypeVar("E", bound=Event)


@dataclass(frozen=True)
class Entry:
    """One stream entry as read: its stream, id and fields (the event's bytes under ``DATA``)."""

    stream: str
    id: str
    fields: dict[bytes, bytes]

    @property
    def data(self) -> bytes:
        return self.fields.get(DATA, b"")


class Broker(StepState):
    """The streams of one run: publish, read, acknowledge, claim, dead-letter (step state: ``StepState``)."""

    def __init__(
        self,
        r: aioredis.Redis,
        run: str,
        role: str,
        *,
        maxlen: int = 100_000,
        codec: MsgpackCodec | None = None,
        sample_shards: int = 1,
    ) -> None:
        self.r = r
        self.keys = Keys(run)
        self.shards = max(1, sample_shards)  # samples streams: one aggregator each (``shard_of``)
        self.run = run
        self.role = role
        self.maxlen = maxlen
        self.codec = codec or DEFAULT_CODEC
        self._once: Any = None  # the ONCE_LUA script, registered on first use
        self._once_loaded = 0  # id of the client that SCRIPT LOADed it (``execute_all``)

    async def ensure_group(self, stream: str, group: str, start: str = "0") -> None:
        try:
            await self.r.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def encode(self, event: Event) -> bytes:
        return self.codec.encode(event)

    def once(self, step: int | None) -> Once:
        """A write applied at most once, however often a lost reply makes redis-py send it."""
        return Once(self, step)

    def sample_stream(self, group_id: str) -> str:
        """The samples stream a group's samples and allocations go to."""
        return self.keys.samples_shard(shard_of(group_id, self.shards))

    async def check_shards(self) -> None:
        """Every role of a run must split ``samples`` the same way, or a group's samples would wait on
        a stream no aggregator of theirs reads: the first role to start records the count, and a
        role configured with another count stops with a ConfigError that names both."""
        await self.r.set(self.keys.sample_shards, self.shards, nx=True)
        have = int(await self.r.get(self.keys.sample_shards) or self.shards)
        if have != self.shards:
            raise ConfigError(
                f"run {self.run!r} splits its samples into {have} streams (redis.sample_shards), but this "
                f"{self.role} was started with {self.shards}: start every role with the same value"
            )

    def once_script(self) -> Any:
        if self._once is None:
            self._once = self.r.register_script(ONCE_LUA)
        return self._once

    async def execute_all(self, ops: Sequence[Once]) -> list[str]:
        """Several writes in one round trip, each applied at most once and in order.

        A pipeline without MULTI: each write is still atomic on its own (one script run), and a
        resend of the pipeline after a lost reply changes nothing (each keeps its token).
        """
        if not ops:
            return []
        if len(ops) == 1 or isinstance(self.r, AsyncCluster):
            # a cluster: each on its own (its slot checked, and its WAIT for replicas when asked)
            return [await op.execute() for op in ops]
        for op in ops:
            one_slot(self.keys, [op.record, *op.keys])
        script = self.once_script()
        if self._once_loaded != id(self.r):
            await self.r.script_load(ONCE_LUA)  # then EVALSHA, without a SCRIPT EXISTS per pipeline
            self._once_loaded = id(self.r)
        for attempt in range(2):
            pipe = self.r.pipeline(transaction=False)
            for op in ops:
                pipe.evalsha(script.sha, len(op.keys) + 1, op.record, *op.keys, op.token, op.ttl, *op.args)
            try:
                return [as_str(x) for x in await pipe.execute()]
            except NoScriptError:  # a restarted Redis forgot the script: load it, send them again
                if attempt:
                    raise
                await self.r.script_load(ONCE_LUA)
        raise AssertionError("unreachable")

    async def publish(self, stream: str, event: Event) -> str:
        """``event`` onto ``stream`` once (its entry id)."""
        return await self.once(event.step).xadd(stream, self.encode(event), mode="r").execute()

    async def read(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 16,
        block_ms: int = 100,
        start: str = ">",
    ) -> list[Entry]:
        return await self.read_streams([stream], group, consumer, count=count, block_ms=block_ms, start=start)

    async def read_streams(
        self,
        streams: Sequence[str],
        group: str,
        consumer: str,
        *,
        count: int = 16,
        block_ms: int = 100,
        start: str = ">",
    ) -> list[Entry]:
        """One XREADGROUP over several streams (an aggregator serving several samples shards)."""
        resp = await self.r.xreadgroup(
            group, consumer, dict.fromkeys(streams, start), count=count, block=block_ms
        )
        return _entries(resp)

    async def autoclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int = 64
    ) -> list[Entry]:
        """Claim entries idle for ``min_idle_ms`` (their consumer is presumed dead)."""
        out: list[Entry] = []
        cursor = "0-0"
        for _ in range(16):
            resp = await self.r.xautoclaim(stream, group, consumer, min_idle_ms, start_id=cursor, count=count)
            cursor = as_str(resp[0])
            for eid, fields in resp[1]:
                if fields is None:  # deleted while pending (trimmed); nothing to claim
                    await self.ack(stream, group, as_str(eid))
                    continue
                out.append(Entry(stream, as_str(eid), dict(fields)))
            if cursor == "0-0":
                break
        return out

    async def touch(self, stream: str, group: str, consumer: str, ids: list[str]) -> None:
        """Reset the idle time of entries we still work on, so XAUTOCLAIM leaves them alone."""
        if ids:
            await self.r.xclaim(stream, group, consumer, 0, list[Any](ids), justid=True)

    async def ack(self, stream: str, group: str, *ids: str) -> None:
        if ids:
            await self.r.xack(stream, group, *ids)

    def decode(self, entry: Entry) -> Event:
        return self.codec.decode(entry.data)

    async def pending_ids(self, stream: str, group: str, consumer: str, count: int = 10_000) -> list[str]:
        """Ids of the entries delivered to ``consumer`` and not acknowledged (no bodies: cheap)."""
        got: Any = await self.r.xpending_range(
            stream, group, min="-", max="+", count=count, consumername=consumer
        )
        return [as_str(p["message_id"]) for p in got]

    async def deliveries(self, entry: Entry, group: str) -> int:
        """How many times ``entry`` was delivered to ``group``'s consumers (0 once acknowledged)."""
        got: Any = await self.r.xpending_range(entry.stream, group, min=entry.id, max=entry.id, count=1)
        return int(got[0]["times_delivered"]) if got else 0

    async def dead_letter(
        self,
        entry: Entry | None,
        reason: str,
        *,
        step: int = -1,
        policy_version: int = -1,
        payload: bytes | None = None,
        counter: str = "dead_letters",
        ack_group: str | None = None,
        finished: bool = False,
        origin: str = "",
    ) -> None:
        """Write to ``dlq`` with a reason and count it.  Never silent.

        With ``ack_group`` the entry is acknowledged in the same transaction, so it is either still
        pending (and will be looked at again) or dead-lettered, never both or neither.  With
        ``finished`` (a request a worker drops) the step's ``finished`` counter counts it too, unless
        the request was counted already (under ``origin`` for a migrated request's continuation).
        Applied once, even when its reply is lost and it is retried.
        """
        dl = DeadLetter(
            run=self.run,
            step=step,
            policy_version=policy_version,
            source_stream=entry.stream if entry else "",
            entry_id=entry.id if entry else "",
            role=self.role,
            reason=reason,
            payload=payload if payload is not None else (entry.data if entry else b""),
            created_at=time.time(),
        )
        op = self.once(step).xadd(self.keys.dlq, self.encode(dl))
        if ack_group is not None and entry is not None:
            op.xack(entry.stream, ack_group, [entry.id])
        names = ["dead_letters"] if counter == "dead_letters" else ["dead_letters", counter]
        for name in names:
            op.cmd("HINCRBY", self.keys.stats, name, 1)
            if step >= 0:
                op.cmd("HINCRBY", self.keys.stats, f"{name}:{step}", 1)
        if finished and step >= 0 and entry is not None:  # a request dropped by a worker frees its slot
            op.cmd("SADD", self.keys.finished_ids(step), origin or entry.id, mode="g")
            op.cmd("INCRBY", self.keys.finished(step), 1)
        await op.execute()
        metrics.DEAD_LETTERS.labels(self.role).inc()
        if counter == "fence_rejections":
            metrics.FENCE_REJECTIONS.labels(self.role).inc()
        if counter != "dead_letters":
            metrics.BROKER_EVENTS.labels(self.role, counter).inc()
        log.warning("dead letter from %s %s: %s", dl.source_stream or "-", dl.entry_id or "-", reason)

    async def decode_or_dlq(
        self, entry: Entry, group: str, expected: tuple[type[Event], ...]
    ) -> Event | None:
        """Decode an entry; on failure dead-letter it, ack it, and return None."""
        try:
            event = self.decode(entry)
        except CodecError as e:
            await self.dead_letter(entry, f"decode: {e}", ack_group=group)
            return None
        if not isinstance(event, expected):
            await self.dead_letter(
                entry,
                f"unexpected kind {event.kind!r} on {entry.stream}",
                step=event.step,
                policy_version=event.policy_version,
                ack_group=group,
            )
            return None
        if event.run != self.run:
            await self.dead_letter(
                entry, f"event of run {event.run!r} on run {self.run!r}", step=event.step, ack_group=group
            )
            return None
        return event

    async def stat(self, name: str, step: int | None = None) -> int:
        field = name if step is None else f"{name}:{step}"
        v = await self.r.hget(self.keys.stats, field)
        return int(v) if v is not None else 0

    async def incr(self, name: str, step: int | None = None, by: int = 1) -> None:
        """Count ``by`` under ``name`` (and ``name:step``) in ``stats``, once."""
        op = self.once(step).cmd("HINCRBY", self.keys.stats, name, by)
        if step is not None:
            op.cmd("HINCRBY", self.keys.stats, f"{name}:{step}", by)
        await op.execute()
        metrics.BROKER_EVENTS.labels(self.role, name).inc(by)

    async def get_event(self, key: str, cls: type[E]) -> E | None:
        raw = await self.r.get(key)
        if raw is None:
            return None
        return self.codec.decode_as(raw, cls)

    async def read_feedback(
        self, consumer: str, *, block_ms: int, count: int = 256, start: str = ">"
    ) -> list[Entry]:
        return await self.read(
            self.keys.feedback, Groups.CONTROLLER, consumer, count=count, block_ms=block_ms, start=start
        )

    async def trainer_lag(self) -> int:
        """Groups in ``groups`` the trainer has not acknowledged: undelivered (lag) + pending."""
        try:
            info: Any = await self.r.xinfo_groups(self.keys.groups)
        except ResponseError:  # no stream yet
            return 0
        names = {as_str(g["name"]) for g in info}
        if Groups.TRAINER not in names:
            return int(await self.r.xlen(self.keys.groups))  # no trainer group yet: nothing consumed
        lag = lag_of(info, Groups.TRAINER)
        if lag is None:  # Redis cannot tell (entries deleted mid-stream): count them
            g = next(g for g in info if as_str(g["name"]) == Groups.TRAINER)
            after: Any = await self.r.xrange(
                self.keys.groups, min="(" + as_str(g["last-delivered-id"]), max="+"
            )
            lag = len(after) + int(g["pending"])
        return lag


def lag_of(groups_info: Any, group: str) -> int | None:
    """Entries a consumer group has not acknowledged (undelivered + pending), from ``XINFO GROUPS``.

    None when the group does not exist or Redis cannot tell the lag (entries deleted mid-stream).
    """
    for g in groups_info or []:
        if as_str(g["name"]) == group:
            lag = g.get("lag")
            return None if lag is None else int(lag) + int(g["pending"])
    return None


def _entries(resp: Any) -> list[Entry]:
    out: list[Entry] = []
    if not resp:
        return out
    for stream, items in resp:
        for eid, fields in items:
            if fields is None:
                continue
            out.append(Entry(as_str(stream), as_str(eid), dict(fields)))
    return out
