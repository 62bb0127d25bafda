"""Process plumbing shared by every role: logging (configured once), uvloop, signals, waits, closes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis

T = TypeVar("T")
_configured = False


def setup_logging(level: str = "INFO", role: str = "") -> None:
    global _configured
    if _configured:
        return
    _configured = True
    fmt = (
        f"%(asctime)s %(levelname)s %(name)s[{role}] %(message)s"
        if role
        else "%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_async(main: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """Run ``main(stop)`` on uvloop where installed; SIGTERM/SIGINT set ``stop``."""

    async def _wrapped() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    try:
        import uvloop

        return int(uvloop.run(_wrapped()))
    except ImportError:
        return asyncio.run(_wrapped())


async def wait_event(ev: asyncio.Event, timeout: float) -> bool:
    """Wait until ``ev`` is set or ``timeout`` passes; returns whether it is set.

    Used instead of ``asyncio.wait_for(ev.wait(), timeout)``, which on Python 3.11 can swallow a
    cancellation that races with its timeout (fixed in 3.12): a loop sleeping that way may then
    never stop when its task is cancelled.
    """
    if ev.is_set():
        return True
    waiter = asyncio.ensure_future(ev.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return ev.is_set()


async def queue_get(q: asyncio.Queue[T], timeout: float) -> T | None:
    """``q.get()`` with a timeout (None), never losing an item or swallowing a cancellation."""
    with contextlib.suppress(asyncio.QueueEmpty):
        return q.get_nowait()
    getter = asyncio.ensure_future(q.get())
    try:
        await asyncio.wait({getter}, timeout=timeout)
    except asyncio.CancelledError:
        getter.cancel()
        raise
    if getter.done():
        return getter.result()
    getter.cancel()  # a cancelled Queue.get leaves its item in the queue
    await asyncio.wait({getter})  # (an outer cancel still raises here; nothing is swallowed)
    return None if getter.cancelled() else getter.result()  # it may have won the race


async def end_tasks(stop: asyncio.Event, *tasks: asyncio.Task[Any], grace_s: float = 5.0) -> None:
    """End a role's helper loops: set ``stop`` (they all watch it), give them ``grace_s`` to
    return, then cancel what is left.  Never waits forever, so a role always exits."""
    stop.set()
    pending = {t for t in tasks if not t.done()}
    if pending:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=grace_s)


async def close_client(r: aioredis.Redis, timeout_s: float = 5.0) -> None:
    """``r.aclose()``, bounded: a role's exit never hangs on closing its connections."""
    closing = asyncio.ensure_future(r.aclose())
    await asyncio.wait({closing}, timeout=timeout_s)
