"""A rollout pool shared by several runs: the pool scheduler role and the pool worker.

* **Keys.**  The pool's keys are those of the pseudo-run ``pool:NAME`` (``pool_keys``): one slot
  of their own.  Each run's keys stay in the run's slot.  No script or MULTI ever touches both:
  the pool only says *where* a run's requests are generated (``lease``: worker -> run), and every
  write that carries a run's data (samples, hand-backs, dead letters, heartbeats in the run's
  ``workers``) is the run's own, in its slot, exactly as without a pool.  So a lease read late
  costs engine time, never correctness: the run's fence and exactly-once hold whoever serves it.
* **The scheduler** (``rolloutpipe pool``) reads each run's stage from the run's keys every
  ``pool.tick_s`` (``RunView``: its version, plan, and released and finished counters), asks the
  policy (``scheduling/leases.py``: greedy, lookahead, or static) which run each live pool worker
  serves, and writes the changes to ``lease`` and ``leases``.
* **A pool worker** (``rolloutpipe rollout --pool NAME``) keeps one engine and serves the run of
  its lease with a ``RolloutWorker`` of that run (its heartbeat in the run's ``workers``, so the
  run's controller counts its slots).  When its lease changes, it leaves the run
  (``RolloutWorker.leave``: running requests handed back as continuations, or finished first),
  loads the new run's current version (another run's weights: the engine's switch), and serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from rolloutpipe import metrics
from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.events import Lease
from rolloutpipe.broker.keys import Keys, pool_keys
from rolloutpipe.broker.state import live_heartbeats
from rolloutpipe.broker.streams import Broker
from rolloutpipe.config import Config
from rolloutpipe.engines import make_engine
from rolloutpipe.errors import ConfigError
from rolloutpipe.roles.rollout import RolloutWorker, default_worker_id
from rolloutpipe.runtime import close_client, wait_event
from rolloutpipe.scheduling import leases

log = logging.getLogger("rolloutpipe.pool")


# ------------------------------------------------------------------------------------- the scheduler


@dataclass
class _Track:
    """What the scheduler remembers of a run between ticks: its phase and when it began."""

    phase: leases.Phase = "waiting"
    since: float = field(default_factory=time.monotonic)
    step: int = -1  # the step of ``phase``
    step_requests: int = 0
    last_train_s: float | None = None
    last_rollout_s: float | None = None
    plan_step: int = -1  # the step whose plan was read: a plan is written once, so it is read once
    plan_total: int = 0

    def advance(self, phase: leases.Phase, step: int, now: float) -> None:
        """The run is in ``phase`` of ``step`` at ``now``; a change ends the phase before it.

        A rollout is timed over the span ``phase_elapsed_s`` counts in it (its requests released,
        until the last finished; the wait for its plan is not in it), so ``leases._ends_within``
        compares like with like.  Training (and the weight sync) runs from the last request
        finished to the next step's plan or requests.  A new step's rollout seen straight after
        the last one's (between two ticks) is a new rollout, not measured."""
        if phase == self.phase and step == self.step:
            return
        if self.phase == "training" and phase in ("waiting", "rollout"):
            self.last_train_s = now - self.since
        if self.phase == "rollout" and phase == "training" and step == self.step:
            self.last_rollout_s = now - self.since
        self.phase, self.step, self.since = phase, step, now


