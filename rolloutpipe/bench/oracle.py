"""The best clairvoyant schedule of a step in a stated family: the paper suite's reachable reference.

Why it exists (issue 26): the bound (``bench/bound.py``) is a figure no schedule beats, but no
schedule need reach it either, so "share of the bound's cut" divides by a cut that may not exist.
The oracle knows every response length in advance and plays each schedule of a family on the
same cost models as the emulated engine and trainer; its best rollout-to-train-end is one that a
schedule *reaches* on the model.  A mode's share of the oracle's cut is then a share of what is
achievable.  A measured mode may still beat the oracle (it may use a schedule outside the family,
such as FGD's window); nothing beats the bound, and ``bound <= oracle`` always (tests pin it).

The model, in emulated seconds (``engines/emulated.py`` without a KV-cache limit, which the suites
do not turn on yet; ``roles/trainer/backends.py``):

* E engines of S slots.  A decode step with n running sequences takes ``a + c*n`` and advances each
  by one token; a request that joins an engine stalls that engine's batch for its prefill ``p``.
* One global queue (late binding): when slots are free, the queue's head goes to the engine with
  the most free slots (the lowest index on a tie).
* The trainer takes groups in completion order (FIFO), ``h + tokens*passes/tokens_per_s`` each, and
  makes an optimizer step ``o`` after every ``gpm`` groups and after the last.

The family, each an admission order played with that trainer (:data:`SCHEDULES`):

* ``fifo``: groups in index order, each group's samples together: what ``cgp`` does;
* ``lpt`` / ``spt``: groups by their longest sample, longest / shortest first;
* ``lpt-tokens``: groups by their total response tokens, largest first;
* ``sample-lpt``: every sample by its own length, longest first (the best engine balance; groups
  complete late);
* ``spt-k-then-lpt``: the k groups with the shortest longest sample first (shortest first), then
  the rest longest first, for k in {gpm, 2 gpm, n/4, n/2}: the trainer gets work early while the
  long groups still start early.

These are the kinds of schedule the offline replay behind issue 26 tried (longest- and
shortest-first by a group's longest sample, hybrids, token-balanced, per-sample placement); the
list and its k were fixed before any suite result with this module was seen.

:func:`replay` plays a measured run's own decisions on the model instead: every sample on the
engine (worker) that ran it, in the order it was admitted there, without the waiting between
admissions that the run had; with ``barrier`` (sync) the trainer starts when the last group is
complete.  The gap between a mode's measured r2t and its replay is the broker's and Python's
overhead plus any holding back (FGD's window) that the replay does not reproduce.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rolloutpipe.bench.bound import EngineModel, TrainerModel

Groups = Sequence[Sequence[tuple[int, int]]]  # per group, per sample: (prompt tokens, response tokens)
Request = tuple[int, int]  # (group, sample)


def rollout(
    groups: Groups, eng: EngineModel, order: Sequence[Request] | None = None,
    placed: Sequence[Sequence[Request]] | None = None,
) -> list[float]:  # fmt: skip
    """Each group's completion time (emulated s from the first admission).

    ``order``: one global queue in that order (late binding).  ``placed``: per engine, its own queue
    (a measured run's placement); exactly one of the two.
    """
    if (order is None) == (placed is None):
        raise ValueError("give an admission order or a placement, not both or neither")
    a, c, p, S = eng.decode_base_s, eng.decode_per_seq_s, eng.prefill_s, eng.slots
    E = eng.engines if placed is None else len(placed)
    shared: deque[Request] = deque(order or [])
    own = [deque(q) for q in placed] if placed is not None else []
    rem: list[np.ndarray] = [np.zeros(0) for _ in range(E)]  # tokens left, per running sequence
    gid: list[np.ndarray] = [np.zeros(0, dtype=int) for _ in range(E)]
    stall = [0.0] * E
    left = [len(g) for g in groups]
    done = [0.0] * len(groups)
    t = 0.0

    def join(e: int, req: Request) -> None:
        g, s = req
        rem[e] = np.append(rem[e], float(groups[g][s][1]))
        gid[e] = np.append(gid[e], g)
        stall[e] += p

    while True:
        if placed is None:
            while shared:
                e = max(range(E), key=lambda i: (S - len(rem[i]), -i))
                if len(rem[e]) >= S:
                    break
                join(e, shared.popleft())
        else:
            for e in range(E):
                while own[e] and len(rem[e]) < S:
                    join(e, own[e].popleft())
        busy = [e for e in range(E) if len(rem[e])]
        if not busy:
            break
        dt = min(stall[e] + float(rem[e].min()) * (a + c * len(rem[e])) for e in busy)
        t += dt
        for e in busy:
            run = dt - stall[e]
            stall[e] = max(0.0, -run)
            if run <= 0:
                continue
            rem[e] = rem[e] - run / (a + c * len(rem[e]))
            fin = rem[e] <= 1e-9
            for g in gid[e][fin]:
                left[g] -= 1
                if left[g] == 0:
                    done[g] = t
            rem[e], gid[e] = rem[e][~fin], gid[e][~fin]
    return done


def train_end(
    groups: Groups, done: Sequence[float], eng: EngineModel, tr: TrainerModel, barrier: bool = False
) -> float:
    """The step's r2t in wall seconds: groups trained FIFO as they complete (``barrier``: all after
    the last one), an optimizer step after every ``gpm`` groups and after the last."""
    es, ts = eng.time_scale, tr.time_scale
    ready = [d * es for d in done]
    if barrier:
        ready = [max(ready)] * len(ready)
    t = 0.0
    order = sorted(range(len(groups)), key=lambda g: ready[g])
    for i, g in enumerate(order):
        t = max(t, ready[g]) + tr.group_s(sum(pt + rt for pt, rt in groups[g])) * ts
        if (i + 1) % tr.groups_per_minibatch == 0 or i + 1 == len(order):
            t += tr.optimizer_step_s * ts
    return t


def schedules(groups: Groups, gpm: int) -> dict[str, list[Request]]:
    """The family's admission orders (the module's docstring)."""
    n = len(groups)
    longest = [max(rt for _, rt in g) for g in groups]
    tokens = [sum(rt for _, rt in g) for g in groups]

    def by_group(idx: Sequence[int]) -> list[Request]:
        return [(g, s) for g in idx for s in range(len(groups[g]))]

    lpt = sorted(range(n), key=lambda g: (-longest[g], g))
    spt = sorted(range(n), key=lambda g: (longest[g], g))
    out = {
        "fifo": by_group(range(n)),
        "lpt": by_group(lpt),
        "spt": by_group(spt),
        "lpt-tokens": by_group(sorted(range(n), key=lambda g: (-tokens[g], g))),
        "sample-lpt": sorted(((g, s) for g in range(n) for s in range(len(groups[g]))),
                             key=lambda r: (-groups[r[0]][r[1]][1], r)),
    }  # fmt: skip
    for k in sorted({gpm, 2 * gpm, n // 4, n // 2}):
        if 0 < k < n:
            first = spt[:k]
            rest = [g for g in lpt if g not in set(first)]
            out[f"spt-{k}-then-lpt"] = by_group([*first, *rest])
    return out


@dataclass(frozen=True)
class Oracle:
    r2t: float  # wall seconds: the best schedule's rollout-to-train-end
    schedule: str  # which one
    fifo: float  # the fifo schedule's (cgp on the model), for the reader


def oracle(groups: Groups, eng: EngineModel, tr: TrainerModel) -> Oracle:
    """The best r2t over :func:`schedules`, each with the FIFO trainer."""
    if not groups or any(not g for g in groups):
        raise ValueError("a step's oracle needs at least one group, each with at least one sample")
    got = {
        name: train_end(groups, rollout(groups, eng, order=order), eng, tr)
        for name, order in schedules(groups, tr.groups_per_minibatch).items()
    }
    best = min(got, key=lambda k: (got[k], k))
    return Oracle(got[best], best, got["fifo"])


def replay(
    groups: Groups, placed: Sequence[Sequence[Request]], eng: EngineModel, tr: TrainerModel, barrier: bool
) -> float:
    """A measured step's own placement and per-engine admission order, played on the model."""
    return train_end(groups, rollout(groups, eng, placed=placed), eng, tr, barrier)


def sync_model(groups: Groups, eng: EngineModel, tr: TrainerModel) -> float:
    """slime's synchronous step on the model: fifo admission, then all the training."""
    return train_end(groups, rollout(groups, eng, order=schedules(groups, 1)["fifo"]), eng, tr, barrier=True)


def share(sync_s: float, mode_s: float, ref_s: float) -> float:
    """The share of the reference's cut (sync - ref) that a mode's cut (sync - mode) captures."""
    return (sync_s - mode_s) / (sync_s - ref_s) if sync_s > ref_s else math.nan
