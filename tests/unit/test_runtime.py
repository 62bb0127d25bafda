"""The waiting helpers: cancellation always gets through, queue items are never lost."""

from __future__ import annotations

import asyncio

from rolloutpipe.runtime import queue_get, wait_event


async def test_wait_event_returns_on_set_or_timeout_and_is_cancellable() -> None:
    ev = asyncio.Event()
    assert await wait_event(ev, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, ev.set)
    assert await wait_event(ev, 5) is True

    async def loop_until_cancelled() -> None:
        never = asyncio.Event()
        while True:  # a role's sleep loop: must end when its task is cancelled
            await wait_event(never, 0.0001)

    for _ in range(200):  # cancellations racing with timeouts, the case wait_for can swallow on 3.11
        t = asyncio.create_task(loop_until_cancelled())
        await asyncio.sleep(0.0002)
        t.cancel()
        done, _ = await asyncio.wait({t}, timeout=1)
        assert t in done and t.cancelled()


async def test_queue_get_never_loses_an_item() -> None:
    q: asyncio.Queue[int] = asyncio.Queue()
    assert await queue_get(q, 0.01) is None
    got: list[int] = []

    async def producer() -> None:
        for i in range(300):
            await q.put(i)
            await asyncio.sleep(0)

    p = asyncio.create_task(producer())
    while len(got) < 300:
        item = await queue_get(q, 0.0001)  # timeouts race with puts
        if item is not None:
            got.append(item)
    await p
    assert got == list(range(300))
