"""Long-tail migration: which of a worker's running requests to hand back so idle workers take them.

Why.  At the end of a rollout a few engines decode the long tail while the rest of the pool has
nothing to do.  A decode step costs about ``base + per_seq * batch``: the busiest engine sets the
pace of its whole batch, and an idle engine adds nothing.  Moving part of the busiest batch to
idle engines shortens every remaining step of both (JigsawRL's long-tail migration).  The price is
paid by the target: a prefill of prompt + partial response, because the KV cache does not move.

The rule (greedy levelling), applied by every worker to the pool's heartbeats:

* only when *most of the pool is idle*: at least ``idle_share`` of the live workers' slots are
  free.  Workers pull requests only into free slots, so then nothing waits for one;
* while this worker runs at least 2 more requests than the least loaded live worker, move one
  and count it against that worker (the one Redis will most likely hand it to: an idle worker is
  blocked on ``requests``).  Each move narrows the gap by 2, so two workers never trade back
  and forth, and a worker at the floor + 1 gives nothing;
* longest running first: in a long-tailed (log-normal) length distribution, the request that has
  run longest is the one expected to run longest still;
* only requests that ran ``min_run_s`` here (a just-started one is as cheap to leave), and a
  request runs in at most ``max_segments`` segments (it moves at most ``max_segments - 1`` times).

Pure: no Redis, no asyncio; ``RolloutWorker.migrate_loop`` feeds it and preempts what it returns.
The heuristic uses no look-ahead over the runs' stage graphs; it is the greedy baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rolloutpipe.config import MigrationConfig


@dataclass(frozen=True)
class Load:
    """A live worker's slots and the requests it runs (its heartbeat; this worker's own, live)."""

    worker: str
    capacity: int
    inflight: int


@dataclass(frozen=True)
class Running:
    """One request running on this worker."""

    request_id: str
    running_s: float  # since this worker admitted it
    segment: int  # times it has been moved before


def choose(me: Load, others: Sequence[Load], running: Sequence[Running], cfg: MigrationConfig) -> list[str]:
    """The request ids this worker should preempt and hand back, in order (may be empty)."""
    if not cfg.enabled or not others:
        return []
    if idle_share([me, *others]) < cfg.idle_share:
        return []
    loads = sorted((max(0, w.inflight), w.capacity) for w in others if w.inflight < w.capacity)
    movable = sorted(
        (r for r in running if r.running_s >= cfg.min_run_s and r.segment + 1 < cfg.max_segments),
        key=lambda r: (-r.running_s, r.request_id),
    )
    mine = max(me.inflight, len(running))
    out: list[str] = []
    for r in movable:
        if not loads or mine - loads[0][0] < 2:
            break
        out.append(r.request_id)
        mine -= 1
        n, cap = loads.pop(0)
        if n + 1 < cap:
            loads.append((n + 1, cap))
            loads.sort()
    return out


def idle_share(pool: Sequence[Load]) -> float:
    """The share of the pool's slots that are free."""
    slots = sum(max(0, w.capacity) for w in pool)
    busy = sum(min(max(0, w.inflight), max(0, w.capacity)) for w in pool)
    return 1.0 if slots <= 0 else (slots - busy) / slots
