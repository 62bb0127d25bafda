"""Aggregator scale-out (issue 13): ``samples`` split into ``redis.sample_shards`` streams by group id.

Pinned here, on the real Redis of the session: the routing (every sample and allocation of a group
on one shard, the same in every process), the guard against roles that split differently, the
aggregator's refusal of a sample that reached the wrong shard, trimming of every shard, and the
stream names ``tail`` takes.  ``tests/e2e/test_chaos.py`` SIGKILLs the aggregator of each shard.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import Allocation, DeadLetter, GroupPlan, PolicyVersion, Sample, StepPlan
from rolloutpipe.broker.keys import DATA, Groups, Keys, shard_of
from rolloutpipe.broker.streams import Broker
from rolloutpipe.broker.trim import trim_streams
from rolloutpipe.errors import ConfigError
from rolloutpipe.roles.aggregator import Aggregator
from rolloutpipe.tools.view import stream_key, stream_name
from tests.support.config import EMULATED_FAST, make_config


def _sample(run: str, gid: str, i: int) -> Sample:
    return Sample(
        run=run, step=0, policy_version=0, sample_id=f"{gid}:{i}", request_id=f"{gid}:{i}", group_id=gid,
        prompt_index=0, sample_index=i, worker="w0", prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(4, dtype=np.int32), logprobs=np.zeros(4, dtype=np.float32), reward=1.0,
        admitted_at=1.0, finished_at=2.0,
    )  # fmt: skip


def crc32_reference(data: bytes) -> int:
    """CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320) bit by bit, written from the definition."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_a_group_has_one_shard_the_same_everywhere() -> None:
    # a fixed function of the id, never a process-salted hash(), which would send one group's
    # samples to two aggregators; checked against CRC-32 written out here, and its check value
    assert crc32_reference(b"123456789") == 0xCBF43926  # the standard check value of CRC-32
    for gid in ("0:1", "17:3", "run-b:120:7"):
        for n in (2, 3, 8):
            assert shard_of(gid, n) == crc32_reference(gid.encode()) % n
    assert shard_of("anything", 1) == 0
    spread = [shard_of(f"{s}:{g}", 2) for s in range(4) for g in range(64)]
    assert 0.35 < sum(spread) / len(spread) < 0.65  # both aggregators get a share of every step
    k = Keys("r")
    assert k.sample_streams(3) == ["rp:{r}:samples", "rp:{r}:samples:1", "rp:{r}:samples:2"]


async def test_samples_and_allocations_of_a_group_go_to_its_shard(ar: aioredis.Redis, run_name: str) -> None:
    b = Broker(ar, run_name, "rollout", sample_shards=2)
    k = b.keys
    gids = [f"0:{g}" for g in range(8)]
    for gid in gids:
        await b.publish_sample(_sample(run_name, gid, 0), f"1-{gid[2:]}")
        alloc = Allocation(run=run_name, step=0, policy_version=0, group_id=gid, prompt_index=0, n=2,
                           final=True, status="final", initial=2, revision=1, created_at=1.0)  # fmt: skip
        await b.write_allocation(alloc)
    seen: dict[str, set[str]] = {}
    for i, stream in enumerate(k.sample_streams(2)):
        for _, fields in await ar.xrange(stream):
            ev: Any = DEFAULT_CODEC.decode(fields[DATA])
            assert shard_of(ev.group_id, 2) == i, (ev.group_id, stream)
            seen.setdefault(ev.kind, set()).add(ev.group_id)
    assert seen == {"sample": set(gids), "allocation": set(gids)}
    assert {shard_of(g, 2) for g in gids} == {0, 1}  # the test did exercise both streams


async def test_a_role_that_splits_samples_differently_is_refused(ar: aioredis.Redis, run_name: str) -> None:
    await Broker(ar, run_name, "controller", sample_shards=2).check_shards()
    await Broker(ar, run_name, "aggregator", sample_shards=2).check_shards()  # same: fine
    with pytest.raises(ConfigError, match=r"splits its samples into 2 streams .* started with 3"):
        await Broker(ar, run_name, "rollout", sample_shards=3).check_shards()


async def test_a_sample_on_the_wrong_shard_is_dead_lettered(
    ar: aioredis.Redis, run_name: str, tmp_path: Path
) -> None:
    b = Broker(ar, run_name, "aggregator", sample_shards=2)
    k = b.keys
    gid = next(f"0:{g}" for g in range(16) if shard_of(f"0:{g}", 2) == 0)
    plan = StepPlan(run=run_name, step=0, policy_version=0, policy="fifo",
                    groups=[GroupPlan(group_id=gid, prompt_index=0, n=2)], minibatches=1,
                    groups_per_minibatch=1, created_at=1.0)  # fmt: skip
    await b.write_plan(plan)
    await b.publish_version(
        PolicyVersion(run=run_name, step=0, policy_version=0, path="", sha256={}, published_at=time.time()),
        None,
    )
    wrong = k.samples_shard(1)
    await b.ensure_group(wrong, Groups.AGGREGATOR)
    await ar.xadd(wrong, {DATA: DEFAULT_CODEC.encode(_sample(run_name, gid, 0))})
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST, "redis.sample_shards=2")
    agg = Aggregator(cfg, b, "agg-s1", shards=[1])
    assert agg.streams == [wrong]
    entries = await b.read_streams(agg.streams, Groups.AGGREGATOR, "agg-s1", count=10, block_ms=10)
    await agg.on_batch(entries)
    assert agg.partial == {}
    (dl,) = [DEFAULT_CODEC.decode_as(f[DATA], DeadLetter) for _, f in await ar.xrange(k.dlq)]
    assert dl.reason == f"sample of group {gid} on {wrong}, whose shard is {k.samples}"
    assert (await ar.xpending(wrong, Groups.AGGREGATOR))["pending"] == 0
    with pytest.raises(ConfigError, match=r"aggregator shards \[2\]: the run has shards 0..1"):
        Aggregator(cfg, b, "agg-s2", shards=[2])


async def test_every_shard_is_trimmed_once_acknowledged(ar: aioredis.Redis, run_name: str) -> None:
    k = Keys(run_name)
    for stream in k.sample_streams(3):
        await ar.xgroup_create(stream, Groups.AGGREGATOR, id="0", mkstream=True)
        for _ in range(5):
            await ar.xadd(stream, {DATA: b"x"})
        got: Any = await ar.xreadgroup(Groups.AGGREGATOR, "a", {stream: ">"}, count=3)
        await ar.xack(stream, Groups.AGGREGATOR, *[eid for eid, _ in got[0][1]])
    trimmed = await trim_streams(ar, k, sample_shards=3)
    assert trimmed == {"samples": 3, "samples:1": 3, "samples:2": 3}
    assert [await ar.xlen(s) for s in k.sample_streams(3)] == [2, 2, 2]


def test_tail_takes_a_shard_by_name() -> None:
    k = Keys("r")
    assert stream_key(k, "samples:2") == "rp:{r}:samples:2"
    assert stream_key(k, "samples") == k.samples
    assert stream_name("samples:1") == "samples:1"
    for bad in ("samples:x", "samples:0", "nope"):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
            stream_name(bad)
