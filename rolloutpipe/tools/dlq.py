"""Dead letters: ``rolloutpipe dlq list|show|replay``.

``list`` and ``show`` only read (``XRANGE``).  ``replay`` puts a dead letter's original payload back
on the stream it came from (``XADD`` of the original bytes under field ``d``), so the role that
rejected it looks at it again, e.g. after a verifier or a bug was fixed.  It never bypasses the
fence: the payload goes back exactly where it was, and the consumer checks it as it would any entry.

Each replay is recorded in the hash ``rp:{run}:dlq:replayed`` (dead-letter id -> JSON with the new
entry id), in the same Lua script as the ``XADD``, so a dead letter is replayed at most once unless
``force``.  Replays are not trimmed (no ``MAXLEN``): this tool does not know the run's
``redis.maxlen``, and trimming with a smaller one could drop entries a role still needs.

Refused without ``force``: a payload that does not decode (it would only be dead-lettered again), an
event of the wrong kind or run for its stream, a request, sample or group older than the run's
current policy version (the fence would reject it again), and a dead letter already replayed.
Never replayed: a dead letter with no source stream, or one whose source is not one of the run's
``requests``, ``samples``, ``groups``, ``control`` streams.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import ResponseError

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import DeadLetter, Event, Group, PolicyVersion, RolloutRequest, Sample
from rolloutpipe.broker.keys import DATA, Keys, one_slot
from rolloutpipe.errors import CodecError, RolloutPipeError
from rolloutpipe.tools.view import PAGE, compact

REPLAYABLE = ("requests", "samples", "groups", "control")
EXPECTED_KINDS = {
    "requests": ("request",),
    "samples": ("sample",),
    "groups": ("group",),
    "control": ("plan", "policy_version", "metrics"),
}
FENCED = (RolloutRequest, Sample, Group)  # kinds the fence rejects when older than the current version
REASON_WIDTH = 60
HEX_HEAD = 64
REPLAYED_COUNTER = "dead_letters_replayed"

# KEYS: source stream, replayed hash, stats hash.
# ARGV: dlq id, payload, record JSON, force (0/1), data field, replay counter.
# Returns the new entry id, or nil when already replayed (and not forced).
REPLAY_LUA = """
if ARGV[4] == '0' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return false
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[5], ARGV[2])
local rec = cjson.decode(ARGV[3])
rec['to'] = id
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(rec))
redis.call('HINCRBY', KEYS[3], ARGV[6], 1)
return id
"""


class DlqError(RolloutPipeError):
    """A dead letter that does not exist, or an id that is not a stream id."""


def replayed_key(run: str) -> str:
    return Keys(run).dlq_replayed


@dataclass(frozen=True)
class DeadRecord:
    """One ``dlq`` entry: its dead letter (or why the entry itself does not decode)."""

    run: str  # the run whose dlq holds it
    id: str
    letter: DeadLetter | None
    error: str = ""
    raw: bytes = b""
    replayed: dict[str, Any] | None = None

    @property
    def source(self) -> str:
        """The source stream's short name (``samples``), or the full key if it is not the run's."""
        if self.letter is None:
            return ""
        return short_stream(self.letter.source_stream, self.run)

    def payload(self) -> tuple[Event | None, str]:
        """The payload decoded through the event models, or why it does not decode."""
        if self.letter is None:
            return None, self.error
        try:
            return DEFAULT_CODEC.decode(self.letter.payload), ""
        except CodecError as e:
            return None, str(e)


def short_stream(key: str, run: str) -> str:
    prefix = Keys(run).prefix
    return key.removeprefix(prefix) if key.startswith(prefix) else key


def reason_class(reason: str) -> str:
    """``reason`` without its particulars: numbers become ``N``, stream keys their short name, and
    only the head is kept (``decode: not msgpack``, ``stale sample``, ``fence``)."""
    r = re.sub(r"rp:\{[^}]*\}:", "", reason)
    r = re.sub(r"\d+(\.\d+)?", "N", r)
    parts = r.split(": ")
    head = ": ".join(parts[:2]) if parts[0] == "decode" else parts[0]
    return head[:REASON_WIDTH].strip() or "(no reason)"


@dataclass(frozen=True)
class Where:
    """``--reason`` (a case-insensitive substring) and ``--source`` (``samples`` or the full key)."""

    reason: str | None = None
    source: str | None = None

    def __call__(self, rec: DeadRecord) -> bool:
        dl = rec.letter
        if dl is None:  # an entry of dlq that is no dead letter matches no filter
            return self.reason is None and self.source is None
        if self.reason is not None and self.reason.lower() not in dl.reason.lower():
            return False
        return self.source is None or self.source in (dl.source_stream, rec.source)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _record(
    run: str, eid: Any, fields: dict[bytes, bytes] | None, replayed: dict[str, dict[str, Any]]
) -> DeadRecord:
    sid = _s(eid)
    raw = (fields or {}).get(DATA)
    if raw is None:
        return DeadRecord(run, sid, None, f"no {DATA.decode()!r} field", b"")
    try:
        dl = DEFAULT_CODEC.decode_as(raw, DeadLetter)
    except CodecError as e:
        return DeadRecord(run, sid, None, f"not a dead letter: {e}", raw)
    return DeadRecord(run, sid, dl, "", raw, replayed.get(sid))


def replayed(r: redis.Redis, run: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    raw: Any = r.hgetall(replayed_key(run))
    for k, v in raw.items():
        try:
            rec = json.loads(v)
        except ValueError:
            rec = {"to": _s(v)}
        out[_s(k)] = rec if isinstance(rec, dict) else {"to": str(rec)}
    return out


def scan(r: redis.Redis, run: str) -> Iterator[DeadRecord]:
    """Every entry of the run's ``dlq``, oldest first (``XRANGE`` in pages)."""
    key = Keys(run).dlq
    done = replayed(r, run)
    lo = "-"
    while True:
        page: Any = r.xrange(key, min=lo, max="+", count=PAGE)
        for eid, fields in page:
            yield _record(run, eid, fields, done)
        if len(page) < PAGE:
            return
        lo = "(" + _s(page[-1][0])


