"""A run's step state and its workers' heartbeats, on top of the streams of ``Broker``.

Step state: the policy version, each step's plan, the requests released and finished, the groups
emitted, sealed and consumed, the allocations, and the controller's prompt history, in the keys
of ``Keys`` (``plan:k``, ``emitted:k``, ``consumed:k`` …), each write applied once (``once.py``).
Heartbeats: each worker's TTL key and the run's ``workers`` registry.

``StepState`` is a mixin of ``streams.Broker`` (``class Broker(StepState)``), so the roles keep one
object and call ``broker.plan(k)`` as ``broker.publish(...)``: it holds no state of its own and
uses only the transport's client, keys, codec and writes, declared below for the type checker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.asyncio as aioredis

from rolloutpipe import metrics
from rolloutpipe.broker.codec import MsgpackCodec
from rolloutpipe.broker.events import (
    Allocation,
    Event,
    Group,
    GroupStats,
    PolicyVersion,
    RolloutRequest,
    Sample,
    StepMetrics,
    StepPlan,
    StepSeal,
)
from rolloutpipe.broker.keys import DATA, Groups, Keys, as_bytes, as_str, one_slot
from rolloutpipe.broker.once import MIGRATE_LUA, Once
from rolloutpipe.errors import CodecError

E = TypeVar("E", bound=Event)
T = TypeVar("T")
REGISTRY_GRACE_S = 300.0  # a registered worker whose heartbeat expired this long ago is unlisted


class StepState:
    """The step state and heartbeat operations of ``Broker`` (a mixin: see the module's docstring)."""

    # the transport's, set and defined by ``streams.Broker``
    r: aioredis.Redis
    keys: Keys
    run: str
    role: str
    maxlen: int
    codec: MsgpackCodec

    if TYPE_CHECKING:

        def once(self, step: int | None) -> Once: ...
        def encode(self, event: Event) -> bytes: ...
        def sample_stream(self, group_id: str) -> str: ...
        async def publish(self, stream: str, event: Event) -> str: ...
        async def get_event(self, key: str, cls: type[E]) -> E | None: ...

    # ------------------------------------------------ versions, plans, metrics; the run's end

    async def version(self) -> PolicyVersion | None:
        return await self.get_event(self.keys.version, PolicyVersion)

    async def version_number(self) -> int:
        pv = await self.version()
        return -1 if pv is None else pv.policy_version

    async def control_tail(self) -> str:
        """The id of the newest ``control`` entry ("0-0" if none): news after it is new."""
        last: Any = await self.r.xrevrange(self.keys.control, count=1)
        return as_str(last[0][0]) if last else "0-0"

    async def wait_control(
        self, check: Callable[[], Awaitable[T | None]], stop: asyncio.Event, *, block_ms: int = 1000
    ) -> T | None:
        """Wait until ``check()`` returns something, waking on each new ``control`` entry.

        Versions and plans are announced on ``control``, so a waiter blocks there (XREAD BLOCK)
        instead of polling their keys.  The tail id is read before ``check`` so that news written in
        between is seen; ``block_ms`` bounds the wait for a writer that announces nothing.
        """
        while not stop.is_set():
            last = await self.control_tail()
            got = await check()
            if got is not None:
                return got
            if await self.is_done():
                return None
            await self.r.xread({self.keys.control: last}, count=1, block=block_ms)
        return None

    async def wait_version(self, v: int, stop: asyncio.Event) -> PolicyVersion | None:
        """The published version once it is >= ``v`` (None if stopped or the run is done)."""

        async def at_least() -> PolicyVersion | None:
            pv = await self.version()
            return pv if pv is not None and pv.policy_version >= v else None

        return await self.wait_control(at_least, stop)

    async def plan(self, step: int) -> StepPlan | None:
        return await self.get_event(self.keys.plan(step), StepPlan)

    async def wait_plan(self, step: int, stop: asyncio.Event) -> StepPlan | None:
        return await self.wait_control(lambda: self.plan(step), stop)

    async def write_plan(self, plan: StepPlan) -> None:
        """The plan key and its announcement on ``control``, together, once: a step's plan is written
        once (``SET NX``), and only the call that wrote it announces it."""
        raw = self.encode(plan)
        op = self.once(plan.step).cmd("SET", self.keys.plan(plan.step), raw, "NX", mode="g")
        await op.xadd(self.keys.control, raw).execute()

    async def publish_version(self, pv: PolicyVersion, metrics_ev: StepMetrics | None) -> None:
        """Together and once: the previous step's metrics, the version key and its announcement."""
        raw = self.encode(pv)
        op = self.once(pv.step)
        if metrics_ev is not None:
            op.xadd(self.keys.control, self.encode(metrics_ev))
        await op.cmd("SET", self.keys.version, raw).xadd(self.keys.control, raw).execute()

    async def step_metrics(self, step: int, look_back: int = 64) -> StepMetrics | None:
        """The trainer's metrics of ``step``, from the newest ``control`` entries."""
        if step < 0:
            return None
        entries: Any = await self.r.xrevrange(self.keys.control, count=look_back)
        for _id, fields in entries or []:
            try:
                ev = self.codec.decode((fields or {}).get(DATA, b""))
            except CodecError:
                continue
            if isinstance(ev, StepMetrics) and ev.step == step:
                return ev
        return None

    async def mark_done(self) -> None:
        await self.r.set(self.keys.done, b"1")

    async def is_done(self) -> bool:
        return bool(await self.r.exists(self.keys.done))

    # ------------------------------------------------ requests: released, finished, migrated

    async def release(self, step: int, reqs: Sequence[RolloutRequest]) -> None:
        """Requests onto ``requests`` and recorded as released (counter and id set), or neither; once."""
        if not reqs:
            return
        op = self.once(step)
        for rq in reqs:
            op.xadd(self.keys.requests, self.encode(rq))
        op.cmd("INCRBY", self.keys.released(step), len(reqs))
        await op.sadd(self.keys.released_ids(step), [rq.request_id for rq in reqs]).execute()

    async def released_ids(self, step: int) -> set[str]:
        return {as_str(x) for x in await self.r.smembers(self.keys.released_ids(step))}

    async def released_count(self, step: int) -> int:
        """Requests of ``step`` released so far (final once the step's counts are all final)."""
        return int(await self.r.get(self.keys.released(step)) or 0)

    async def finished(self, step: int) -> int:
        """Requests of ``step`` whose sample was published (the workers' counter)."""
        return int(await self.r.get(self.keys.finished(step)) or 0)

    async def publish_sample(self, sample: Sample, request_entry: str, origin: str = "") -> None:
        """The request acknowledged, and its sample out and counted in ``finished:k``, atomically.

        A request's sample goes out at most once (``finished:k:ids`` holds its entry id, or for a
        continuation its ``origin``, segment 0's entry id): a retry whose first reply was lost, a
        request redone after it was reclaimed, or one segment of a migrated request finished twice
        adds nothing.
        """
        k = self.keys
        op = self.once(sample.step).xack(k.requests, Groups.ROLLOUT, [request_entry])
        op.cmd("SADD", k.finished_ids(sample.step), origin or request_entry, mode="g")
        op.xadd(self.sample_stream(sample.group_id), self.encode(sample))
        await op.cmd("INCRBY", k.finished(sample.step), 1).execute()

    async def tool_results(self, step: int, call: str) -> list[list[Any]] | None:
        """The results recorded for an episode's call ``call`` (``<origin>:<index>``), or None."""
        raw = await self.r.hget(self.keys.tool_calls(step), call)
        return None if raw is None else list(json.loads(raw))

    async def record_tool_results(self, step: int, call: str, results: list[list[Any]]) -> None:
        """Record a call's results before the episode goes on with them (one HSET: a redo of the
        episode reads them back; a worker killed before this line calls the tool again)."""
        await self.r.hset(self.keys.tool_calls(step), call, json.dumps(results))

    async def migrate(self, request_entry: str, cont: RolloutRequest) -> str:
        """Put a preempted request back on ``requests`` as its continuation ``cont``, once.

        In one script run (``MIGRATE_LUA``): ``request_entry`` acknowledged, ``cont`` added (only
        if the request is not finished and this entry was never migrated), and counted
        (``migrations``, ``migrated_tokens``).  Either the entry is still pending (its worker was
        killed before this ran: it is reclaimed and redone from its own prefix) or its continuation
        is on ``requests``, never both or neither.  Workers blocked on ``requests`` are idle, and
        Redis hands the continuation to one of them at once.  Returns the continuation's entry id,
        or ``""`` when nothing was put back (the request was done already).
        """
        k, step = self.keys, cont.step
        keys = [k.ops(step), k.requests, k.migrated(step), k.finished_ids(step), k.stats]
        one_slot(k, keys)
        token, payload = uuid.uuid4().hex, self.encode(cont)
        args: list[str | bytes | int] = [token, Groups.ROLLOUT, request_entry, cont.origin, payload, step,
                                         len(cont.prefix_ids), self.maxlen]  # fmt: skip
        out = as_str(await self.r.eval(MIGRATE_LUA, len(keys), *keys, *args))
        if out != "0":
            metrics.BROKER_EVENTS.labels(self.role, "migrations").inc()
        return "" if out == "0" else out

    # ------------------------------------------------ allocations

    async def write_allocation(self, alloc: Allocation) -> None:
        """The decision on record (``alloc:k``), its news to the aggregator, and a close mark: together,
        once."""
        raw = self.encode(alloc)
        op = self.once(alloc.step).cmd("HSET", self.keys.alloc(alloc.step), alloc.group_id, raw)
        op.xadd(self.sample_stream(alloc.group_id), raw)
        if alloc.status in ("closed", "skipped"):
            op.cmd("SADD", self.keys.closed(alloc.step), alloc.group_id)
        await op.execute()

    async def allocations(self, step: int) -> dict[str, Allocation]:
        raw: Any = await self.r.hgetall(self.keys.alloc(step))
        return {as_str(k): self.codec.decode_as(v, Allocation) for k, v in (raw or {}).items()}

    async def closed_groups(self, step: int) -> set[str]:
        """Group ids of ``step`` that were closed or skipped."""
        return {as_str(x) for x in await self.r.smembers(self.keys.closed(step))}

    # ------------------------------------------------ groups: sealed, emitted, consumed

    async def seal(self, seal: StepSeal) -> None:
        await self.publish(self.keys.groups, seal)

    async def emitted_count(self, step: int) -> int:
        return int(await self.r.scard(self.keys.emitted(step)))

    async def emitted_ids(self, step: int) -> set[str]:
        return {as_str(x) for x in await self.r.smembers(self.keys.emitted(step))}

    async def emit_group(self, group: Group, stats: GroupStats, entry_ids: Sequence[str]) -> bool:
        """Group to the trainer, its stats to the controller, its entries acknowledged: atomically.

        The group goes out only if its id is new in ``emitted:k``.  False when another call emitted
        it before (a duplicate); its entries are acknowledged anyway.  True when this call emitted
        it, also when that first attempt's reply was lost and redis-py sent it again.
        """
        return await self.emit_op(group, stats, entry_ids).execute() == "1"

    def emit_op(
        self,
        group: Group,
        stats: GroupStats,
        entry_ids: Sequence[str],
        raw_samples: Sequence[bytes | None] | None = None,
    ) -> Once:
        """The write of :meth:`emit_group`, to run alone or with others (:meth:`execute_all`).

        ``raw_samples``: the samples' bytes as they arrived, spliced into the group unencoded.
        """
        k = self.keys
        op = self.once(group.step).xack(
            self.sample_stream(group.group_id), Groups.AGGREGATOR, list(entry_ids)
        )
        op.cmd("SADD", k.emitted(group.step), group.group_id, mode="g")
        raw = self.encode(group) if raw_samples is None else self.codec.encode_group(group, raw_samples)
        return op.xadd(k.groups, raw).xadd(k.feedback, self.encode(stats))

    async def emitted_among(self, pairs: Sequence[tuple[int, str]]) -> list[bool]:
        """For each (step, group id): is it in ``emitted:step``?  One round trip."""
        if not pairs:
            return []
        pipe = self.r.pipeline(transaction=False)
        for step, gid in pairs:
            pipe.sismember(self.keys.emitted(step), gid)
        return [bool(x) for x in await pipe.execute()]

    async def consumed(self, step: int) -> set[str]:
        return {as_str(m) for m in await self.r.smembers(self.keys.consumed(step))}

    async def commit_consumed(self, step: int, group_ids: Sequence[str], entry_ids: Sequence[str]) -> None:
        """The step's groups recorded as consumed and their entries acknowledged, together.

        One ``ONCE_LUA`` run (one slot, so it runs on a cluster too, where redis-py's client would
        need a transaction of its own); both commands are idempotent, so a resend is harmless anyway.
        """
        if not group_ids and not entry_ids:
            return
        op = self.once(step).sadd(self.keys.consumed(step), list(group_ids))
        await op.xack(self.keys.groups, Groups.TRAINER, list(entry_ids)).execute()

    # ------------------------------------------------ heartbeats

    async def heartbeat(self, worker: str, info: dict[str, Any], ttl_s: int) -> None:
        """The worker's TTL key, and its id in the run's ``workers`` registry (no SCAN finds it).

        The key's TTL (the server's clock) says whether the worker lives; the registry only lists
        ids to look at, scored by this host's idea of the expiry time so that ids of workers dead
        long ago (``REGISTRY_GRACE_S``, far beyond any clock skew) are dropped from it.
        """
        now = time.time()
        await self.r.zadd(self.keys.workers, {worker: now + ttl_s})
        await self.r.set(self.keys.heartbeat(worker), json.dumps(info).encode(), ex=ttl_s)
        await self.r.zremrangebyscore(self.keys.workers, "-inf", now - REGISTRY_GRACE_S)

    async def drop_heartbeat(self, worker: str) -> None:
        await self.r.delete(self.keys.heartbeat(worker))
        await self.r.zrem(self.keys.workers, worker)

    async def live_workers(self) -> list[dict[str, Any]]:
        """The heartbeat records of live workers (their keys expire with the worker)."""
        out = []
        for _wid, raw in await live_heartbeats(self.r, self.keys):
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    async def capacity(self) -> int:
        """Sum of live workers' engine slots."""
        total = 0
        for w in await self.live_workers():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                total += int(w["capacity"])
        return total

    async def kv_tokens(self) -> int:
        """Sum of live workers' KV caches in tokens; 0 if any of them reports none (an engine
        without a limit, or one that does not know it): then no policy may count on a limit."""
        total = 0
        for w in await self.live_workers():
            try:
                kv = int(w.get("kv_tokens", 0))
            except (ValueError, TypeError):
                kv = 0
            if kv <= 0:
                return 0
            total += kv
        return total

    # ------------------------------------------------ the controller's prompt history

    async def prompt_history(self) -> dict[int, list[list[Any]]]:
        raw: Any = await self.r.hgetall(self.keys.prompt_history)
        return {int(as_str(k)): json.loads(v) for k, v in (raw or {}).items()}

    async def prompt_cursor(self, step: int) -> int | None:
        """The dataset-stream position where ``step`` starts, if the last step that ended set it for
        ``step`` (a policy that draws from the stream, ``Policy.stream``)."""
        raw = await self.r.get(self.keys.prompt_cursor)
        if raw is None:
            return None
        k, _, pos = as_str(raw).partition(":")
        return int(pos) if int(k) == step else None

    async def set_prompt_cursor(self, step: int, position: int) -> None:
        await self.r.set(self.keys.prompt_cursor, f"{step}:{position}")

    async def record_step_rollouts(self, step: int, n: int) -> int:
        """Step ``step`` released ``n`` requests (idempotent); returns every recorded step's total."""
        await self.r.hset(self.keys.step_rollouts, str(step), n)
        return sum(int(v) for v in await self.r.hvals(self.keys.step_rollouts))

    async def save_prompt_history(self, records: dict[int, list[tuple[Any, ...]]]) -> None:
        """Each prompt's records, replaced (a prompt's list is as long as its policy keeps)."""
        if records:
            await self.r.hset(
                self.keys.prompt_history, mapping={str(k): json.dumps(v) for k, v in records.items()}
            )


async def live_heartbeats(r: aioredis.Redis, keys: Keys) -> list[tuple[str, bytes]]:
    """``(worker id, heartbeat record)`` of each live worker: the ids in ``workers`` scored within
    ``REGISTRY_GRACE_S`` of now, and one MGET of their keys (all in the run's slot)."""
    ids = [as_str(w) for w in await r.zrangebyscore(keys.workers, time.time() - REGISTRY_GRACE_S, "+inf")]
    if not ids:
        return []
    raws = await r.mget([keys.heartbeat(w) for w in ids])
    return [(w, as_bytes(raw)) for w, raw in zip(ids, raws, strict=True) if raw]


def live_heartbeats_sync(r: redis.Redis, keys: Keys) -> list[tuple[str, bytes, int]]:
    """``live_heartbeats`` for a blocking client, with each key's TTL (seconds) as well."""
    ids = [as_str(w) for w in r.zrangebyscore(keys.workers, time.time() - REGISTRY_GRACE_S, "+inf")]
    out: list[tuple[str, bytes, int]] = []
    if not ids:
        return out
    raws: Any = r.mget([keys.heartbeat(w) for w in ids])
    for w, raw in zip(ids, raws, strict=True):
        if raw:
            ttl = int(r.ttl(keys.heartbeat(w)))
            if ttl != -2:  # expired since MGET
                out.append((w, as_bytes(raw), ttl))
    return out
