"""Lost replies: a write that Redis executed but whose reply never came back is retried by redis-py
(``connect``'s ``Retry``); the retry must not apply it twice.

Every role's Redis writes go through ``tests/support/faultproxy.py``, a TCP proxy that loses replies after
Redis ran the command.

1. Per Broker write: the proxy loses the reply of exactly the next ``EXEC``/``EVALSHA`` (dropped,
   or cut mid-reply), the write is retried, and a direct client finds its effect applied once.
2. End to end: a run on the emulated engine and trainer, each role's connection through its own
   proxy dropping, cutting and delaying replies at random (seeded): every planned group trained
   once, no sample, group, counter or control entry applied twice, and no step stalls.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from rolloutpipe.broker import once
from rolloutpipe.broker.codec import DEFAULT_CODEC, iter_events
from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.events import (
    Group,
    PolicyVersion,
    Sample,
    StepMetrics,
    StepPlan,
)
from rolloutpipe.broker.keys import DATA, Groups, Keys, as_str
from rolloutpipe.broker.streams import Broker
from tests.support.config import make_config
from tests.support.events import group, plan, request, sample, stats, version
from tests.support.faultproxy import FaultProxy
from tests.support.writes import WRITES, pending, pending_entry

RUN_ID = "x"  # placeholder; each test has its own run name


@pytest.fixture()
async def proxy(redis_server: EmbeddedRedis) -> AsyncIterator[FaultProxy]:
    async with FaultProxy("127.0.0.1", redis_server.port) as p:
        yield p


@pytest.fixture()
async def faulty(proxy: FaultProxy, run_name: str, ar: aioredis.Redis) -> AsyncIterator[Broker]:
    """A broker whose client goes through the proxy (its scripts already loaded: a first EVALSHA's
    NOSCRIPT reply is not the reply under test)."""
    for name in dir(once):
        if name.endswith("_LUA"):
            await ar.script_load(getattr(once, name))
    r = connect(proxy.url)
    yield Broker(r, run_name, "test")
    await r.aclose()


# ------------------------------------------------------------------------------------ 1. per write


@pytest.mark.parametrize("kind", ["drop", "cut"])
@pytest.mark.parametrize("write", sorted(WRITES))
async def test_a_write_whose_reply_is_lost_is_applied_once(
    write: str, kind: str, proxy: FaultProxy, faulty: Broker, ar: aioredis.Redis
) -> None:
    """Catches: a MULTI or script that Redis ran, whose reply was lost, applied again by the retry
    (a sample, request, dead letter, control entry or group twice; a counter counted twice)."""
    commands = ("EXEC", "EVALSHA", "XADD", "HINCRBY")  # a MULTI, a script, or a lone write
    proxy.lose_next(commands, kind)
    check = await WRITES[write](faulty, ar, faulty.keys)
    assert proxy.armed == 0 and proxy.count(kind, commands) == 1, proxy.faults  # really lost once
    await check()


async def test_the_proxy_loses_replies_of_executed_commands(proxy: FaultProxy, ar: aioredis.Redis) -> None:
    """The proxy itself: a plain INCR whose reply is dropped has run once, and is run again by the
    retry (the repeat the writes above must survive); a delayed reply arrives."""
    key = f"rp:{{t{uuid.uuid4().hex[:8]}}}:n"
    r = connect(proxy.url)
    try:
        proxy.lose_next(["INCRBY"])  # redis-py sends INCR as INCRBY
        assert await r.incr(key) == 2  # executed, reply lost, executed again
        assert await ar.get(key) == b"2"
        proxy.rates = {"delay": 1.0}
        assert await r.incr(key) == 3
        assert proxy.count("drop", ["INCRBY"]) == 1 and proxy.count("delay") >= 1
    finally:
        await r.aclose()


# ------------------------------------------------------------------------------------ 2. end to end

E2E_STEPS = 6
E2E_SEED = int(os.environ.get("RP_LOST_REPLIES_SEED", "15"))
# per reply, on every connection of every role: lost after Redis ran the command, cut mid-way, late
E2E_RATES = {"drop": 0.02, "cut": 0.02, "delay": 0.04}
WRITES_SENT_AS = ("EVALSHA", "EXEC")  # every role write is a script (ONCE_LUA) or a MULTI
WRITE_RATES = {"drop": 0.06, "cut": 0.06, "delay": 0.06}  # the replies this test is about, more often
E2E_TIMEOUT_S = 120.0


@pytest.fixture()
async def acl_server() -> AsyncIterator[tuple[EmbeddedRedis, dict[str, str]]]:
    """A private redis-server with one ACL user per role, as ``rolloutpipe run`` starts it (so the
    roles' scripts also run under the rules of ``acl.py``)."""
    from rolloutpipe.broker import acl
    from rolloutpipe.broker.embedded import find_redis_server, server_major_version

    if server_major_version(find_redis_server()) < 7:
        pytest.skip("role ACL users need redis-server >= 7")
    pw = acl.random_passwords()
    with EmbeddedRedis(extra_args=acl.server_args(pw, admin_password=pw["admin"])) as er:
        yield er, pw


def _decode_all(entries: Any) -> list[Any]:
    return [DEFAULT_CODEC.decode(f[DATA]) for _i, f in entries]


async def test_a_run_through_lost_replies_trains_every_group_once(
    tmp_path: Path, run_name: str, acl_server: tuple[EmbeddedRedis, dict[str, str]]
) -> None:
    """Catches: any role's write applied twice when its reply is lost (a request, sample, group,
    dead letter, plan, version or metrics entry twice; ``finished:k``, ``released:k`` or a counter
    off), a read whose reply was lost leaving its entries unseen for good (a step that stalls), and
    anything the retries cannot get through (a role that dies)."""
    from rolloutpipe.broker import acl
    from rolloutpipe.roles.aggregator import run_aggregator
    from rolloutpipe.roles.controller import run_controller
    from rolloutpipe.roles.rollout import run_rollout
    from rolloutpipe.roles.trainer.trainer import run_trainer
    from tests.support.config import EMULATED_FAST, make_config

    er, pw = acl_server
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST, "controller.mode=cgp-fgd",
                      f"controller.steps={E2E_STEPS}", "trainer.record_groups=true",
                      "redis.trim=false")  # fmt: skip  # the audit reads whole streams
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    B, G = cfg.controller.prompts_per_step, cfg.controller.group_size
    roles = ["controller", "aggregator", "trainer", *(f"rollout-{i}" for i in range(cfg.rollout.workers))]
    rng = random.Random(E2E_SEED)
    proxies = {
        name: await FaultProxy(
            "127.0.0.1",
            er.port,
            seed=rng.randrange(2**32),
            rates=E2E_RATES,
            command_rates=dict.fromkeys(WRITES_SENT_AS, WRITE_RATES),
        ).start()
        for name in roles
    }

    def url(name: str) -> str:
        user = name.split("-")[0]
        return acl.user_url(proxies[name].url, user, pw[user])

    stop = asyncio.Event()
    tasks = {
        "controller": run_controller(cfg, url("controller"), run_name, stop),
        "aggregator": run_aggregator(cfg, url("aggregator"), run_name, stop),
        "trainer": run_trainer(cfg, url("trainer"), run_name, out, stop),
        **{
            f"rollout-{i}": run_rollout(cfg, url(f"rollout-{i}"), run_name, stop, f"{run_name}-w{i}")
            for i in range(cfg.rollout.workers)
        },
    }
    t0 = time.monotonic()
    running = {asyncio.ensure_future(c): name for name, c in tasks.items()}
    try:
        done, pending_ = await asyncio.wait(running, timeout=E2E_TIMEOUT_S,
                                            return_when=asyncio.FIRST_EXCEPTION)  # fmt: skip
        wall = time.monotonic() - t0
        for t in done:
            if t.exception() is not None:
                raise AssertionError(f"{running[t]} failed") from t.exception()
        assert not pending_, (
            f"stalled after {wall:.0f}s: {sorted(running[t] for t in pending_)} still running"
        )
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)
        for p in proxies.values():
            await p.close()

    faults = Counter[tuple[str, str]]()
    for p in proxies.values():
        faults.update(p.faults)
    by_kind = {k: sum(n for (kk, _c), n in faults.items() if kk == k) for k in E2E_RATES}
    on_writes = {k: sum(n for (kk, c), n in faults.items() if kk == k and c in WRITES_SENT_AS)
                 for k in E2E_RATES}  # fmt: skip
    per_role = {name: sum(p.faults.values()) for name, p in proxies.items()}
    print(
        f"lost replies (seed {E2E_SEED}): {E2E_STEPS} steps in {wall:.1f}s; faults {by_kind}, on writes "
        f"{on_writes}, per role {per_role}, replies {sum(p.replies for p in proxies.values())}"
    )
    print("faults by command:", dict(sorted(faults.items())))
    for kind in E2E_RATES:  # a run that injected nothing proves nothing
        assert by_kind[kind] >= 10 and on_writes[kind] >= 5, (kind, by_kind, on_writes)
    for name, n in per_role.items():
        assert n >= 3, (name, per_role)

    # ---- the audit, through a direct (admin) client
    r = connect(acl.user_url(er.url, "admin", pw["admin"]))
    try:
        k = Keys(run_name)
        planned = {(s, f"{s}:{g}") for s in range(E2E_STEPS) for g in range(B)}
        # the trainer's committed log: every planned group once, each of its samples once
        trained = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
        assert Counter((g.step, g.group_id) for g in trained) == Counter(planned)
        for g in trained:
            assert sorted(s.sample_index for s in g.samples) == list(range(G)), g.group_id
            assert g.policy_version == g.step and all(s.policy_version == g.step for s in g.samples)
        # the streams: every request, sample, group and emitted group's feedback written once
        requests = _decode_all(await r.xrange(k.requests))
        assert Counter(q.request_id for q in requests) == Counter(
            f"{s}:{g}:{i}" for s, g_ in planned for g in [g_.split(":")[1]] for i in range(G)
        )
        samples = _decode_all(await r.xrange(k.samples))
        assert all(isinstance(x, Sample) for x in samples)
        assert max(Counter(x.sample_id for x in samples).values()) == 1
        assert len(samples) == E2E_STEPS * B * G
        groups = [x for x in _decode_all(await r.xrange(k.groups)) if isinstance(x, Group)]
        assert Counter((g.step, g.group_id) for g in groups) == Counter(planned)
        for s in range(E2E_STEPS):  # the FIFO positions 0..B-1, each once
            assert sorted(g.frontier.position for g in groups if g.step == s) == list(range(B))
        emitted_stats = [x for x in _decode_all(await r.xrange(k.feedback)) if x.emitted]
        assert Counter((x.step, x.group_id) for x in emitted_stats) == Counter(planned)
        # control: one plan and one metrics entry per step, one announcement per version
        control = _decode_all(await r.xrange(k.control))
        assert [x.step for x in control if isinstance(x, StepPlan)] == list(range(E2E_STEPS))
        assert [x.step for x in control if isinstance(x, StepMetrics)] == list(range(E2E_STEPS))
        assert [x.policy_version for x in control if isinstance(x, PolicyVersion)] == list(
            range(E2E_STEPS + 1)
        )
        # counters: each request released once and finished once, every group consumed once
        for s in range(E2E_STEPS):
            assert int(await r.get(k.released(s)) or 0) == B * G
            assert int(await r.get(k.finished(s)) or 0) == B * G
            assert await r.scard(k.finished_ids(s)) == B * G
            assert await r.scard(k.emitted(s)) == B
            assert await r.scard(k.consumed(s)) == B
        dlq = _decode_all(await r.xrange(k.dlq))
        st = {kk.decode(): int(v) for kk, v in (await r.hgetall(k.stats)).items()}
        print("stats:", st, "dead letters:", [d.reason for d in dlq])
        assert st.get("dead_letters", 0) == len(dlq)
        assert sum(v for kk, v in st.items() if kk.startswith("dead_letters:")) == len(dlq)
        assert len(dlq) == 0 and st.get("fence_rejections", 0) == 0, [(d.role, d.step, d.reason) for d in dlq]
        for name in ("duplicate_samples", "duplicate_groups", "duplicate_seals"):
            assert st.get(name, 0) == 0, (name, st)
        for grp, stream in ((Groups.ROLLOUT, k.requests), (Groups.AGGREGATOR, k.samples),
                            (Groups.TRAINER, k.groups)):  # fmt: skip
            assert await pending(r, stream, grp) == 0, grp
    finally:
        await r.aclose()


