"""The emulated engine's queue order (``scheduling_policy``) and its prefill accounting."""

from __future__ import annotations

import asyncio
import time

import pytest

from rolloutpipe.broker.events import RolloutRequest
from rolloutpipe.config import EmulatedEngineConfig
from rolloutpipe.engines.emulated import EmulatedEngine


def req(i: int, priority: int) -> RolloutRequest:
    return RolloutRequest(run="t", step=0, policy_version=0, request_id=f"0:{i}:0", group_id=f"0:{i}",
                          prompt_index=i, sample_index=0, prompt="1+1=", answer="2", seed=i,
                          max_new_tokens=8, priority=priority, released_at=time.time())  # fmt: skip


async def finish_order(policy: str) -> list[int]:
    """One slot; request 0 runs, 1..4 queue with priorities 4, 3, 2, 1."""
    cfg = EmulatedEngineConfig(max_num_seqs=1, decode_base_s=0.001, decode_per_seq_s=0.0,
                               prefill_per_token_s=0.0, length_median=20, length_sigma=0.0,
                               max_response_tokens=20, time_scale=0.05, scheduling_policy=policy)  # fmt: skip
    eng = EmulatedEngine(cfg)
    await eng.start()
    order: list[int] = []

    async def one(i: int, prio: int) -> None:
        await eng.generate(req(i, prio))
        order.append(i)

    tasks = [asyncio.create_task(one(0, 9))]
    await asyncio.sleep(0.01)  # request 0 is running
    tasks += [asyncio.create_task(one(i, 5 - i)) for i in range(1, 5)]
    await asyncio.gather(*tasks)
    await eng.close()
    return order


async def test_priority_admits_the_lowest_value_first_and_fcfs_by_arrival() -> None:
    assert await finish_order("priority") == [0, 4, 3, 2, 1]
    assert await finish_order("fcfs") == [0, 1, 2, 3, 4]


async def test_an_interrupted_prefill_is_still_paid() -> None:
    """Arrivals every few ms interrupt the batch's prefill: the total time still includes every
    request's prefill (before, an interruption forgave the rest of it)."""
    prefill_s, n = 0.2, 4
    cfg = EmulatedEngineConfig(max_num_seqs=8, decode_base_s=0.001, decode_per_seq_s=0.0,
                               prefill_per_token_s=prefill_s / 256, prompt_tokens=256, length_median=10,
                               length_sigma=0.0, max_response_tokens=10, time_scale=0.1)  # fmt: skip
    eng = EmulatedEngine(cfg)
    await eng.start()
    t0 = time.monotonic()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(eng.generate(req(i, 0))))
        await asyncio.sleep(0.002)
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    await eng.close()
    assert wall >= (n * prefill_s + 10 * 0.001) * 0.1 * 0.99
    assert wall == pytest.approx(n * prefill_s * 0.1, rel=0.5)