async def run_view(r: Any, run: str, track: _Track, now: float) -> leases.RunView:
    """The run's stage from its own keys (read-only), and the phase durations measured so far."""
    k = Keys(run)
    b = Broker(r, run, "pool")
    phase: leases.Phase
    outstanding, step = 0, track.step
    if await b.is_done():
        phase = "done"
    else:
        step = max(0, await b.version_number())
        if track.plan_step != step and (plan := await b.plan(step)) is not None:
            track.plan_step, track.plan_total = step, sum(g.n for g in plan.groups)
        if track.plan_step != step:
            phase = "waiting"
        else:
            total = track.plan_total
            released, finished = (int(x or 0) for x in await r.mget(k.released(step), k.finished(step)))
            track.step_requests = max(total, released)
            outstanding = max(0, max(total, released) - finished)
            phase = "rollout" if outstanding > 0 else "training"
    track.advance(phase, step, now)
    return leases.RunView(
        run=run,
        phase=phase,
        outstanding=outstanding,
        step_requests=track.step_requests,
        phase_elapsed_s=now - track.since,
        last_train_s=track.last_train_s,
        last_rollout_s=track.last_rollout_s,
    )


def switch_horizon(cfg: Config) -> float:
    """Wall seconds a moved worker needs before it is useful (``rollout.pool.switch_s``)."""
    rc = cfg.rollout
    if rc.pool.switch_s is not None:
        return rc.pool.switch_s
    if rc.engine == "emulated":
        return rc.emulated.switch_s * rc.emulated.time_scale
    return 0.5


def decision_horizon(cfg: Config) -> float:
    """How far ahead the look-ahead must see: a worker moved at this tick is useful a switch later,
    and the scheduler decides again only a tick later, so what will be wanted within a switch and
    a tick must move now (a horizon of the switch alone, shorter than a tick, was ``greedy``'s)."""
    return switch_horizon(cfg) + cfg.rollout.pool.tick_s


def static_leases(runs: list[str], workers: list[leases.WorkerView]) -> dict[str, str]:
    """The static split: a worker keeps the run it was first given; a new one joins the run with the
    fewest workers (ties: the earlier run).  N runs on N x k workers: k each, never moved."""
    out = {w.worker: w.run for w in workers if w.run in runs}
    for w in sorted(workers, key=lambda w: w.worker):
        if w.worker not in out:
            held = {r: sum(1 for x in out.values() if x == r) for r in runs}
            out[w.worker] = min(runs, key=lambda r: (held[r], runs.index(r)))
    return out


async def pool_workers(r: Any, pk: Keys) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for wid, raw in await live_heartbeats(r, pk):
        with contextlib.suppress(ValueError):
            out.append((wid, json.loads(raw)))
    return out


async def run_pool(cfg: Config, url: str, stop: asyncio.Event) -> int:
    """The pool scheduler: leases the pool's workers to ``rollout.pool.runs`` until every run is done."""
    pc = cfg.rollout.pool
    if not pc.name or not pc.runs:
        raise ConfigError("the pool scheduler needs rollout.pool.name and rollout.pool.runs")
    metrics.serve(cfg.metrics.port, cfg.metrics.host, "pool")
    r = connect(url)
    pk = pool_keys(pc.name)
    pb = Broker(r, pk.run, "pool", maxlen=cfg.redis.maxlen)
    tracks = {run: _Track() for run in pc.runs}
    horizon = decision_horizon(cfg)
    decide = leases.POLICIES.get(pc.policy)
    try:
        while not stop.is_set():
            now = time.monotonic()
            views = [await run_view(r, run, tracks[run], now) for run in pc.runs]
            if all(v.phase == "done" for v in views):
                log.info("every run of pool %s is done", pc.name)
                break
            members = await pool_workers(r, pk)
            leased = {_s(w): _s(v) for w, v in (await r.hgetall(pk.lease)).items()}
            workers = [
                leases.WorkerView(
                    wid, leased.get(wid, ""), int(info.get("capacity", 0)), int(info.get("inflight", 0))
                )
                for wid, info in members
            ]
            if decide is None:
                want = static_leases(pc.runs, workers)
            else:
                want = decide([v for v in views if v.phase != "done"], workers, horizon)
            counts = {run: sum(1 for x in want.values() if x == run) for run in pc.runs}
            for wid, run in sorted(want.items()):
                if leased.get(wid, "") != run:
                    await lease(pb, wid, leased.get(wid, ""), run, pc.policy, counts)
            for run, n in counts.items():
                metrics.POOL_SHARE.labels(run).set(n)
            await wait_event(stop, pc.tick_s)
    finally:
        await close_client(r)
    return 0


