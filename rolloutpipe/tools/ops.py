"""Operator tools: ``rolloutpipe tail`` and ``rolloutpipe status``, read-only views of one run.

Both only read (``XREVRANGE``, ``XRANGE``, ``XREAD``, ``XINFO``, ``GET``, ``SCAN``, ``HGETALL``, …):
they never join a consumer group, so they leave no pending entries and move no role's offsets.
This module returns records and strings or writes to a text stream it is given; the CLI
owns the flags, the exit codes and Ctrl-C.

Packed arrays are printed compactly: up to ``ARRAY_INLINE`` elements as a list of numbers (float32
values to 7 significant digits), longer ones as ``{"len": N, "head": [first ARRAY_HEAD]}``; bytes
(a dead letter's payload) as ``{"len": N, "hex": first BYTES_HEAD bytes, "kind": …}``; NaN and
infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (so every line stays valid JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import redis
from pydantic import BaseModel
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import (
    Allocation,
    DeadLetter,
    Event,
    Group,
    GroupStats,
    PolicyVersion,
    RolloutRequest,
    Sample,
    StepMetrics,
    StepPlan,
    StepSeal,
)
from rolloutpipe.broker.keys import DATA, POOL_STREAMS, STREAMS, Groups, Keys, pool_keys, run_keys
from rolloutpipe.broker.state import live_heartbeats_sync
from rolloutpipe.broker.streams import lag_of
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


# ----------------------------------------------------------------------------------------------- tail


@dataclass(frozen=True)
class Decoded:
    """One stream entry: its event, or why it did not decode."""

    stream: str
    id: str
    event: Event | None
    error: str = ""
    raw: bytes = b""


def decode_entry(stream: str, eid: bytes | str, fields: dict[bytes, bytes] | None) -> Decoded:
    sid = _s(eid)
    raw = (fields or {}).get(DATA)
    if raw is None:
        return Decoded(stream, sid, None, f"no {DATA.decode()!r} field: {sorted(map(_s, fields or {}))}")
    try:
        return Decoded(stream, sid, DEFAULT_CODEC.decode(raw), raw=raw)
    except CodecError as e:
        return Decoded(stream, sid, None, str(e), raw)


@dataclass(frozen=True)
class Filter:
    """``--group``, ``--policy-version``, ``--kind``; an undecodable entry is of kind ``error``."""

    group: str | None = None
    policy_version: int | None = None
    kind: str | None = None

    def __call__(self, d: Decoded) -> bool:
        ev = d.event
        if ev is None:
            return self.kind in (None, "error") and self.group is None and self.policy_version is None
        return (
            (self.kind is None or ev.kind == self.kind)
            and (self.policy_version is None or ev.policy_version == self.policy_version)
            and (self.group is None or getattr(ev, "group_id", None) == self.group)
        )


def record(d: Decoded) -> dict[str, Any]:
    """The JSON-ready form of an entry: stream, id, then the event's fields (arrays compacted)."""
    rec: dict[str, Any] = {"stream": d.stream, "id": d.id}
    if d.event is None:
        return {**rec, "error": d.error, "payload": compact(d.raw)}
    out = compact(d.event)
    assert isinstance(out, dict)
    return {**rec, **out}


def compact(v: Any) -> Any:
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