def get(r: redis.Redis, run: str, dlq_id: str) -> DeadRecord:
    """The dead letter with entry id ``dlq_id``; ``DlqError`` if there is none."""
    if not re.fullmatch(r"\d+-\d+", dlq_id):
        raise DlqError(f"{dlq_id!r} is not a stream entry id (like 1700000000000-0)")
    try:
        rows: Any = r.xrange(Keys(run).dlq, min=dlq_id, max=dlq_id, count=1)
    except ResponseError as e:
        raise DlqError(f"{dlq_id!r}: {e}") from e
    if not rows:
        raise DlqError(f"no dead letter {dlq_id} in run {run!r} (rolloutpipe dlq list --run {run})")
    return _record(run, rows[0][0], rows[0][1], replayed(r, run))


# ----------------------------------------------------------------------------------------------- list


@dataclass
class Listing:
    records: list[DeadRecord]  # the last n matching, oldest first
    matching: int  # every matching dead letter in dlq
    total: int  # every entry in dlq
    by_reason: Counter[str] = field(default_factory=Counter)
    by_source: Counter[str] = field(default_factory=Counter)


def listing(r: redis.Redis, run: str, n: int = 50, where: Where | None = None) -> Listing:
    """The last ``n`` matching dead letters, and counts by reason class and by source over all matching."""
    where = where or Where()
    out = Listing([], 0, 0)
    for rec in scan(r, run):
        out.total += 1
        if not where(rec):
            continue
        out.matching += 1
        out.by_reason[reason_class(rec.letter.reason) if rec.letter else "(not a dead letter)"] += 1
        out.by_source[rec.source or "-"] += 1
        if n > 0:
            out.records.append(rec)
            if len(out.records) > n:
                out.records.pop(0)
    return out