async def test_a_second_call_is_not_a_replay(broker: Broker, ar: aioredis.Redis) -> None:
    """Catches: the once-guard hiding real duplicates from their caller (a group emitted by two calls
    reported new twice), a redone request publishing a second sample or counting twice in
    ``finished:k``, and a step-less write's record that never expires."""
    k = broker.keys
    e = await pending_entry(ar, k.samples, Groups.AGGREGATOR, sample(broker.run))
    assert await broker.emit_group(group(broker.run), stats(broker.run, emitted=True), [e.id]) is True
    assert await broker.emit_group(group(broker.run), stats(broker.run, emitted=True), [e.id]) is False
    assert await ar.xlen(k.groups) == 1
    rq = await pending_entry(ar, k.requests, Groups.ROLLOUT, request(broker.run))
    await broker.publish_sample(sample(broker.run), rq.id)
    await broker.publish_sample(sample(broker.run), rq.id)  # the request redone after a reclaim
    await broker.dead_letter(rq, "dropped late", step=0, ack_group=Groups.ROLLOUT, finished=True)
    assert await ar.xlen(k.samples) == 2  # the group's sample above, and this request's once
    assert await broker.finished(0) == 1 and await ar.xlen(k.dlq) == 1
    await broker.incr("trim_errors")
    (op,) = [key async for key in ar.scan_iter(match=k.op("*"))]
    assert 0 < await ar.ttl(op) <= once.OP_TTL_S


