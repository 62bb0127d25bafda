"""Process plumbing shared by every role: logging (configured once), uvloop, signals, stop keys."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

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


async def wait_for_key(
    r: aioredis.Redis,
    key: str,
    stop: asyncio.Event,
    pred: Callable[[bytes], bool] | None = None,
    poll_s: float = 0.01,
) -> bytes | None:
    """Poll ``key`` until it exists (and satisfies ``pred``); None if ``stop`` is set first."""
    while not stop.is_set():
        v: Any = await r.get(key)
        if v is not None and (pred is None or pred(v)):
            return bytes(v)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    return None