def row(rec: DeadRecord) -> dict[str, Any]:
    """One dead letter as a JSON-ready summary (what ``list`` shows)."""
    dl = rec.letter
    if dl is None:
        return {"id": rec.id, "error": rec.error, "entry": compact(rec.raw)}
    ev, err = rec.payload()
    return {
        "id": rec.id,
        "time": dl.created_at,
        "role": dl.role,
        "source": rec.source,
        "entry_id": dl.entry_id,
        "step": dl.step,
        "policy_version": dl.policy_version,
        "reason": dl.reason,
        "reason_class": reason_class(dl.reason),
        "payload_bytes": len(dl.payload),
        "payload_kind": ev.kind if ev is not None else None,
        "payload_error": err or None,
        "replayed": rec.replayed,
    }


def render_listing(lst: Listing, run: str) -> str:
    lines: list[str] = []
    for rec in lst.records:
        d = row(rec)
        if rec.letter is None:
            lines.append(f"{rec.id:<17}  {'?':<8}  {d['error']}")
            continue
        clock = time.strftime("%H:%M:%S", time.localtime(d["time"]))
        reason = d["reason"] if len(d["reason"]) <= REASON_WIDTH else d["reason"][: REASON_WIDTH - 1] + "…"
        kind = d["payload_kind"] or "undecodable"
        src = f"{d['source'] or '-'} {d['entry_id'] or '-'}"
        done = f"  [replayed -> {rec.replayed.get('to')}]" if rec.replayed else ""
        lines.append(
            f"{rec.id:<17}  {clock}  {d['role']:<10}  {src:<28}  step {d['step']} v{d['policy_version']}"
            f"  {reason!r}  {d['payload_bytes']} B {kind}{done}"
        )
    shown = f"{len(lst.records)} shown of {lst.matching} matching" + (
        f" ({lst.total} in dlq)" if lst.total != lst.matching else ""
    )
    if not lst.total:
        return f"run {run!r}: no dead letters"
    lines += ["", f"dead letters: {shown}"]
    if lst.by_reason:
        lines.append("by reason:")
        lines += [f"  {c:>6}  {k}" for k, c in lst.by_reason.most_common()]
        lines.append("by source:")
        lines += [f"  {c:>6}  {k}" for k, c in lst.by_source.most_common()]
    return "\n".join(lines)


def listing_json(lst: Listing) -> dict[str, Any]:
    return {
        "dead_letters": [row(rec) for rec in lst.records],
        "matching": lst.matching,
        "total": lst.total,
        "by_reason": dict(lst.by_reason.most_common()),
        "by_source": dict(lst.by_source.most_common()),
    }


# ----------------------------------------------------------------------------------------------- show


def detail(rec: DeadRecord) -> dict[str, Any]:
    """Everything about one dead letter, JSON-ready; the payload decoded if it decodes, else hex."""
    dl = rec.letter
    if dl is None:
        return {"id": rec.id, "error": rec.error, "entry_hex": hexdump(rec.raw)}
    ev, err = rec.payload()
    info = {name: compact(getattr(dl, name)) for name in type(dl).model_fields if name != "payload"}
    out: dict[str, Any] = {"id": rec.id, **info, "reason_class": reason_class(dl.reason)}
    out["payload_bytes"] = len(dl.payload)
    if ev is not None:
        out["payload"] = compact(ev)
    else:
        out["payload_error"] = err
        out["payload_hex"] = hexdump(dl.payload)
    out["replayed"] = rec.replayed
    return out


def hexdump(b: bytes, limit: int = HEX_HEAD) -> list[str]:
    """``hexdump -C``-style lines of the first ``limit`` bytes."""
    lines = []
    for off in range(0, min(len(b), limit), 16):
        chunk = b[off : off + 16]
        text = "".join(chr(c) if 32 <= c < 127 else "." for c in chunk)
        lines.append(f"{off:08x}  {chunk.hex(' '):<47}  |{text}|")
    if len(b) > limit:
        lines.append(f"… {len(b) - limit} more bytes")
    return lines