# ----------------------------------------------------------- 3. the trainer's reader after a lost reply


class _Drained:
    """A stop event that reads set once ``queue`` is empty."""

    def __init__(self, queue: asyncio.Queue[Any]) -> None:
        self.queue = queue

    def is_set(self) -> bool:
        return self.queue.empty()


async def _trainer_entries(broker: Broker, ar: aioredis.Redis, n: int) -> list[str]:
    await broker.ensure_group(broker.keys.groups, Groups.TRAINER)
    return [
        as_str(await ar.xadd(broker.keys.groups, {DATA: broker.encode(group(broker.run, 0, f"0:{i}"))}))
        for i in range(n)
    ]


async def test_a_commit_during_a_pending_sweep_never_brings_its_groups_back(
    broker: Broker, ar: aioredis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the race seen once in a healthy run (issue 31), 128 groups at a time in the multiplex
    suite: the reader's sweep of its own pending entries (``XREADGROUP … 0``, which picks up a read
    whose reply was lost) lists step 0's groups; the step's commit acknowledges them and drops them
    from ``queued_ids`` while that reply is on its way; the sweep then took them for never seen and
    queued them again, and step 1's fence dead-lettered groups that were trained.  Here a third
    entry's reply is lost (delivered to the trainer, never seen by its reader), and the commit lands
    exactly inside the sweep's read that picks it up: the lost one is queued, and only it."""
    from rolloutpipe.roles.trainer import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "PENDING_SWEEP_S", 0.0)  # sweep on every round
    t = trainer_module.Trainer(make_config(tmp_path, broker.run), broker, object(), tmp_path)  # type: ignore[arg-type]
    await broker.publish_version(version(broker.run, 1), None)  # step 0's weights are out already
    ids = await _trainer_entries(broker, ar, 2)
    read, sweeps, committed = broker.read, Counter[str](), asyncio.Event()

    async def read_racing_the_commit(*args: Any, **kw: Any) -> list[Any]:
        got = await read(*args, **kw)
        if kw.get("start", ">") == ">" and got and sweeps["lose"]:
            sweeps["lose"] = 0
            return []  # delivered, its reply lost
        if kw.get("start") == "0":
            sweeps["read"] += 1
            if len(got) == 3 and not committed.is_set():
                await t.finish_commit(0, None, ["0:0", "0:1"], ids)  # while the sweep's reply is in flight
                committed.set()
        return got

    pending_ids = broker.pending_ids

    async def counted_pending_ids(*args: Any, **kw: Any) -> list[str]:
        sweeps["listed"] += 1
        return await pending_ids(*args, **kw)

    async def until(done: Callable[[], bool]) -> None:
        while not done():
            await asyncio.sleep(0.01)

    monkeypatch.setattr(broker, "read", read_racing_the_commit)
    monkeypatch.setattr(broker, "pending_ids", counted_pending_ids)
    stop = asyncio.Event()
    reader = asyncio.create_task(t._reader(stop))
    await asyncio.wait_for(until(lambda: t.queue.qsize() >= 2), 30)  # step 0's two groups are in
    sweeps["lose"] = 1
    (lost,) = await _trainer_entries(broker, ar, 1)
    await asyncio.wait_for(committed.wait(), 30)
    await asyncio.wait_for(until(lambda: t.queue.qsize() >= 3), 30)  # the lost one picked up
    listed = sweeps["listed"]
    await asyncio.wait_for(until(lambda: sweeps["listed"] >= listed + 3), 30)  # three sweeps more
    stop.set()
    await asyncio.wait_for(reader, 30)
    queued = [t.queue.get_nowait().entry.id for _ in range(t.queue.qsize())]
    assert sorted(queued) == sorted([*ids, lost])  # each group handed over once: none came back
    assert await pending(ar, broker.keys.groups, Groups.TRAINER) == 1  # the lost one, queued now