def tail(
    r: redis.Redis,
    run: str,
    stream: str,
    out: TextIO,
    *,
    n: int = 20,
    from_start: bool = False,
    follow: bool = False,
    where: Filter | None = None,
    pretty: bool = False,
    block_ms: int = 1000,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Write the last ``n`` matching entries (every one with ``from_start``), then with ``follow``
    each new one until ``stop()``; one JSON line per entry, or a rendering with ``pretty``.
    Returns how many entries were written."""
    key = stream_key(Keys(run), stream)
    where = where or Filter()
    write = PrettyWriter(out) if pretty else JsonWriter(out)
    written = 0
    if from_start:
        cursor = "0-0"
        for d in _forward(r, key, stream):
            cursor = d.id
            if where(d):
                write(d)
                written += 1
    else:
        newest: Any = r.xrevrange(key, count=1)
        cursor = _s(newest[0][0]) if newest else "0-0"
        for d in last_matching(r, key, stream, n, where, newest=cursor):
            write(d)
            written += 1
    while follow:
        final = stop is not None and stop()  # then read what is left without blocking, and end
        resp: Any = r.xread({key: cursor}, count=PAGE, block=None if final else block_ms)
        for _key, items in resp or []:
            for eid, fields in items:
                d = decode_entry(stream, eid, fields)
                cursor = d.id
                if where(d):
                    write(d)
                    written += 1
        if final and not resp:
            break
    return written


def last_matching(
    r: redis.Redis, key: str, stream: str, n: int, where: Filter, *, newest: str = "+"
) -> list[Decoded]:
    """The last ``n`` entries up to ``newest`` that pass ``where``, oldest first (pages back)."""
    found: list[Decoded] = []
    hi = newest
    while len(found) < n and hi != "0-0":
        page: Any = r.xrevrange(key, max=hi, min="-", count=PAGE)
        for eid, fields in page:
            d = decode_entry(stream, eid, fields)
            if where(d):
                found.append(d)
                if len(found) == n:
                    break
        if len(page) < PAGE:
            break
        hi = "(" + _s(page[-1][0])
    return found[::-1]


def _forward(r: redis.Redis, key: str, stream: str) -> Iterator[Decoded]:
    lo = "-"
    while True:
        page: Any = r.xrange(key, min=lo, max="+", count=PAGE)
        for eid, fields in page:
            yield decode_entry(stream, eid, fields)
        if len(page) < PAGE:
            return
        lo = "(" + _s(page[-1][0])


class JsonWriter:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def __call__(self, d: Decoded) -> None:
        self.out.write(json.dumps(record(d), default=repr) + "\n")
        self.out.flush()  # so `--follow | jq` sees each entry as it comes


class PrettyWriter:
    """One line per entry with ``rich`` (colours on a terminal); plain text where it is missing."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.console: Any = None
        try:
            from rich.console import Console

            self.console = Console(file=out, highlight=False, soft_wrap=True)
        except ImportError:
            pass

    def __call__(self, d: Decoded) -> None:
        segs = pretty_segments(d)
        if self.console is None:
            self.out.write("".join(text for text, _style in segs) + "\n")
            self.out.flush()
            return
        from rich.text import Text

        self.console.print(Text.assemble(*segs))


KIND_STYLE = {
    "request": "cyan",
    "sample": "blue",
    "group": "green",
    "plan": "magenta",
    "policy_version": "magenta",
    "metrics": "yellow",
    "dead_letter": "bold red",
}


def pretty_segments(d: Decoded) -> list[tuple[str, str]]:
    """``(text, rich style)`` pieces of one line: time and id, kind, then what matters per kind."""
    ms = int(d.id.split("-")[0]) if d.id.split("-")[0].isdigit() else 0
    clock = time.strftime("%H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"
    head = [(f"{clock} {d.id:<17} ", "dim")]
    ev = d.event
    if ev is None:
        return [*head, ("error".ljust(15), "bold red"), (f"{d.error}  payload {len(d.raw)} B", "red")]
    segs = [
        *head,
        (f"{ev.kind:<15}", KIND_STYLE.get(ev.kind, "")),
        (f"step {ev.step} v{ev.policy_version}", ""),
    ]
    for text in _details(ev):
        segs.append(("  " + text, "bold" if text.startswith(("frontier", "MIGRATED")) else ""))
    return segs


def _details(ev: Event) -> list[str]:
    if isinstance(ev, RolloutRequest):
        moved = [f"MIGRATED: segment {ev.segment}, resumes after {ev.prefix_ids.size} tok of {ev.origin}"]
        return [
            f"group {ev.group_id} sample {ev.sample_index}",
            *(moved if ev.segment else []),
            f"prompt {ev.prompt!r} answer {ev.answer!r}",
            f"mb_hint {ev.minibatch_hint}",
        ]
    if isinstance(ev, Sample):
        return [
            f"group {ev.group_id} sample {ev.sample_index}",
            f"worker {ev.worker}" + (f" (last of {ev.segments} segments)" if ev.segments > 1 else ""),
            f"reward {ev.reward:g}",
            f"response {ev.response_ids.size} tok ({ev.finish_reason})",
            f"took {ev.finished_at - ev.admitted_at:.3f}s",
        ]
    if isinstance(ev, Group):
        f, a = ev.frontier, ev.allocation
        rewards = np.asarray([s.reward for s in ev.samples], dtype=np.float64)
        return [
            f"group {ev.group_id} prompt {ev.prompt_index}",
            f"{len(ev.samples)} samples ({_alloc_text(a.initial, a.counts, a.status)})",
            f"frontier mb {f.minibatch + 1}/{max(1, f.total_groups // f.minibatch_size)}"
            f" pos {f.position + 1}/{f.total_groups} needs {f.needed} more",
            f"rewards {_short_list(rewards)} mean {rewards.mean() if rewards.size else 0.0:.3f}",
            f"adv {_short_list(ev.advantages, signed=True)}",
            f"versions {sorted({s.policy_version for s in ev.samples})}",
        ]
    if isinstance(ev, StepPlan):
        return [
            f"{ev.policy} {ev.n_groups} groups, {ev.n_requests} samples ({_sizes(ev)})",
            f"{ev.minibatches} mini-batches" + ("" if ev.sealed else ", groups may change"),
        ]
    if isinstance(ev, Allocation):
        return [f"group {ev.group_id} {_alloc_text(ev.initial, ev.counts, ev.status)}",
                f"final {ev.final}" + (f" ({ev.reason})" if ev.reason else "")]  # fmt: skip
    if isinstance(ev, StepSeal):
        return [f"{ev.n_groups} groups for the trainer", f"{len(ev.skipped)} skipped"]
    if isinstance(ev, GroupStats):
        rewards = np.asarray(ev.rewards, dtype=np.float64)
        return [
            f"group {ev.group_id} samples 0..{ev.n - 1} complete" + (" (emitted)" if ev.emitted else ""),
            f"rewards {_short_list(rewards)} mean {rewards.mean() if rewards.size else 0.0:.3f}",
            f"mean length {float(np.mean(ev.lengths)) if len(ev.lengths) else 0.0:.0f} tok",
            f"{ev.truncated} truncated",
        ]
    if isinstance(ev, PolicyVersion):
        return [f"published {_clock(ev.published_at)}", f"{len(ev.sha256)} files {ev.path}".rstrip()]
    if isinstance(ev, StepMetrics):
        return [
            f"reward {ev.reward_mean:.3f}",
            f"rollout_to_train_end {ev.rollout_to_train_end_s:.3f}s",
            f"wait {ev.trainer_wait_ratio:.3f}",
            f"groups {ev.groups} fence {ev.fence_rejections} dlq {ev.dead_letters}",
            f"skipped {ev.groups_skipped} wasted {ev.samples_wasted}"
            + ("" if ev.eval_reward is None else f" held-out {ev.eval_reward:.3f}"),
        ]
    if isinstance(ev, DeadLetter):
        kind = compact(ev.payload)["kind"]
        return [
            f"from {ev.source_stream.rsplit(':', 1)[-1] or '-'} {ev.entry_id or '-'} by {ev.role}",
            f"reason {ev.reason!r}",
            f"payload {len(ev.payload)} B" + (f" ({kind})" if kind else ""),
        ]
    return []


def _alloc_text(initial: int, counts: list[int], status: str) -> str:
    """``8 -> 12 -> 8 closed``: a group's counts, from its plan to its last decision."""
    steps = [str(initial), *(str(c) for c in counts[1:])]
    return " -> ".join(steps) + ("" if status in ("final", "open") else f" {status}")


def _sizes(plan: StepPlan) -> str:
    """``G 8`` or ``G 4..12``: the spread of the planned counts."""
    ns = [g.n for g in plan.groups] or [0]
    return f"G {ns[0]}" if min(ns) == max(ns) else f"G {min(ns)}..{max(ns)}"


def _short_list(a: np.ndarray, signed: bool = False, head: int = 8) -> str:
    fmt = "{:+.2f}" if signed else "{:g}"
    xs = [fmt.format(float(x)) for x in a[:head]]
    return "[" + " ".join(xs) + (" …" if a.size > head else "") + "]"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


# ----------------------------------------------------------------------------------------------- status


def collect_status(r: redis.Redis, run: str, now: float | None = None) -> dict[str, Any]:
    """Everything ``status`` shows, JSON-ready: streams and their consumer groups, live workers,
    the policy version, the current step and its frontier, and the ``stats`` counters."""
    now = time.time() if now is None else now
    k = Keys(run)
    streams = {name: _stream_info(r, getattr(k, name)) for name in STREAMS}
    shards = _int(r.get(k.sample_shards)) or 1  # samples:1.. of a run split across aggregators
    streams.update({f"samples:{i}": _stream_info(r, k.samples_shard(i)) for i in range(1, shards)})
    workers = _workers(r, k, now)
    version = _version(r, k, now)
    step = _current_step(r, k, version)
    stats = {_s(f): int(v) for f, v in r.hgetall(k.stats).items() if _is_int(v)}
    pool = _pool(r, run, workers)
    others = (k.version, k.stats, k.done, *(getattr(k, s) for s in STREAMS))
    return {
        "run": run,
        "time": now,
        "exists": bool(r.exists(*others)) or bool(workers) or step is not None,
        "done": bool(r.exists(k.done)),
        "version": version,
        "step": step,
        "streams": streams,
        "workers": workers,
        "pool": pool,
        "stats": {
            "total": {f: v for f, v in sorted(stats.items()) if ":" not in f},
            "step": {
                f.rsplit(":", 1)[0]: v
                for f, v in sorted(stats.items())
                if step is not None and f.endswith(f":{step['step']}")
            },
        },
    }


def _stream_info(r: redis.Redis, key: str) -> dict[str, Any]:
    groups: list[dict[str, Any]] = []
    try:
        raw: Any = r.xinfo_groups(key)
    except ResponseError:  # no such key: the stream was never written
        raw = []
    for g in raw:
        name = _s(g["name"])
        consumers: Any = r.xinfo_consumers(key, name)
        groups.append(
            {
                "name": name,
                "pending": int(g["pending"]),
                "lag": None if g.get("lag") is None else int(g["lag"]),
                "last_delivered_id": _s(g["last-delivered-id"]),
                "consumers": [
                    {
                        "name": _s(c["name"]),
                        "pending": int(c["pending"]),
                        "idle_s": int(c["idle"]) / 1000,
                        # Redis >= 7.2: since the last successful read (idle counts any attempt)
                        "inactive_s": None if c.get("inactive") in (None, -1) else int(c["inactive"]) / 1000,
                    }
                    for c in consumers
                ],
            }
        )
    return {"key": key, "length": int(r.xlen(key)), "groups": groups}


def _pool(r: redis.Redis, run: str, workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A pool's leases and each run's share (``--run pool:NAME``), or, for a run served by a shared
    pool, how many of the pool's live workers serve it now."""
    if run.startswith("pool:"):
        lease = {_s(w): _s(x) for w, x in r.hgetall(Keys(run).lease).items()}
        live = {w["id"] for w in workers}
        shares: dict[str, int] = {}
        for w, x in sorted(lease.items()):
            if w in live and x:
                shares[x] = shares.get(x, 0) + 1
        return {"name": run.split(":", 1)[1], "members": len(live), "lease": lease, "shares": shares}
    names = {w.get("pool") for w in workers if w.get("pool")}
    if not names:
        return None
    name = sorted(str(n) for n in names)[0]
    members = len(live_heartbeats_sync(r, pool_keys(name)))
    return {"name": name, "members": members, "serving": sum(1 for w in workers if w.get("pool") == name)}


def _workers(r: redis.Redis, k: Keys, now: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for wid, raw, ttl in sorted(live_heartbeats_sync(r, k)):  # the run's registry, no SCAN
        try:
            hb = json.loads(raw)
            fields = (
                "capacity",
                "inflight",
                "version",
                "samples",
                "migrations",
                "pid",
                "host",
                "pool",
                "run",
            )
            info = {f: hb.get(f) for f in fields}
            info["heartbeat_age_s"] = round(now - float(hb["t"]), 3)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            info = {"error": f"bad heartbeat: {e}"}
        out.append({"id": wid, **info, "ttl_s": int(ttl)})
    return out


def _version(r: redis.Redis, k: Keys, now: float) -> dict[str, Any] | None:
    raw: Any = r.get(k.version)
    if raw is None:
        return None
    try:
        pv = DEFAULT_CODEC.decode_as(raw, PolicyVersion)
    except CodecError as e:
        return {"error": str(e)}
    return {
        "policy_version": pv.policy_version,
        "published_at": pv.published_at,
        "age_s": round(now - pv.published_at, 3),
        "path": pv.path,
    }


def _current_step(r: redis.Redis, k: Keys, version: dict[str, Any] | None) -> dict[str, Any] | None:
    """The highest step with a plan, with how far its requests, samples and groups have got."""
    steps = [
        int(s)
        for key in run_keys(r, k, k.prefix + "plan:*")  # on a cluster: only the run's own node
        if (s := key.rsplit(":", 1)[-1]).isdigit()
    ]
    if not steps:
        return None
    step = max(steps)
    try:
        plan = DEFAULT_CODEC.decode_as(r.get(k.plan(step)), StepPlan)
    except CodecError as e:
        return {"step": step, "error": str(e)}
    gpm = plan.groups_per_minibatch
    allocs = {_s(g): DEFAULT_CODEC.decode_as(v, Allocation) for g, v in r.hgetall(k.alloc(step)).items()}
    emitted = int(r.scard(k.emitted(step)))
    trained = version is not None and int(version.get("policy_version", -1)) > step
    frontier = emitted < plan.n_groups and not trained
    return {
        "step": step,
        "policy": plan.policy,
        "groups": plan.n_groups,
        "group_sizes": _sizes(plan),
        "minibatches": plan.minibatches,
        "requests_released": _int(r.get(k.released(step))),
        "requests_total": sum(
            {**{g.group_id: g.n for g in plan.groups}, **{g: a.n for g, a in allocs.items()}}.values()
        ),
        "groups_closed": sum(1 for a in allocs.values() if a.status == "closed"),
        "groups_skipped": sum(1 for a in allocs.values() if a.status == "skipped"),
        "samples_discarded": _int(r.hget(k.stats, f"discarded_samples:{step}")),
        "samples_finished": _int(r.get(k.finished(step))),
        "migrations": _int(r.hget(k.stats, f"migrations:{step}")),  # requests moved mid-decode
        "migrated_tokens": _int(r.hget(k.stats, f"migrated_tokens:{step}")),
        "groups_emitted": emitted,
        "groups_consumed": int(r.scard(k.consumed(step))),  # written when the step's training ends
        "state": "trained" if trained else ("rolling out" if frontier else "training"),
        # the mini-batch the trainer needs next (0-based, as in FrontierStatus) and what it lacks
        "frontier_minibatch": emitted // gpm if frontier else None,
        "frontier_needs": gpm - emitted % gpm if frontier else 0,
    }


def health(st: dict[str, Any], stuck_after_s: float = 600.0) -> tuple[int, str]:
    """``--check``: 0 healthy or done; 1 no live rollout worker, or the trainer is stuck (groups
    wait for it and no policy version came for ``stuck_after_s``); 2 no such run."""
    run = st["run"]
    if not st["exists"]:
        return 2, f"unhealthy: unknown run {run!r}: no keys under rp:{{{run}}}:"
    if st["done"]:
        return 0, f"ok: run {run!r} is done"
    live = [w for w in st["workers"] if "error" not in w]
    if not live:
        return 1, f"unhealthy: no live rollout worker heartbeat for run {run!r}"
    v = st["version"]
    waiting = trainer_backlog(st)
    if v is not None and "age_s" in v and waiting and v["age_s"] > stuck_after_s:
        return 1, (
            f"unhealthy: trainer stuck: {waiting} groups wait for it and policy version "
            f"{v['policy_version']} is {v['age_s']:.0f}s old (> {stuck_after_s:.0f}s)"
        )
    step = st["step"] or {}
    where = f", step {step['step']} {step.get('state', '')}".rstrip() if "step" in step else ""
    pv = v.get("policy_version", "?") if v else "none yet"
    return 0, f"ok: {len(live)} live rollout workers, policy version {pv}{where}"


def worker_health(r: Any, run: str, worker: str) -> tuple[int, str]:
    """``--check --worker ID``: 0 while that worker's heartbeat key lives, else 1."""
    ttl = int(r.pttl(Keys(run).heartbeat(worker)))
    if ttl == -2:  # no such key: never started, or its TTL ran out (dead or stuck)
        return 1, f"unhealthy: no live heartbeat for worker {worker!r} of run {run!r}"
    return 0, f"ok: worker {worker!r} heartbeat live"


def trainer_backlog(st: dict[str, Any]) -> int:
    """Groups not yet trained on: the ``trainer`` group's lag + pending (all of them with no such group)."""
    groups = st["streams"]["groups"]
    trainer = [g for g in groups["groups"] if g["name"] == Groups.TRAINER]
    if not trainer:
        return int(groups["length"])
    lag = lag_of(trainer, Groups.TRAINER)  # the same reading as the controller's backpressure
    return int(trainer[0]["pending"]) if lag is None else lag


def render_status(st: dict[str, Any]) -> str:
    """The human-readable form of ``collect_status``."""
    lines = [
        f"run {st['run']}" + ("  (done)" if st["done"] else "") + ("" if st["exists"] else "  (unknown)")
    ]
    v = st["version"]
    if v is None:
        lines.append("policy version  none published")
    elif "error" in v:
        lines.append(f"policy version  undecodable: {v['error']}")
    else:
        lines.append(f"policy version  {v['policy_version']}  (published {v['age_s']:.1f}s ago)")
    s = st["step"]
    if s is not None and "error" not in s:
        needs = s["frontier_needs"]
        if s["frontier_minibatch"] is not None:
            fr = f"mini-batch {s['frontier_minibatch'] + 1}/{s['minibatches']} needs {needs} more group"
            fr += "s" if needs != 1 else ""
        else:
            fr = "none: " + ("the step is trained" if s["state"] == "trained" else "every group is emitted")
        lines += [
            f"step            {s['step']}  {s['policy']}  {s['state']}",
            f"frontier        {fr}",
            f"progress        requests {s['requests_released']}/{s['requests_total']} released, "
            f"{s['samples_finished']} finished; groups {s['groups_emitted']}/{s['groups']} emitted, "
            f"{s['groups_consumed']} consumed",
            f"migration       {s['migrations']} requests moved mid-decode, "
            f"{s['migrated_tokens']} tokens re-prefilled on their new workers",
            f"allocation      {s['group_sizes']}; {s['groups_closed']} closed, "
            f"{s['groups_skipped']} skipped, "
            f"{s['samples_discarded']} samples discarded",
        ]
    elif s is not None:
        lines.append(f"step            {s['step']}  undecodable plan: {s['error']}")
    pool = st.get("pool")
    if pool and "shares" in pool:
        sh = ", ".join(f"{run} {n}" for run, n in pool["shares"].items()) or "none"
        lines.append(f"pool            {pool['name']}: {pool['members']} live workers; shares {sh}")
    elif pool:
        n, m = pool["serving"], pool["members"]
        lines.append(f"pool            {n} of the {m} live workers of pool {pool['name']} serve this run")
    lines += ["", *_table(("stream", "length", "group", "pending", "lag", "consumers"), _stream_rows(st))]
    consumers = [
        (c["name"], name, g["name"], c["pending"], f"{c['idle_s']:.1f}")
        for name, info in st["streams"].items()
        for g in info["groups"]
        for c in g["consumers"]
    ]
    if consumers:
        lines += ["", *_table(("consumer", "stream", "group", "pending", "idle_s"), consumers)]
    wcols = (
        "capacity",
        "inflight",
        "version",
        "samples",
        "migrations",
        "host",
        "pid",
        "heartbeat_age_s",
        "ttl_s",
    )
    rows = [
        (w["id"], w["error"], *[""] * (len(wcols) - 1)) if "error" in w else (w["id"], *(w[c] for c in wcols))
        for w in st["workers"]
    ]
    lines += ["", *(_table(("worker", *wcols), rows) if rows else ["workers: no live heartbeat"])]
    total, per_step = st["stats"]["total"], st["stats"]["step"]
    if total:
        lines += ["", "counters: " + "  ".join(f"{f} {v}" for f, v in total.items())]
    if per_step and s is not None:
        lines.append(f"step {s['step']}: " + "  ".join(f"{f} {v}" for f, v in per_step.items()))
    return "\n".join(lines)


def _stream_rows(st: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for name, info in st["streams"].items():
        if not info["groups"]:
            rows.append((name, info["length"], "-", "", "", ""))
        for g in info["groups"]:
            lag = "?" if g["lag"] is None else g["lag"]
            rows.append((name, info["length"], g["name"], g["pending"], lag, len(g["consumers"])))
    return rows


def _table(head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    cells = [list(head), *([str(x) for x in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    numeric = [all(_is_number(row[i]) for row in cells[1:]) for i in range(len(head))]
    return [
        "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True)
        ).rstrip()
        for row in cells
    ]


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return s == ""
    return True


def _is_int(v: Any) -> bool:
    try:
        int(v)
    except (TypeError, ValueError):
        return False
    return True


def _int(v: Any) -> int:
    return int(v) if v is not None and _is_int(v) else 0


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
