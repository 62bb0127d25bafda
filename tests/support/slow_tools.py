"""A calculator that takes its time, so a worker can be killed while its episodes wait on it.

With ``SLOW_TOOL_MARKS`` set to a folder, each call holds a file ``<pid>-<n>`` there while it
runs: a test sees from outside that a worker is inside a tool call, mid-episode.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

from rolloutpipe.agents.tools import calculator, tool

CALL_S = 1.0
_n = itertools.count()


@tool("The calculator, 1 s a call.", calculator.spec["function"]["parameters"], name="calculator")
async def slow_calculator(expression: str) -> str:
    marks = os.environ.get("SLOW_TOOL_MARKS")
    mark = Path(marks) / f"{os.getpid()}-{next(_n)}" if marks else None
    if mark is not None:
        mark.touch()
    await asyncio.sleep(CALL_S)
    if mark is not None:
        mark.unlink()
    return await calculator(expression=expression)
