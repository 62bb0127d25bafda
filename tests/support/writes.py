"""The Broker's writes, one case each, for the lost-reply tests (a proxy, then a Redis Cluster).

Each case (``WRITES[name]``) does one write through the broker under test and returns a check that
reads its effect back with a direct client: applied once, whatever became of the reply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import Allocation, DeadLetter, StepSeal
from rolloutpipe.broker.keys import DATA, Groups, Keys
from rolloutpipe.broker.streams import Broker, Entry
from tests.support.events import group, now, plan, request, sample, stats, step_metrics, version


async def pending_entry(ar: aioredis.Redis, stream: str, group: str, event: Any) -> Entry:
    """``event`` on ``stream``, read (pending) by consumer ``c`` of ``group``."""
    await ar.xgroup_create(stream, group, id="0", mkstream=True)
    eid = await ar.xadd(stream, {DATA: DEFAULT_CODEC.encode(event)})
    await ar.xreadgroup(group, "c", {stream: ">"}, count=1)
    eid = eid.decode()
    return Entry(stream, eid, {DATA: DEFAULT_CODEC.encode(event)})


async def pending(ar: aioredis.Redis, stream: str, group: str) -> int:
    return int((await ar.xpending(stream, group))["pending"])


async def stat(ar: aioredis.Redis, k: Keys, field: str) -> int:
    return int(await ar.hget(k.stats, field) or 0)


# Each case: (write through the faulty broker, check with a direct client).  ``setup`` may prepare
# state (a pending entry) and returns what the write needs.
Write = Callable[[Broker, aioredis.Redis, Keys], Awaitable[Callable[[], Awaitable[None]]]]
WRITES: dict[str, Write] = {}


def case(name: str) -> Callable[[Write], Write]:
    def deco(f: Write) -> Write:
        WRITES[name] = f
        return f

    return deco


@case("publish_sample")  # rollout worker: XADD samples + XACK requests + INCR finished:k
async def _publish_sample(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    e = await pending_entry(ar, k.requests, Groups.ROLLOUT, request(b.run))
    await b.publish_sample(sample(b.run), e.id)

    async def check() -> None:
        assert await ar.xlen(k.samples) == 1
        assert await b.finished(0) == 1
        assert await pending(ar, k.requests, Groups.ROLLOUT) == 0

    return check


@case("release")  # controller: XADD requests x n + INCRBY released:k + SADD released:k:ids
async def _release(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.release(0, [request(b.run, s=s) for s in range(3)])

    async def check() -> None:
        assert await ar.xlen(k.requests) == 3
        assert await b.released_count(0) == 3
        assert len(await b.released_ids(0)) == 3

    return check


@case("write_plan")  # controller: SET plan:k + XADD control
async def _write_plan(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.write_plan(plan(b.run))

    async def check() -> None:
        assert await b.plan(0) is not None
        assert await ar.xlen(k.control) == 1

    return check


@case("publish_version")  # trainer: XADD control (metrics) + SET version + XADD control (version)
async def _publish_version(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.publish_version(version(b.run, 1), step_metrics(b.run, 0))

    async def check() -> None:
        assert await b.version_number() == 1
        kinds = [DEFAULT_CODEC.decode(f[DATA]).kind for _i, f in await ar.xrange(k.control)]
        assert kinds == ["metrics", "policy_version"]

    return check


@case("write_allocation")  # controller: HSET alloc:k + XADD samples + SADD closed:k
async def _write_allocation(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    a = Allocation(run=b.run, step=0, policy_version=0, group_id="0:0", prompt_index=0, n=1, completed=1,
                   final=True, status="closed", initial=2, counts=[2, 1], revision=1,
                   created_at=now())  # fmt: skip
    await b.write_allocation(a)

    async def check() -> None:
        assert await ar.xlen(k.samples) == 1
        assert list(await b.allocations(0)) == ["0:0"]
        assert await b.closed_groups(0) == {"0:0"}

    return check


@case("seal")  # controller: XADD groups (StepSeal)
async def _seal(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.seal(StepSeal(run=b.run, step=0, policy_version=0, n_groups=3, created_at=now()))

    async def check() -> None:
        assert await ar.xlen(k.groups) == 1

    return check


@case("publish_feedback")  # aggregator: XADD feedback (a round of an open group)
async def _publish(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.publish(k.feedback, stats(b.run))

    async def check() -> None:
        assert await ar.xlen(k.feedback) == 1

    return check


@case("emit_group")  # aggregator (Lua): SADD emitted:k + XADD groups + XADD feedback + XACK samples
async def _emit(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    e = await pending_entry(ar, k.samples, Groups.AGGREGATOR, sample(b.run))
    new = await b.emit_group(group(b.run), stats(b.run, emitted=True), [e.id])

    async def check() -> None:
        assert await ar.xlen(k.groups) == 1 and await ar.xlen(k.feedback) == 1
        assert await b.emitted_ids(0) == {"0:0"}
        assert await pending(ar, k.samples, Groups.AGGREGATOR) == 0
        # the caller learns that *its* call wrote the group (else it counts a duplicate group and
        # gives the next group the same frontier position)
        assert new is True

    return check


@case("dead_letter")  # any role: XADD dlq + XACK + HINCRBY counters (+ INCR finished:k)
async def _dead_letter(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    e = await pending_entry(ar, k.requests, Groups.ROLLOUT, request(b.run))
    await b.dead_letter(e, "aborted", step=0, policy_version=0, counter="aborted_requests",
                        ack_group=Groups.ROLLOUT, finished=True)  # fmt: skip

    async def check() -> None:
        assert await ar.xlen(k.dlq) == 1
        ((_i, f),) = await ar.xrange(k.dlq)
        assert DEFAULT_CODEC.decode_as(f[DATA], DeadLetter).reason == "aborted"
        for field in ("dead_letters", "dead_letters:0", "aborted_requests", "aborted_requests:0"):
            assert await stat(ar, k, field) == 1, field
        assert await b.finished(0) == 1
        assert await pending(ar, k.requests, Groups.ROLLOUT) == 0

    return check


@case("dead_letter_no_step")  # a decode failure: no step, no request
async def _dead_letter_no_step(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.dead_letter(None, "garbage", payload=b"\x00")

    async def check() -> None:
        assert await ar.xlen(k.dlq) == 1
        assert await stat(ar, k, "dead_letters") == 1

    return check


@case("incr")  # any role: HINCRBY stats name (+ name:k)
async def _incr(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.incr("discarded_samples", step=0, by=3)

    async def check() -> None:
        assert await stat(ar, k, "discarded_samples") == 3
        assert await stat(ar, k, "discarded_samples:0") == 3

    return check


@case("incr_no_step")
async def _incr_no_step(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    await b.incr("reclaimed_requests", by=2)

    async def check() -> None:
        assert await stat(ar, k, "reclaimed_requests") == 2

    return check


@case("commit_consumed")  # trainer: SADD consumed:k + XACK groups (idempotent as it stands)
async def _commit(b: Broker, ar: aioredis.Redis, k: Keys) -> Callable[[], Awaitable[None]]:
    e = await pending_entry(ar, k.groups, Groups.TRAINER, group(b.run))
    await b.commit_consumed(0, ["0:0"], [e.id])

    async def check() -> None:
        assert await b.consumed(0) == {"0:0"}
        assert await pending(ar, k.groups, Groups.TRAINER) == 0

    return check
