"""The follower of runs' ``control`` streams: the trainer's :class:`StepMetrics`, one per trained step.

``rolloutpipe run`` (``launch/cluster.py``) follows its run's stream to count the steps trained and
draw its progress bar, a shared pool's launcher (``launch/pool.py``) follows every run's to know
when each has trained its steps, and the tests read it to check what the trainer reported.  The
stream also carries the controller's plans and the trainer's policy versions; the follower passes
over those.  It reads with ``XREAD`` only (no consumer group), so it moves no role's offsets.

An entry that does not decode is never passed over in silence: :meth:`ControlFollower.poll` raises
:class:`CodecError` with the stream and the entry's id, and its cursor is then past that entry, so
a caller that knows why it may go on (the controller dead-letters a bad control entry, and the run
carries on) says so and polls again from the next entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import Event, StepMetrics
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.errors import CodecError

PAGE = 512  # entries per XREAD of drain()


class ControlFollower:
    """The StepMetrics on the ``control`` streams of ``runs``, after ``after`` (an entry id)."""

    def __init__(self, r: redis.Redis, runs: Iterable[str], *, after: str = "0-0") -> None:
        self.r = r
        self._run = {Keys(run).control: run for run in runs}
        self.cursor = dict.fromkeys(self._run, after)  # stream key -> the last entry id read

    def poll(self, block_ms: int | None = 200, count: int = 100) -> list[tuple[str, StepMetrics]]:
        """One ``XREAD`` (waiting up to ``block_ms`` for a new entry; ``None``: not at all): the
        StepMetrics among the new entries, each with its run, in stream order.

        Raises :class:`CodecError` for an entry that does not decode; the metrics before it in
        the same read are returned first, and the next call raises for it."""
        resp: Any = self.r.xread(self.cursor, count=count, block=block_ms)  # type: ignore[arg-type]
        found: list[tuple[str, StepMetrics]] = []
        for stream, items in resp or []:
            key = _s(stream)
            for eid, fields in items:
                try:
                    ev = _decode(key, _s(eid), fields)
                except CodecError:
                    if found:  # the cursor stays before the bad entry: the next poll meets it first
                        return found
                    self.cursor[key] = _s(eid)
                    raise
                self.cursor[key] = _s(eid)
                if isinstance(ev, StepMetrics):
                    found.append((self._run[key], ev))
        return found

    def drain(self) -> Iterator[tuple[str, StepMetrics]]:
        """Every StepMetrics written so far, in stream order; it never waits for a new one."""
        while True:
            before = dict(self.cursor)
            yield from self.poll(block_ms=None, count=PAGE)
            if self.cursor == before:
                return


def _decode(key: str, eid: str, fields: dict[bytes, bytes]) -> Event:
    raw = fields.get(DATA)
    try:
        if raw is None:
            raise CodecError(f"no {DATA.decode()!r} field")
        return DEFAULT_CODEC.decode(raw)
    except CodecError as e:
        raise CodecError(f"{key} entry {eid}: {e}") from e


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
