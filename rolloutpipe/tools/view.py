"""What ``rolloutpipe tail``, ``status`` and ``dlq`` share: stream names, the
paging, and the compact JSON form of an event.

The operator tools only read a run (``dlq`` also re-queues, on request); each of them connects with
``broker.connect.connect_sync(url, fail_fast=True)``, names a stream as ``broker.keys.STREAMS``
does (``samples:N`` for a samples shard), pages through a stream :data:`PAGE` entries at a time,
and reports a Redis that is down or refuses them with :func:`redis_failure`.

Packed arrays are printed compactly (:func:`compact`): up to ``ARRAY_INLINE`` elements as a list of
numbers (float32 values to 7 significant digits), longer ones as ``{"len": N, "head": [first
ARRAY_HEAD]}``; bytes (a dead letter's payload) as ``{"len": N, "hex": first BYTES_HEAD bytes,
"kind": …}``; NaN and infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (so every line
stays valid JSON).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any

import numpy as np
import redis
from pydantic import BaseModel
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import StepPlan
from rolloutpipe.broker.keys import POOL_STREAMS, STREAMS, Keys
from rolloutpipe.errors import CodecError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
ARRAY_INLINE = 16
ARRAY_HEAD = 8
BYTES_HEAD = 32
PAGE = 512
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)  # what "Redis is unreachable" raises
REDIS_REFUSED = ResponseError  # a wrong password, a missing ACL permission


def redis_url(explicit: str = "") -> str:
    """``--redis-url``, else ``RP_REDIS_URL``, else the local default."""
    return explicit or os.environ.get("RP_REDIS_URL") or DEFAULT_REDIS_URL


def redact(url: str) -> str:
    """``url`` without its password."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def redis_failure(url: str, e: Exception) -> str:
    """One line for an operator: unreachable, or refused (wrong password, missing ACL permission)."""
    if isinstance(e, REDIS_DOWN) and not isinstance(e, AuthenticationError):  # (a ConnectionError)
        return f"cannot reach Redis at {redact(url)}: {e}"
    return f"Redis at {redact(url)} refused: {type(e).__name__}: {e}"


def stream_key(keys: Keys, stream: str) -> str:
    """``samples:N`` names shard N of a run with ``redis.sample_shards`` > 1 (``samples`` is shard 0)."""
    name, _, shard = stream.partition(":")
    if name == "samples" and shard.isdigit() and int(shard) > 0:
        return keys.samples_shard(int(shard))
    if stream not in STREAMS + POOL_STREAMS:
        choices = ", ".join(STREAMS + POOL_STREAMS)
        raise ValueError(f"unknown stream {stream!r}; choose from {choices} (or samples:N)")
    key: str = getattr(keys, stream)
    return key


def stream_name(value: str) -> str:
    """``tail``'s STREAM argument: one of STREAMS, or ``samples:N`` (a samples shard)."""
    try:
        stream_key(Keys("x"), value)
    except ValueError as e:  # argparse shows this message as the error
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def stream_exists(r: redis.Redis, run: str, stream: str) -> bool:
    return bool(r.exists(stream_key(Keys(run), stream)))


def compact(v: Any) -> Any:
    """``v`` (an event, an array, bytes, …) in its JSON-ready compact form (see the module's docstring)."""
    if isinstance(v, BaseModel):
        return {name: compact(getattr(v, name)) for name in type(v).model_fields}
    if isinstance(v, np.ndarray):
        if v.size <= ARRAY_INLINE:
            return _numbers(v)
        return {"len": int(v.size), "head": _numbers(v[:ARRAY_HEAD])}
    if isinstance(v, bytes | bytearray):
        b = bytes(v)
        out: dict[str, Any] = {"len": len(b), "hex": b[:BYTES_HEAD].hex()}
        try:
            out["kind"] = DEFAULT_CODEC.decode(b).kind
        except CodecError:
            out["kind"] = None
        return out
    if isinstance(v, list | tuple):
        return [compact(x) for x in v]
    if isinstance(v, dict):
        return {str(k): compact(x) for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _numbers(a: np.ndarray) -> list[float | str] | list[int]:
    if a.dtype.kind == "f":
        return [float(f"{x:.7g}") if math.isfinite(x) else str(x) for x in a.tolist()]
    return [int(x) for x in a.tolist()]


def plan_sizes(plan: StepPlan) -> str:
    """``G 8`` or ``G 4..12``: the spread of the planned counts."""
    ns = [g.n for g in plan.groups] or [0]
    return f"G {ns[0]}" if min(ns) == max(ns) else f"G {min(ns)}..{max(ns)}"


def as_str(v: Any) -> str:
    """A Redis reply's bytes (a key, an id, a field) as text."""
    return v.decode() if isinstance(v, bytes) else str(v)