async def lease(
    pb: Broker, worker: str, from_run: str, to_run: str, pol: str, shares: dict[str, int]
) -> None:
    """``worker`` serves ``to_run`` from now on: the lease and its event together, once (pool slot)."""
    ev = Lease(
        run=pb.run, step=-1, policy_version=-1, worker=worker, from_run=from_run, to_run=to_run,
        policy=pol, shares=shares, created_at=time.time(),
    )  # fmt: skip
    k = pb.keys
    op = pb.once(None).cmd("HSET", k.lease, worker, to_run).xadd(k.leases, pb.encode(ev))
    op.cmd("HINCRBY", k.stats, "lease_changes", 1)
    await op.execute()
    log.info(
        "pool %s: worker %s %s -> %s (shares %s)", pb.run, worker, from_run or "-", to_run or "-", shares
    )


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ---------------------------------------------------------------------------------- the pool worker


async def run_pool_worker(cfg: Config, url: str, stop: asyncio.Event, worker_id: str = "") -> int:
    """One engine that serves whichever run its lease names, switching when the lease changes."""
    pc = cfg.rollout.pool
    metrics.serve(cfg.metrics.port, cfg.metrics.host, "rollout")
    wid = worker_id or default_worker_id()
    r = connect(url)
    pk = pool_keys(pc.name)
    pb = Broker(r, pk.run, "rollout")
    engine = make_engine(cfg)
    await engine.start()
    ttl = max(1, int(cfg.rollout.heartbeat_s * 3 + 0.999))
    current: tuple[str, RolloutWorker, asyncio.Task[int], asyncio.Event] | None = None
    switches, served = 0, 0
    last_hb = 0.0
    try:
        while not stop.is_set():
            if time.monotonic() - last_hb > min(cfg.rollout.heartbeat_s / 3, pc.tick_s):  # load, each tick
                last_hb = time.monotonic()
                info = {
                    "id": wid, "capacity": engine.capacity, "run": current[0] if current else "",
                    "inflight": len(current[1].inflight) if current else 0, "switches": switches,
                    "samples": served + (current[1].samples if current else 0),
                    "busy_s": float(getattr(engine, "busy_s", 0.0)),  # the emulated engine's
                    "switch_s": float(getattr(engine, "switch_wall_s", 0.0)),
                    "pid": os.getpid(), "host": socket.gethostname(), "t": time.time(),
                }  # fmt: skip
                await pb.heartbeat(wid, info, ttl)
            want = _s(await r.hget(pk.lease, wid) or b"")
            if current is not None and (current[0] != want or current[2].done()):
                run, w, task, wstop = current
                await w.leave(pc.handback)
                with contextlib.suppress(asyncio.CancelledError):
                    await task  # returns once nothing of ``run`` is in flight
                wstop.set()
                served += w.samples
                current = None
                log.info("worker %s left run %s", wid, run)
            if current is None and want:
                wb = Broker(
                    r, want, "rollout", maxlen=cfg.redis.maxlen, sample_shards=cfg.redis.sample_shards
                )
                if await wb.is_done():
                    await wait_event(stop, pc.tick_s)
                    continue
                w = RolloutWorker(cfg, wb, engine, wid, own_engine=False)
                wstop = asyncio.Event()
                current = (want, w, asyncio.create_task(w.run(wstop)), wstop)
                switches += 1
                metrics.POOL_SWITCHES.inc()
                log.info("worker %s now serves run %s", wid, want)
            await wait_event(stop, pc.tick_s)
    finally:
        if current is not None:
            run, w, task, wstop = current
            await w.leave(pc.handback)
            wstop.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await pb.drop_heartbeat(wid)
        await engine.close()
        await close_client(r)
    return 0
