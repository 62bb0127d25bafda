"""Pool scheduling: which run each worker of a shared rollout pool serves (JigsawRL's multiplexing).

Why.  Strictly on-policy, a run's rollout engines have nothing to do from the moment its last
request of step k finishes until version k+1 is published (its training and weight sync), and
during its long tail most of them idle too.  A pool shared by several runs gives that idle
capacity to the runs that have requests waiting.  Each run keeps its controller, aggregator,
trainer, versions and fence; only where its requests are generated changes.

A run's *stage graph* is the cycle rollout -> group completion -> train -> weight sync -> rollout.
The scheduler sees each run's current stage (``RunView``, read from the run's own keys) and, for
look-ahead, the measured duration of that run's last train-and-sync stage.

Three policies, all pure (no Redis, no asyncio; ``roles/pool.py`` is the I/O around them):

* ``greedy``: the workers are shared in proportion to each run's requests outstanding *now*
  (a run waiting for its first plan counts a whole step).  A run that trains gets nothing; it
  gets workers back when its next step's plan appears, and each then pays a weight switch
  before its first token, on that run's critical path.
* ``lookahead``: the same shares, computed on the demand ``switch_s`` ahead (the time a moved
  worker needs before it is useful, plus one scheduler tick: ``roles/pool.decision_horizon``).
  A run whose training is predicted to end within ``switch_s`` (its last train-and-sync took
  T; it has trained for t; T - t <= switch_s) counts its next step's requests already, so
  workers move to it while it still trains and the switch is paid off its critical path.  A
  run keeps the workers it holds when lending them would not pay: its rollout ends within
  ``switch_s``, or its training within ``2 * switch_s`` (a lent worker must switch away and
  back before it is needed again).  A rollout that has outlived its prediction is overdue,
  not "ending soon": it keeps only its floor.
* ``stagger``: ``lookahead`` served oldest step first rather than in proportion (``stagger``'s
  docstring): proportional shares give the run that is further along fewer workers, which pulls
  identical runs into phase, so that both train at once and nothing is left to lend.

Shares: largest remainder of ``workers * demand / total demand``, at least one worker for every
run with demand (while workers last), and no run more workers than it has requests.  Both keep
a run in rollout the workers its outstanding requests fill (``floors``): the pool lends spare
workers and those of a long tail, which the moved worker hands back to the run's others (long-tail
consolidation), never a full batch.  Workers that keep their run are chosen first (fewest
switches), the busiest of a run first; the others, least loaded first, move to the runs short of
workers (a moved worker hands back the requests it holds, so the cheapest to move is lent).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Phase = Literal["waiting", "rollout", "training", "done"]


@dataclass(frozen=True)
class RunView:
    """What the pool knows of one run now."""

    run: str
    phase: Phase  # waiting: no plan for the current version yet; training: every request finished
    outstanding: int  # requests of the current step not finished (rollout), else 0
    step_requests: int  # requests of a whole step (the last plan's), 0 until a plan was seen
    phase_elapsed_s: float  # time in the current phase
    last_train_s: float | None = None  # the last measured training + weight sync (None: not yet)
    last_rollout_s: float | None = None


@dataclass(frozen=True)
class WorkerView:
    worker: str
    run: str  # the run it serves now ("" if none)
    capacity: int
    inflight: int = 0  # requests it holds now (its heartbeat's): the cost of moving it


def demand(r: RunView, horizon_s: float = 0.0) -> int:
    """Requests run ``r`` will want served ``horizon_s`` from now (0: now)."""
    if r.phase == "done":
        return 0
    if r.phase == "waiting":
        return max(1, r.step_requests)
    if r.phase == "rollout":
        return r.outstanding  # a rollout about to end: ``lookahead`` keeps its workers
    # training: nothing to generate until its next plan, unless that comes within the horizon
    if horizon_s > 0 and r.last_train_s is not None and r.last_train_s - r.phase_elapsed_s <= horizon_s:
        return max(1, r.step_requests)
    return 0


def shares(demands: dict[str, int], n_workers: int) -> dict[str, int]:
    """Workers per run: proportional to demand (largest remainder), at least 1 per run with demand
    while workers last, at most one worker per request."""
    want = {r: d for r, d in demands.items() if d > 0}
    out = dict.fromkeys(demands, 0)
    if not want or n_workers <= 0:
        return out
    total = sum(want.values())
    order = sorted(want, key=lambda r: (-want[r], r))
    for r in order[:n_workers]:  # one each first, the biggest demands first
        out[r] = 1
    left = n_workers - sum(out.values())
    if left <= 0:
        return out
    exact = {r: n_workers * want[r] / total for r in want}
    for r in want:
        out[r] = max(out[r], min(want[r], math.floor(exact[r])))
    left = n_workers - sum(out.values())
    rema = sorted(want, key=lambda r: (-(exact[r] - math.floor(exact[r])), -want[r], r))
    while left > 0:
        grew = False
        for r in rema:
            if left > 0 and out[r] < want[r]:
                out[r] += 1
                left -= 1
                grew = True
        if not grew:
            break
    while sum(out.values()) > n_workers:  # the "1 each" floor overshot: take from the largest
        r = max(out, key=lambda x: (out[x], -want.get(x, 0)))
        out[r] -= 1
    return out


def assign(quota: dict[str, int], workers: Sequence[WorkerView], keep_idle: bool = True) -> dict[str, str]:
    """Worker -> run meeting ``quota`` with the fewest moves, and the cheapest: a run keeps its
    busiest workers and lends its least loaded (a moved worker hands back what it holds).  Workers
    beyond every quota stay where they are (``keep_idle``: a spare worker is as useful on its run
    as anywhere, and free to move)."""
    left = dict(quota)
    out: dict[str, str] = {}
    for w in sorted(workers, key=lambda w: (-w.inflight, w.worker)):
        if w.run and left.get(w.run, 0) > 0:
            out[w.worker] = w.run
            left[w.run] -= 1
    short = [r for r in sorted(left, key=lambda r: (-left[r], r)) for _ in range(left[r])]
    for w in sorted(workers, key=lambda w: (w.inflight, w.worker)):
        if w.worker in out:
            continue
        if short:
            out[w.worker] = short.pop(0)
        else:
            out[w.worker] = w.run if keep_idle else ""
    return out


def floors(runs: Sequence[RunView], workers: Sequence[WorkerView]) -> dict[str, int]:
    """Workers a run keeps whatever the others want: as many of those it holds as its outstanding
    requests fill (``ceil(outstanding / slots a worker)``).  Taking one of those would hand its
    running requests back only for them to wait for a slot: the pool lends a run's spare workers,
    and a long tail's (consolidated onto the workers it fills), never the ones it is busy on."""
    cap = max(1, max((w.capacity for w in workers), default=1))
    held = Counter(w.run for w in workers)
    return {r.run: min(held[r.run], -(-r.outstanding // cap)) for r in runs if r.phase == "rollout"}


def with_floors(quota: dict[str, int], floor: dict[str, int], n_workers: int) -> dict[str, int]:
    """``quota`` raised to ``floor``, the excess taken back from the runs above their floor."""
    out = {r: max(q, floor.get(r, 0)) for r, q in quota.items()}
    while sum(out.values()) > n_workers:
        above = [r for r in out if out[r] > floor.get(r, 0)]
        if not above:
            break
        out[max(above, key=lambda r: (out[r] - floor.get(r, 0), r))] -= 1
    return out


def greedy(runs: Sequence[RunView], workers: Sequence[WorkerView], switch_s: float) -> dict[str, str]:
    """Shares by the demand now (a busy run keeps the workers it fills: ``floors``)."""
    quota = shares({r.run: demand(r) for r in runs}, len(workers))
    return assign(with_floors(quota, floors(runs, workers), len(workers)), workers)


def lookahead(runs: Sequence[RunView], workers: Sequence[WorkerView], switch_s: float) -> dict[str, str]:
    """Shares by the demand ``switch_s`` ahead; a run keeps the workers it holds when lending them
    would not pay: its rollout ends within ``switch_s``, or its training within ``2 * switch_s``
    (a lent worker must switch away and back).  The pool passes its decision horizon as
    ``switch_s`` (``roles/pool.decision_horizon``: the switch plus one tick)."""
    quota = shares({r.run: demand(r, switch_s) for r in runs}, len(workers))
    quota = with_floors(quota, floors(runs, workers), len(workers))
    return assign(_keep(runs, workers, quota, switch_s), workers)


def step_began(r: RunView, horizon_s: float = 0.0) -> float:
    """When the run's current (or, training, its next) step began, in seconds from now: the
    elapsed time of a rollout or of a wait for the plan, negated; a training run's predicted end
    (later than now, by its last training; ``horizon_s`` if not yet measured)."""
    if r.phase == "training":
        return (r.last_train_s if r.last_train_s is not None else horizon_s) - r.phase_elapsed_s
    return -r.phase_elapsed_s


def stagger(runs: Sequence[RunView], workers: Sequence[WorkerView], switch_s: float) -> dict[str, str]:
    """``lookahead``'s demand, horizon and keeps, but served oldest step first instead of in
    proportion: each run in the order its step began gets the workers its demand fills
    (``ceil(demand / slots)``) while workers last, so the run that started first ends its rollout
    first and trains while the next rolls out on the rest: the runs' phases interleave instead of
    being pulled into line by proportional shares.  A younger run keeps the workers its requests
    fill (``floors``); workers nobody fills stay where they are.  This is the order of the
    simulated ceiling's ``ideal`` schedule (``bench/pool_ceiling.py``) and JigsawRL's; its cost is
    the wait it adds to a younger run's rollout, which the suite reports (its first step's r2t)."""
    cap = max(1, max((w.capacity for w in workers), default=1))
    want = {r.run: demand(r, switch_s) for r in runs}
    quota, left = dict.fromkeys(want, 0), len(workers)
    for r in sorted(runs, key=lambda r: (step_began(r, switch_s), r.run)):
        quota[r.run] = min(left, -(-want[r.run] // cap))
        left -= quota[r.run]
    quota = with_floors(quota, floors(runs, workers), len(workers))
    return assign(_keep(runs, workers, quota, switch_s), workers)


def _keep(
    runs: Sequence[RunView], workers: Sequence[WorkerView], quota: dict[str, int], switch_s: float
) -> dict[str, int]:
    """A run keeps the workers it holds when lending them would not pay: its rollout ends within
    ``switch_s``, or its training within ``2 * switch_s``; the difference comes from the others."""
    keep = {r.run for r in runs if _ends_within(r, switch_s if r.phase == "rollout" else 2 * switch_s)}
    held = {r: sum(1 for w in workers if w.run == r) for r in keep}
    for r, n in held.items():  # keep what it has; take the difference from the others' spare
        extra = n - quota.get(r, 0)
        if extra <= 0:
            continue
        quota[r] = n
        for other in sorted(quota, key=lambda x: -quota[x]):
            while extra > 0 and other not in keep and quota[other] > 1:
                quota[other] -= 1
                extra -= 1
    return quota


def _ends_within(r: RunView, horizon_s: float) -> bool:
    """The run's current rollout or training is predicted (by its last one) to end within the horizon.

    An overdue rollout (it has run longer than the last) is not: the prediction failed, and a long
    tail that outlives it must not keep every worker it holds (its ``floors`` still do).  An
    overdue training is: its next plan can come at any moment."""
    last = {"rollout": r.last_rollout_s, "training": r.last_train_s}.get(r.phase)
    if last is None:
        return False
    left = last - r.phase_elapsed_s
    return left <= horizon_s and (left >= 0.0 or r.phase != "rollout")


POLICIES = {"greedy": greedy, "lookahead": lookahead, "stagger": stagger}
