"""The aggregator handles a read's entries as one batch (issue 13): a fixed number of round trips.

Before, every sample cost a GET of the version and a SISMEMBER of ``emitted:k``, and every group its
own script call: ~3 round trips a sample, which bounded the whole path (docs/benchmark.md, "The
broker path").  These tests count the client's round trips to the real Redis of the session, so
they fail if a per-sample call comes back, and check that batching changed no outcome: every group
emitted once, in order, with the positions one at a time would give, duplicates still caught.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio.client as aclient

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import Group, GroupPlan, PolicyVersion, Sample, StepPlan
from rolloutpipe.broker.keys import DATA, Groups
from rolloutpipe.broker.streams import Broker
from rolloutpipe.roles.aggregator import Aggregator
from tests.support.config import EMULATED_FAST, make_config
from tests.support.events import step_sample

STEP, GROUPS, G = 0, 8, 8


def _sample(run: str, g: int, i: int) -> Sample:
    return step_sample(
        run, STEP, f"{STEP}:{g}", i, sample_id=f"{g}:{i}", prompt_index=g, reward=float((g + i) % 2)
    )


class RoundTrips:
    """Counts what the client sends: one per command, one per pipeline (whatever it holds)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, r: Any) -> None:
        self.n = 0
        cmd = r.execute_command

        async def counted_cmd(*args: Any, **kw: Any) -> Any:
            self.n += 1
            return await cmd(*args, **kw)

        pipe_execute = aclient.Pipeline.execute

        async def counted_pipe(p: Any, *args: Any, **kw: Any) -> Any:
            self.n += 1
            return await pipe_execute(p, *args, **kw)

        monkeypatch.setattr(r, "execute_command", counted_cmd)
        monkeypatch.setattr(aclient.Pipeline, "execute", counted_pipe)


async def _setup(broker: Broker, run: str, tmp_path: Path) -> tuple[Aggregator, list[Any]]:
    k = broker.keys
    plan = StepPlan(run=run, step=STEP, policy_version=STEP, policy="fifo",
                    groups=[GroupPlan(group_id=f"{STEP}:{g}", prompt_index=g, n=G) for g in range(GROUPS)],
                    minibatches=2, groups_per_minibatch=GROUPS // 2, created_at=1.0)  # fmt: skip
    await broker.write_plan(plan)
    pv = PolicyVersion(run=run, step=STEP, policy_version=STEP, path="", sha256={}, published_at=time.time())
    await broker.publish_version(pv, None)
    await broker.ensure_group(k.samples, Groups.AGGREGATOR)
    # samples interleaved across groups, as several workers would publish them
    for i in range(G):
        for g in range(GROUPS):
            await broker.r.xadd(k.samples, {DATA: DEFAULT_CODEC.encode(_sample(run, g, i))})
    entries = await broker.read(k.samples, Groups.AGGREGATOR, "agg-0", count=1000, block_ms=10)
    assert len(entries) == GROUPS * G
    cfg = make_config(tmp_path, run, *EMULATED_FAST)
    return Aggregator(cfg, Broker(broker.r, run, "aggregator"), "agg-0"), entries


async def test_a_batch_of_64_samples_costs_a_fixed_number_of_round_trips(
    broker: Broker, run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agg, entries = await _setup(broker, run_name, tmp_path)
    trips = RoundTrips(monkeypatch, agg.b.r)
    await agg.on_batch(entries)
    # version GET, SISMEMBER pipeline, the plan GET, the plan's allocations (HGETALL), SCARD of
    # emitted:k for the first position, SCRIPT LOAD once, and one pipeline of the 8 emissions:
    # independent of the batch's size (one sample at a time, this was 64 x 2 + 8 + 4)
    assert trips.n == 7, trips.n
    assert agg.groups_emitted == GROUPS

    k = broker.keys
    groups = [DEFAULT_CODEC.decode_as(f[DATA], Group) for _, f in await broker.r.xrange(k.groups)]
    # the order the groups completed in (all in the last round, in dataset order), positions 0..7
    assert [g.group_id for g in groups] == [f"{STEP}:{g}" for g in range(GROUPS)]
    assert [g.frontier.position for g in groups] == list(range(GROUPS))
    assert [g.frontier.minibatch for g in groups] == [0] * 4 + [1] * 4
    assert all(len(g.samples) == G for g in groups)
    pending: Any = await broker.r.xpending(k.samples, Groups.AGGREGATOR)
    assert pending["pending"] == 0  # every sample acknowledged inside its group's script


async def test_a_second_batch_costs_no_more_and_duplicates_are_still_caught(
    broker: Broker, run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agg, entries = await _setup(broker, run_name, tmp_path)
    await agg.on_batch(entries[: GROUPS * G // 2])  # half of every group
    trips = RoundTrips(monkeypatch, agg.b.r)
    await agg.on_batch(entries[GROUPS * G // 2 :])
    # version GET, SCARD (the step's first emission), SCRIPT LOAD (the process's first pipeline),
    # the emissions; no SISMEMBER: every group is held in a partial already
    assert trips.n == 4, trips.n
    assert agg.groups_emitted == GROUPS

    # a redone request's sample for a group already out: acknowledged and counted, not added
    k = broker.keys
    eid = await broker.r.xadd(k.samples, {DATA: DEFAULT_CODEC.encode(_sample(run_name, 3, 5))})
    again = await broker.read(k.samples, Groups.AGGREGATOR, "agg-0", count=10, block_ms=10)
    assert [e.id for e in again] == [eid.decode()]
    trips.n = 0
    await agg.on_batch(again)
    assert trips.n == 1 + 2, trips.n  # version GET; the duplicate's count (one script) and its XACK
    assert await broker.stat("duplicate_samples", step=STEP) == 1
    assert await broker.r.xlen(k.groups) == GROUPS
    pending: Any = await broker.r.xpending(k.samples, Groups.AGGREGATOR)
    assert pending["pending"] == 0


async def test_a_group_another_process_emitted_is_caught_before_it_is_rebuilt(
    broker: Broker, run_name: str, tmp_path: Path
) -> None:
    """A second aggregator (a restart that took over the pending entries) must not rebuild a group
    the first one emitted: the batch's SISMEMBER finds it, and its samples count as duplicates."""
    agg, entries = await _setup(broker, run_name, tmp_path)
    await agg.on_batch(entries)
    k = broker.keys
    await broker.r.xadd(k.samples, {DATA: DEFAULT_CODEC.encode(_sample(run_name, 0, 0))})
    late = await broker.read(k.samples, Groups.AGGREGATOR, "agg-1", count=10, block_ms=10)
    fresh = Aggregator(agg.cfg, Broker(broker.r, run_name, "aggregator"), "agg-1")
    await fresh.on_batch(late)
    assert fresh.partial == {}
    assert await broker.stat("duplicate_samples", step=STEP) == 1
    assert await broker.r.xlen(k.groups) == GROUPS
