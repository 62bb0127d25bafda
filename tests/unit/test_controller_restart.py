"""A controller killed between a pilot's completion and its commit decision takes the decision once.

The controller's consumer has read the pilot's ``GroupStats`` but written nothing (the state a
SIGKILL leaves: the entry is pending, no ``Allocation`` exists).  A restarted controller must find
the pending report, commit the group exactly once, and a third controller must get back the
rewards the decision was taken on, without deciding again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from rolloutpipe.broker.events import GroupStats
from rolloutpipe.broker.keys import Groups
from rolloutpipe.broker.streams import Broker
from rolloutpipe.roles.controller import Controller
from tests.support.config import EMULATED_FAST, make_config


async def _until(cond, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_controller_killed_between_pilot_and_commit_commits_once(
    tmp_path: Path, run_name: str, broker: Broker
) -> None:
    cfg = make_config(
        tmp_path, run_name, *EMULATED_FAST,
        "controller.policy=pilot-commit", 'controller.policy_args={"n_pilot": 2, "pool": 1}',
        "controller.prompts_per_step=2", "controller.minibatches=1", "controller.group_size=4",
        "controller.fgd_slack=8",  # no workers here: let the pilots out at once
    )  # fmt: skip
    k = broker.keys
    first = Controller(cfg, broker)
    stop1 = asyncio.Event()
    t1 = asyncio.create_task(first.release_step(0, stop1))
    await _until(lambda: broker.released_count(0), "the pilots' release")
    await _until(lambda: _released(broker, 4), "both pilots released")
    stop1.set()
    await asyncio.wait_for(t1, 10)
    plan = await broker.plan(0)
    assert plan is not None and [(g.n, g.final) for g in plan.groups] == [(2, False), (2, False)]

    # group 0's pilot completes with signal; the controller reads the report and dies before deciding
    stats = GroupStats(
        run=run_name, step=0, policy_version=0, group_id="0:0", prompt_index=plan.groups[0].prompt_index,
        n=2, rewards=np.array([1.0, 0.0], np.float32), lengths=np.array([3, 5], np.int32),
        truncated=0, emitted=False, created_at=time.time(),
    )  # fmt: skip
    await broker.publish(k.feedback, stats)
    got = await broker.read_feedback("controller", block_ms=100)
    assert len(got) == 1 and await broker.allocations(0) == {}

    second = Controller(cfg, broker)
    stop2 = asyncio.Event()
    t2 = asyncio.create_task(second.release_step(0, stop2))
    await _until(lambda: _has_alloc(broker, "0:0"), "the commit decision")
    await _until(lambda: _released(broker, 6), "the committed samples' release")
    stop2.set()
    await asyncio.wait_for(t2, 10)
    a = (await broker.allocations(0))["0:0"]
    assert (a.n, a.final, a.status, a.counts, a.revision, a.completed) == (4, True, "final", [2, 4], 1, 2)
    assert a.rewards.tolist() == [1.0, 0.0] and a.lengths.tolist() == [3, 5]
    assert int((await broker.r.xpending(k.feedback, Groups.CONTROLLER))["pending"]) == 0
    ids = sorted(await broker.released_ids(0))
    assert ids == ["0:0:0", "0:0:1", "0:0:2", "0:0:3", "0:1:0", "0:1:1"]  # each request once

    # a third controller gets the decision and its rewards back, and does not decide again
    third = Controller(cfg, broker)
    view = third.view_of(plan)
    await third.restore(0, view)
    g = view.groups["0:0"]
    assert (g.target, g.status, g.completed, g.rewards.tolist()) == (4, "final", 2, [1.0, 0.0])
    stop3 = asyncio.Event()
    t3 = asyncio.create_task(third.release_step(0, stop3))
    await asyncio.sleep(0.5)
    stop3.set()
    await asyncio.wait_for(t3, 10)
    assert (await broker.allocations(0))["0:0"].revision == 1
    assert sorted(await broker.released_ids(0)) == ids


async def _released(broker: Broker, n: int) -> bool:
    return len(await broker.released_ids(0)) >= n


async def _has_alloc(broker: Broker, gid: str) -> bool:
    return gid in await broker.allocations(0)
