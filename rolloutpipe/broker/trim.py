"""Trimming: keep Redis memory bounded over any number of steps.

* ``requests``, ``samples`` and ``groups`` are trimmed (``XTRIM MINID``, exact) below the oldest
  entry a consumer group still needs: its oldest pending entry, else the first entry after its
  last-delivered id.  The minimum is taken over *every* group of the stream, and a stream whose
  downstream group does not exist yet is left alone (the group may still be created at id 0).
* ``control`` is cut to its last ``redis.control_maxlen`` entries (``MAXLEN``, exact); ``dlq``
  keeps the ``redis.maxlen`` of every ``XADD``.
* ``feedback`` (group statistics for the controller) is trimmed the same way.
* Per-step keys (``Keys.step_keys``: plan, emitted, released and its ids, finished and its ids,
  consumed, alloc, closed, and ``ops``, the record of the step's writes applied) older
  than the last ``redis.keep_steps`` are deleted.  Every role reads these keys only for the step
  under way (the trainer's exactly-once check reads ``consumed:k`` of its current step; the
  aggregator's ``emitted:k`` and ``plan:k`` of the sample's step, and a sample of a step that old is
  dead-lettered as a fence rejection, plan or no plan), so two steps would do; the default keeps 8
  for ``rolloutpipe status``.

The controller runs :func:`trim_run` at each new step and at least once a second
(``Controller.trim_loop``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rolloutpipe.broker.keys import Groups, Keys, as_str

log = logging.getLogger("rolloutpipe.broker")

# stream attribute of Keys -> the consumer group that must have acknowledged an entry before it goes
DOWNSTREAM = {
    "requests": Groups.ROLLOUT,
    "samples": Groups.AGGREGATOR,
    "groups": Groups.TRAINER,
    "feedback": Groups.CONTROLLER,
}
MIN_KEEP_STEPS = 2  # the step under way and the one before it (late samples, the trainer's ack)


@dataclass
class TrimResult:
    trimmed: dict[str, int] = field(default_factory=dict)  # stream -> entries removed
    deleted_keys: int = 0


def _id(v: Any) -> tuple[int, int]:
    ms, _, seq = as_str(v).partition("-")
    return int(ms), int(seq or 0)


async def needed_from(r: aioredis.Redis, stream: str, group: str) -> str | None:
    """The smallest id any consumer group of ``stream`` still needs (entries below it may go).

    ``None``: do not trim (no stream, or ``group`` not created yet).  XINFO GROUPS is read before
    XPENDING, so an entry delivered in between has an id above the last-delivered id we saw, and an
    entry acknowledged in between only makes the answer more conservative.
    """
    try:
        groups: Any = await r.xinfo_groups(stream)
    except ResponseError:  # no such key
        return None
    if group not in {as_str(g["name"]) for g in groups}:
        return None
    lowest: tuple[int, int] | None = None
    for g in groups:
        ms, seq = _id(g["last-delivered-id"])
        cand = (ms, seq + 1)  # everything up to last-delivered was handed out
        if int(g["pending"]) > 0:
            p: Any = await r.xpending(stream, g["name"])
            if p and p.get("pending") and p.get("min") is not None:
                cand = min(cand, _id(p["min"]))
        lowest = cand if lowest is None else min(lowest, cand)
    if lowest is None:
        return None
    return f"{lowest[0]}-{lowest[1]}"


async def trim_streams(
    r: aioredis.Redis, keys: Keys, *, control_maxlen: int = 0, sample_shards: int = 1
) -> dict[str, int]:
    out: dict[str, int] = {}
    for attr, group in DOWNSTREAM.items():
        # ``samples`` split across aggregators: each shard's stream against its own consumer group
        streams = keys.sample_streams(sample_shards) if attr == "samples" else [getattr(keys, attr)]
        for stream in streams:
            minid = await needed_from(r, stream, group)
            if minid is None:
                continue
            n = await r.xtrim(stream, minid=minid, approximate=False)
            if n:
                name = attr if stream == getattr(keys, attr) else stream.removeprefix(keys.prefix)
                out[name] = int(n)
    if control_maxlen > 0:
        n = await r.xtrim(keys.control, maxlen=control_maxlen, approximate=False)
        if n:
            out["control"] = int(n)
    return out


async def drop_old_steps(
    r: aioredis.Redis, keys: Keys, current: int, keep_steps: int, window: int = 32
) -> int:
    """Delete the per-step keys of steps ``< current - keep`` (looking back ``window`` steps)."""
    if keep_steps <= 0:
        return 0
    keep = max(keep_steps, MIN_KEEP_STEPS)
    hi = current - keep
    if hi <= 0:
        return 0
    steps = range(max(0, hi - window), hi)
    names = [name for s in steps for name in keys.step_keys(s)]
    return int(await r.delete(*names))


async def trim_run(
    r: aioredis.Redis,
    keys: Keys,
    current_step: int,
    *,
    keep_steps: int,
    control_maxlen: int,
    sample_shards: int = 1,
) -> TrimResult:
    res = TrimResult(await trim_streams(r, keys, control_maxlen=control_maxlen, sample_shards=sample_shards))
    res.deleted_keys = await drop_old_steps(r, keys, current_step, keep_steps)
    if res.trimmed or res.deleted_keys:
        log.debug(
            "trimmed %s, %d old step keys deleted (step %d)", res.trimmed, res.deleted_keys, current_step
        )
    return res
