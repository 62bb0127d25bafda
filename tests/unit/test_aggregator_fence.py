"""The aggregator's fence on its own, against the real Redis of the test session.

A worker that was away for a long time comes back with a sample of a step that is trained and
whose per-step keys (``plan:k`` among them) the controller has since trimmed.  That sample is stale
work, and monitoring counts stale work as fence rejections; it is not a malformed entry.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import DeadLetter, GroupPlan, PolicyVersion, Sample, StepPlan
from rolloutpipe.broker.keys import DATA, Groups
from rolloutpipe.broker.streams import Broker
from rolloutpipe.broker.trim import drop_old_steps
from rolloutpipe.roles.aggregator import Aggregator
from tests.support.config import EMULATED_FAST, make_config
from tests.support.events import step_sample


def _sample(run: str, step: int) -> Sample:
    return step_sample(run, step, f"{step}:0", 1, worker="back-from-lunch")


def _plan(run: str, step: int) -> StepPlan:
    return StepPlan(run=run, step=step, policy_version=step, policy="fifo",
                    groups=[GroupPlan(group_id=f"{step}:{g}", prompt_index=g, n=4) for g in range(2)],
                    minibatches=1, groups_per_minibatch=2, created_at=1.0)  # fmt: skip


async def _feed(agg: Aggregator, broker: Broker, *samples: Sample) -> list[str]:
    k = broker.keys
    ids = [(await broker.r.xadd(k.samples, {DATA: DEFAULT_CODEC.encode(s)})).decode() for s in samples]
    entries = await broker.read(k.samples, Groups.AGGREGATOR, "agg-0", count=10, block_ms=10)
    assert [e.id for e in entries] == ids
    for e in entries:
        await agg.on_entry(e)
    return ids


async def test_a_stale_sample_of_a_trimmed_step_is_a_fence_rejection(
    broker: Broker, run_name: str, tmp_path: Path
) -> None:
    k = broker.keys
    keep_steps, trained = 2, 12
    for step in range(trained + 1):  # every step had its plan, as the controller writes it
        await broker.write_plan(_plan(run_name, step))
    pv = PolicyVersion(run=run_name, step=trained, policy_version=trained, path="", sha256={},
                       published_at=time.time())  # fmt: skip
    await broker.publish_version(pv, None)  # steps 0..11 are trained
    assert await drop_old_steps(broker.r, k, trained, keep_steps) > 0  # the controller's trimming
    assert await broker.plan(3) is None and await broker.plan(trained) is not None

    await broker.ensure_group(k.samples, Groups.AGGREGATOR)
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST)
    agg = Aggregator(cfg, Broker(broker.r, run_name, "aggregator"), "agg-0")
    # step 3: trained long ago, plan trimmed; step 20: not reached yet, so no plan either
    ids = await _feed(agg, broker, _sample(run_name, 3), _sample(run_name, 20))

    stats: Any = await broker.r.hgetall(k.stats)
    counts = {f.decode(): int(v) for f, v in stats.items()}
    assert counts.get("fence_rejections") == 1, counts  # the stale one, and only it
    assert counts.get("fence_rejections:3") == 1, counts
    assert "fence_rejections:20" not in counts
    assert counts.get("dead_letters") == 2, counts  # both are dead letters, never silent
    letters = {d.entry_id: d for d in (DEFAULT_CODEC.decode_as(f[DATA], DeadLetter)
                                       for _, f in await broker.r.xrange(k.dlq))}  # fmt: skip
    assert letters[ids[0]].reason == "stale sample: step 3 is already trained"
    assert letters[ids[1]].reason == "no plan for step 20"  # a future step's missing plan stays what it was
    pending: Any = await broker.r.xpending(k.samples, Groups.AGGREGATOR)
    assert pending["pending"] == 0  # both acknowledged with their dead letter
