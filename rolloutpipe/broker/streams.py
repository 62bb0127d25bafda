"""The standard Redis-streams recipe, in one small class.

* ``XGROUP CREATE ... MKSTREAM`` tolerating only ``BUSYGROUP``;
* ``XADD`` with an approximate ``MAXLEN`` trim;
* ``XREADGROUP`` with ``BLOCK`` and ``COUNT``;
* ``XAUTOCLAIM`` for entries abandoned by dead consumers;
* ``XACK`` only after the effect is durable (callers decide when).

Every key of a run lives under ``rp:{run}:``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from rolloutpipe import metrics
from rolloutpipe.broker.codec import DEFAULT_CODEC, MsgpackCodec
from rolloutpipe.broker.events import DeadLetter, Event
from rolloutpipe.errors import CodecError

log = logging.getLogger("rolloutpipe.broker")

E = TypeVar("E", bound=Event)
DATA = b"d"


class Keys:
    """Names of every stream and key of one run."""

    def __init__(self, run: str) -> None:
        self.run = run
        p = f"rp:{{{run}}}:"  # the braces are a Redis Cluster hash tag: one slot per run
        self.prefix = p
        self.requests = p + "requests"
        self.samples = p + "samples"
        self.groups = p + "groups"
        self.control = p + "control"
        self.dlq = p + "dlq"
        self.version = p + "version"
        self.stats = p + "stats"
        self.done = p + "done"

    def plan(self, step: int) -> str:
        return f"{self.prefix}plan:{step}"

    def emitted(self, step: int) -> str:
        """Set of group ids already written to ``groups`` for a step (exactly-once)."""
        return f"{self.prefix}emitted:{step}"

    def released(self, step: int) -> str:
        return f"{self.prefix}released:{step}"

    def finished(self, step: int) -> str:
        """Counter of requests of a step whose sample was published."""
        return f"{self.prefix}finished:{step}"

    def consumed(self, step: int) -> str:
        return f"{self.prefix}consumed:{step}"

    def heartbeat(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}"

    def heartbeat_pattern(self) -> str:
        return f"{self.prefix}worker:*"


@dataclass(frozen=True)
class Entry:
    stream: str
    id: str
    fields: dict[bytes, bytes]

    @property
    def data(self) -> bytes:
        return self.fields.get(DATA, b"")


def connect(url: str, max_connections: int = 32, *, retry_s: float = 30.0) -> aioredis.Redis:
    """A client whose pool waits for a free connection instead of failing under bursts.

    ``url`` may be ``redis://`` or ``rediss://`` (TLS; redis-py reads ``ssl_ca_certs``,
    ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile`` … from the query string).  A command that
    fails with ``ConnectionError``/``TimeoutError`` (a Redis restart, ``LOADING`` while the AOF is
    replayed) is retried on a fresh connection with exponential backoff (50 ms doubling, at most
    1 s apart) for about ``retry_s`` seconds before the error reaches the role.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries_for(retry_s)),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    # from_pool: the client owns its pool, so ``aclose()`` also closes the pool's connections
    return aioredis.Redis.from_pool(pool)  # the pool's decode_responses defaults to False


def connect_sync(url: str, *, retry_s: float = 30.0) -> redis.Redis:
    """A blocking client with the same retries as :func:`connect` (``rolloutpipe run``'s follower)."""
    return redis.Redis.from_url(
        url,
        retry=SyncRetry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries_for(retry_s)),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


def retries_for(seconds: float, *, base: float = 0.05, cap: float = 1.0) -> int:
    """How many exponential-backoff retries (``base`` doubling up to ``cap``) span ``seconds``."""
    n, waited = 0, 0.0
    while waited < seconds:
        waited += min(cap, base * 2**n)
        n += 1
    return n


class Broker:
    """Stream helper bound to one run's namespace."""

    def __init__(
        self,
        r: aioredis.Redis,
        run: str,
        role: str,
        *,
        maxlen: int = 100_000,
        codec: MsgpackCodec | None = None,
    ) -> None:
        self.r = r
        self.keys = Keys(run)
        self.run = run
        self.role = role
        self.maxlen = maxlen
        self.codec = codec or DEFAULT_CODEC

    async def ensure_group(self, stream: str, group: str, start: str = "0") -> None:
        try:
            await self.r.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def encode(self, event: Event) -> bytes:
        return self.codec.encode(event)

    async def publish(self, stream: str, event: Event) -> str:
        eid = await self.r.xadd(stream, {DATA: self.encode(event)}, maxlen=self.maxlen, approximate=True)
        return _s(eid)

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
        resp = await self.r.xreadgroup(group, consumer, {stream: start}, count=count, block=block_ms)
        return _entries(resp)

    async def autoclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int = 64
    ) -> list[Entry]:
        """Claim entries idle for ``min_idle_ms`` (their consumer is presumed dead)."""
        out: list[Entry] = []
        cursor = "0-0"
        for _ in range(16):
            resp = await self.r.xautoclaim(stream, group, consumer, min_idle_ms, start_id=cursor, count=count)
            cursor = _s(resp[0])
            for eid, fields in resp[1]:
                if fields is None:  # deleted while pending (trimmed); nothing to claim
                    await self.ack(stream, group, _s(eid))
                    continue
                out.append(Entry(stream, _s(eid), dict(fields)))
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
    ) -> None:
        """Write to ``dlq`` with a reason and count it.  Never silent.

        With ``ack_group`` the entry is acknowledged in the same transaction, so it is either still
        pending (and will be looked at again) or dead-lettered, never both or neither.
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
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dlq, {DATA: self.encode(dl)}, maxlen=self.maxlen, approximate=True)
        if ack_group is not None and entry is not None:
            pipe.xack(entry.stream, ack_group, entry.id)
        pipe.hincrby(self.keys.stats, "dead_letters", 1)
        if counter != "dead_letters":
            pipe.hincrby(self.keys.stats, counter, 1)
        if step >= 0:
            pipe.hincrby(self.keys.stats, f"dead_letters:{step}", 1)
            if counter != "dead_letters":
                pipe.hincrby(self.keys.stats, f"{counter}:{step}", 1)
        await pipe.execute()
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
        pipe = self.r.pipeline(transaction=True)
        pipe.hincrby(self.keys.stats, name, by)
        if step is not None:
            pipe.hincrby(self.keys.stats, f"{name}:{step}", by)
        await pipe.execute()
        metrics.BROKER_EVENTS.labels(self.role, name).inc(by)

    async def get_event(self, key: str, cls: type[E]) -> E | None:
        raw = await self.r.get(key)
        if raw is None:
            return None
        return self.codec.decode_as(raw, cls)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _entries(resp: Any) -> list[Entry]:
    out: list[Entry] = []
    if not resp:
        return out
    for stream, items in resp:
        for eid, fields in items:
            if fields is None:
                continue
            out.append(Entry(_s(stream), _s(eid), dict(fields)))
    return out
