"""``rolloutpipe tail``: the entries of one stream of a run, as JSON lines or one rendered line each.

It only reads (``XREVRANGE``, ``XRANGE``, ``XREAD``): it never joins a consumer group, so it leaves
no pending entries and moves no role's offsets.  An entry that does not decode is shown with an
``error`` field, never skipped.  This module writes to the text stream it is given; the CLI owns
the flags, the exit codes and Ctrl-C.  The compact form of arrays and bytes is ``view.compact``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import redis

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
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.errors import CodecError
from rolloutpipe.tools.view import PAGE, as_str, compact, plan_sizes, stream_key


@dataclass(frozen=True)
class Decoded:
    """One stream entry: its event, or why it did not decode."""

    stream: str
    id: str
    event: Event | None
    error: str = ""
    raw: bytes = b""


def decode_entry(stream: str, eid: bytes | str, fields: dict[bytes, bytes] | None) -> Decoded:
    sid = as_str(eid)
    raw = (fields or {}).get(DATA)
    if raw is None:
        return Decoded(stream, sid, None, f"no {DATA.decode()!r} field: {sorted(map(as_str, fields or {}))}")
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
        cursor = as_str(newest[0][0]) if newest else "0-0"
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
        hi = "(" + as_str(page[-1][0])
    return found[::-1]


def _forward(r: redis.Redis, key: str, stream: str) -> Iterator[Decoded]:
    lo = "-"
    while True:
        page: Any = r.xrange(key, min=lo, max="+", count=PAGE)
        for eid, fields in page:
            yield decode_entry(stream, eid, fields)
        if len(page) < PAGE:
            return
        lo = "(" + as_str(page[-1][0])


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
            f"{ev.policy} {ev.n_groups} groups, {ev.n_requests} samples ({plan_sizes(ev)})",
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


def _short_list(a: np.ndarray, signed: bool = False, head: int = 8) -> str:
    fmt = "{:+.2f}" if signed else "{:g}"
    xs = [fmt.format(float(x)) for x in a[:head]]
    return "[" + " ".join(xs) + (" …" if a.size > head else "") + "]"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