async def test_a_trained_group_read_again_in_a_later_step_is_a_duplicate_not_a_fence_rejection(
    broker: Broker, ar: aioredis.Redis
) -> None:
    """Catches: a group of step 0, committed as consumed (its entry acknowledged) but read again
    during step 1 (a lost reply, a sweep), dead-lettered by step 1's fence and counted as a fence
    rejection: it was trained once, on-policy.  A stale group never trained is still rejected, and
    so is another entry reusing the trained group's id (``test_fence``'s forged group)."""
    from rolloutpipe.roles.trainer.step import Intake, Read

    trained, stale = await _trainer_entries(broker, ar, 2)
    entries = await broker.read(broker.keys.groups, Groups.TRAINER, "trainer-0", count=2, block_ms=1)
    await broker.commit_consumed(0, ["0:0"], [trained])  # step 0 trained 0:0 and acknowledged it
    forged = as_str(await ar.xadd(broker.keys.groups, {DATA: broker.encode(group(broker.run, 0, "0:0"))}))
    entries += await broker.read(broker.keys.groups, Groups.TRAINER, "trainer-0", count=1, block_ms=1)
    queue: asyncio.Queue[Read] = asyncio.Queue()
    for e in entries:
        queue.put_nowait(Read(e, DEFAULT_CODEC.decode(e.data), time.time()))  # type: ignore[arg-type]
    intake = Intake(broker, queue, 1, plan(broker.run, 1), record=False)
    assert [g async for g in intake.groups(_Drained(queue))] == []  # type: ignore[arg-type]
    st = {as_str(k): int(v) for k, v in (await ar.hgetall(broker.keys.stats)).items()}
    dlq = [DEFAULT_CODEC.decode(f[DATA]) for _i, f in await ar.xrange(broker.keys.dlq)]
    assert st.get("duplicate_groups") == 1 and st.get("fence_rejections") == 2, st
    assert [d.entry_id for d in dlq] == [stale, forged]  # type: ignore[attr-defined]
    assert await pending(ar, broker.keys.groups, Groups.TRAINER) == 0