def render_detail(d: dict[str, Any]) -> str:
    lines = []
    for k, v in d.items():
        if k in ("payload_hex", "entry_hex"):
            lines.append(f"{k}:")
            lines += [f"  {x}" for x in v] or ["  (empty)"]
        elif k == "payload":
            lines.append("payload:")
            lines += [f"  {pk}: {json.dumps(pv, default=repr)}" for pk, pv in v.items()]
        elif k == "created_at" and isinstance(v, int | float):
            lines.append(f"{k}: {v}  ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(v))})")
        else:
            lines.append(f"{k}: {json.dumps(v, default=repr) if not isinstance(v, str) else v}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- replay


def current_version(r: redis.Redis, run: str) -> int:
    """The run's current policy version (-1 when none is published or it does not decode)."""
    raw: Any = r.get(Keys(run).version)
    if raw is None:
        return -1
    try:
        return DEFAULT_CODEC.decode_as(raw, PolicyVersion).policy_version
    except CodecError:
        return -1


@dataclass(frozen=True)
class Replay:
    """What replay did (or, dry, would do) with one dead letter."""

    record: DeadRecord
    refused: str = ""  # why not, empty when replayed
    forceable: bool = False  # --force would replay it anyway
    new_id: str = ""  # the entry id on the source stream
    dry_run: bool = False

    @property
    def done(self) -> bool:
        return not self.refused


def check(rec: DeadRecord, run: str, version: int) -> tuple[str, bool]:
    """Why ``rec`` cannot be replayed (empty if it can) and whether ``force`` may override that."""
    dl = rec.letter
    if dl is None:
        return f"entry {rec.id} of dlq is not a dead letter ({rec.error})", False
    if not dl.source_stream:
        return "it has no source stream (it was not read from a stream)", False
    if short_stream(dl.source_stream, run) not in REPLAYABLE:  # only ever the run's own streams
        return f"its source {dl.source_stream!r} is not a stream of run {run!r}", False
    if rec.replayed is not None:
        return f"already replayed as {rec.source} {rec.replayed.get('to')} (--force replays it again)", True
    ev, err = rec.payload()
    if ev is None:
        return f"the payload does not decode ({err}); it would be dead-lettered again", True
    if ev.kind not in EXPECTED_KINDS[rec.source]:
        return f"a {ev.kind!r} event on {rec.source} would be dead-lettered again", True
    if ev.run != run:
        return f"the event belongs to run {ev.run!r}; it would be dead-lettered again", True
    if isinstance(ev, FENCED) and ev.policy_version < version:
        return (
            f"stale: {ev.kind} of policy_version {ev.policy_version} < the run's current version "
            f"{version}; the fence would reject it again"
        ), True
    return "", False


def replay(
    r: redis.Redis,
    run: str,
    records: Iterable[DeadRecord],
    *,
    force: bool = False,
    dry_run: bool = False,
) -> list[Replay]:
    """Put each dead letter's original payload back on its source stream (unless refused)."""
    version = current_version(r, run)
    keys = Keys(run)
    script = r.register_script(REPLAY_LUA)
    out: list[Replay] = []
    for rec in records:
        why, forceable = check(rec, run, version)
        if why and not (force and forceable):
            out.append(Replay(rec, why, forceable, dry_run=dry_run))
            continue
        if dry_run:
            out.append(Replay(rec, dry_run=True))
            continue
        assert rec.letter is not None
        note = json.dumps({"at": time.time(), "stream": rec.letter.source_stream, "forced": bool(why)})
        names = [rec.letter.source_stream, replayed_key(run), keys.stats]
        one_slot(keys, names)  # one script, one slot (Redis Cluster)
        new: Any = script(
            keys=names,
            args=[rec.id, rec.letter.payload, note, int(force), DATA, REPLAYED_COUNTER],
        )
        if new is None:  # replayed by someone else since we read it
            out.append(Replay(rec, "already replayed (concurrently)", True))
        else:
            out.append(Replay(rec, new_id=_s(new)))
    return out


def describe(rp: Replay) -> str:
    rec = rp.record
    dl = rec.letter
    what = f"dead letter {rec.id}"
    if dl is not None:
        ev, _ = rec.payload()
        kind = ev.kind if ev is not None else f"{len(dl.payload)} undecodable bytes"
        what += (
            f" ({kind}, step {dl.step} v{dl.policy_version}, from {rec.source or '-'} {dl.entry_id or '-'})"
        )
    if rp.refused:
        return f"refused {what}: {rp.refused}"
    if rp.dry_run:
        return f"would replay {what} to {rec.source}"
    return f"replayed {what} to {rec.source} as {rp.new_id}"
