"""The best clairvoyant schedule of a step in a stated family: the paper suite's reachable reference.

Why it exists (issue 26): the bound (``bench/bound.py``) is a figure no schedule beats, but no
schedule need reach it either, so "share of the bound's cut" divides by a cut that may not exist.
The oracle knows every response length in advance and plays each schedule of a family on the
same cost models as the emulated engine and trainer; its best rollout-to-train-end is one that a
schedule *reaches* on the model.  A mode's share of the oracle's cut is then a share of what is
achievable.  A measured mode may still beat the oracle (it may use a schedule outside the family,
such as FGD's window); nothing beats the bound, and ``bound <= oracle`` always (tests pin it).

The model, in emulated seconds (``engines/emulated.py`` without a KV-cache limit;
``roles/trainer/backends.py``; the cache is below):

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

**With a KV cache** (``EngineModel.kv_tokens`` > 0, the paper-kv suite): :func:`rollout_kv` plays
the emulated engine's cache as its docstring states it (blocks, admission only where the head's
blocks fit, preemption by the engine's victim rule with recompute, a decode step that reads every
cached token), written again here and checked against the engine's own code run in virtual time
(``tests/unit/test_oracle_kv.py``).  Each schedule's order is then also its priority, so the
engine's victim is the sequence latest in the schedule; the global queue's head goes to an engine
whose cache holds it, and a preempted sequence is readmitted on its own engine first.  The family
is each order twice: as it comes, with its preemptions, and ``+reserve``, admitted only where the
final contexts of an engine's running sequences fit its cache (clairvoyant: nothing is ever
preempted, at the price of empty slots).  A schedule outside the family may still beat it.

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
    if eng.kv_tokens or eng.decode_per_kv_token_s:
        return rollout_kv(groups, eng, order, placed)[0]
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


class _Seq:
    """A sequence on a KV-limited engine: its request, length, tokens decoded, priority, arrival."""

    __slots__ = ("arrival", "done", "length", "prio", "prompt", "req")

    def __init__(self, req: Request, prompt: int, length: int, prio: int, arrival: int) -> None:
        self.req, self.prompt, self.length, self.prio, self.arrival = req, prompt, length, prio, arrival
        self.done = 0.0

    def context(self) -> int:  # tokens it holds in the cache: prompt and whole decoded tokens
        return self.prompt + int(self.done + 1e-6)


class _KvEngine:
    """One KV-limited engine of ``engines/emulated.py``, written again from its docstring: blocks of
    ``kv_block_tokens``; admission in queue order only when the head's blocks fit; when the next
    decode step needs a block that is not free, preempt (vLLM: the largest (priority, arrival);
    SGLang: the fewest decoded tokens) until it fits, the victim keeping its whole tokens and
    re-queued to pay the prefill of prompt + tokens again; no admission in a step that preempted;
    a step costs ``a + c*n + k*cached``."""

    def __init__(self, eng: EngineModel, reserve: bool = False) -> None:
        self.m = eng
        self.reserve = reserve  # admit only where every running sequence's final context fits
        self.B = eng.kv_block_tokens
        self.cap = eng.kv_tokens // self.B if eng.kv_tokens else 1 << 62
        self.run: list[_Seq] = []
        self.wait: list[_Seq] = []  # its own queue: preempted sequences (and a placement's requests)
        self.stall = 0.0  # emulated s of prefill the batch still owes
        self.victims: list[Request] = []  # every preemption, in order

    def blocks(self, s: _Seq, ahead: int = 1) -> int:
        return -(-(s.context() + ahead) // self.B)

    def free_blocks(self) -> int:
        return self.cap - sum(self.blocks(s) for s in self.run)

    def make_room(self) -> bool:
        preempted = False
        while self.run and self.free_blocks() < 0:
            if self.m.preemption == "sglang":
                v = min(self.run, key=lambda s: (int(s.done + 1e-6), -s.prompt))
            else:
                v = max(self.run, key=lambda s: (s.prio, s.arrival))
            self.run.remove(v)
            v.done = float(int(v.done + 1e-6))
            self.wait.append(v)  # readmitted by (priority, arrival), as vLLM's priority queue
            self.victims.append(v.req)
            preempted = True
        return preempted

    def fits(self, s: _Seq) -> bool:
        if len(self.run) >= self.m.slots:
            return False
        if self.reserve:  # clairvoyant: the blocks each will hold at its last token
            final = sum(-(-(x.prompt + x.length) // self.B) for x in (*self.run, s))
            return final <= self.cap or not self.run
        return self.blocks(s) <= self.free_blocks()

    def admit(self, s: _Seq) -> None:
        self.run.append(s)
        self.stall += self.m.prefill_per_token_s * s.context() if s.done else self.m.prefill_s

    def admit_own(self) -> None:
        self.wait.sort(key=lambda s: (s.prio, s.arrival))
        while self.wait and self.fits(self.wait[0]):
            self.admit(self.wait.pop(0))

    def kv_steps(self) -> float:
        """Decode steps before one needs a block that is not free (>= 1 after make_room)."""
        if not self.m.kv_tokens:
            return math.inf
        ctx = np.fromiter((s.context() for s in self.run), np.int64, len(self.run))
        n, B = len(ctx), self.B
        lo, hi = 0, max(0, (self.cap * B - int(ctx.sum())) // n)
        while lo < hi:  # the largest k whose blocks fit
            mid = (lo + hi + 1) // 2
            if int((-(-(ctx + mid) // B)).sum()) <= self.cap:
                lo = mid
            else:
                hi = mid - 1
        return float(lo)

    def first_step_s(self) -> float:
        n, k = len(self.run), self.m.decode_per_kv_token_s
        cached = sum(s.context() for s in self.run) if k else 0
        return self.m.decode_base_s + self.m.decode_per_seq_s * n + k * cached

    def decode_s(self, steps: float) -> float:  # each step reads one more token a sequence
        n, k = len(self.run), self.m.decode_per_kv_token_s
        return steps * self.first_step_s() + k * n * steps * (steps - 1) / 2

    def decoded_in(self, seconds: float) -> float:  # the inverse of decode_s
        n, k, first = len(self.run), self.m.decode_per_kv_token_s, self.first_step_s()
        if k == 0 or seconds <= 0:
            return max(0.0, seconds) / first
        qa, qb = k * n / 2, first - k * n / 2
        return (-qb + math.sqrt(qb * qb + 4 * qa * seconds)) / (2 * qa)


def rollout_kv(
    groups: Groups, eng: EngineModel, order: Sequence[Request] | None = None,
    placed: Sequence[Sequence[Request]] | None = None, reserve: bool = False,
) -> tuple[list[float], list[Request]]:  # fmt: skip
    """:func:`rollout` on KV-limited engines (``eng.kv_tokens``; the model in :class:`_KvEngine`):
    each group's completion time and the preempted requests (engine by engine, each in order).  A
    request's priority is its place in ``order`` (or in its engine's queue), so the engine preempts
    the latest of the schedule first.
    With ``order``, the queue's head goes to the engine with the most free slots among those whose
    cache holds it (the lowest index on a tie) and otherwise waits; a preempted sequence stays on its
    engine and is readmitted there before anything new.  ``reserve`` (clairvoyant): a request is
    admitted only where the final contexts of the engine's running sequences and its own fit the
    cache, so nothing is ever preempted (and slots may stay empty)."""
    if (order is None) == (placed is None):
        raise ValueError("give an admission order or a placement, not both or neither")
    E = eng.engines if placed is None else len(placed)
    es = [_KvEngine(eng, reserve) for _ in range(E)]
    arrivals = 0

    def seq(req: Request, prio: int) -> _Seq:
        nonlocal arrivals
        g, s = req
        arrivals += 1
        return _Seq(req, groups[g][s][0], groups[g][s][1], prio, arrivals)

    shared = deque(seq(r, i) for i, r in enumerate(order or []))
    if placed is not None:
        for e, q in zip(es, placed, strict=True):
            e.wait = [seq(r, i) for i, r in enumerate(q)]
    left = [len(g) for g in groups]
    done = [0.0] * len(groups)
    t = 0.0
    while True:
        for e in es:
            if not e.make_room():  # no admission in a step that preempted
                e.admit_own()
        while shared:
            ok = [i for i, e in enumerate(es) if not e.wait and e.fits(shared[0])]
            if not ok:
                break
            i = max(ok, key=lambda j: (eng.slots - len(es[j].run), -j))
            es[i].admit(shared.popleft())
        busy = [e for e in es if e.run]
        if not busy:
            if shared or any(e.wait for e in es):
                raise ValueError("a request's context does not fit an empty engine's cache")
            break
        room = [e.kv_steps() for e in busy]  # each engine's next event: a completion or a full cache
        dt = min(e.stall + e.decode_s(min(min(s.length - s.done for s in e.run), r))
                 for e, r in zip(busy, room, strict=True))  # fmt: skip
        t += dt
        for e, r in zip(busy, room, strict=True):
            run_t = dt - e.stall
            e.stall = max(0.0, -run_t)
            if run_t <= 0:
                continue
            adv = min(e.decoded_in(run_t), r)
            still = []
            for s in e.run:
                s.done += adv
                if s.done >= s.length - 1e-6:
                    g = s.req[0]
                    left[g] -= 1
                    if left[g] == 0:
                        done[g] = t
                else:
                    still.append(s)
            e.run = still
    return done, [v for e in es for v in e.victims]


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
    preemptions: int = 0  # the best schedule's KV preemptions (0 without a cache)
    fifo_preemptions: int = 0


def oracle(groups: Groups, eng: EngineModel, tr: TrainerModel) -> Oracle:
    """The best r2t over :func:`schedules`, each with the FIFO trainer (on KV-limited engines too:
    each schedule's order is then also its priority, :func:`rollout_kv`)."""
    if not groups or any(not g for g in groups):
        raise ValueError("a step's oracle needs at least one group, each with at least one sample")
    got: dict[str, tuple[float, int]] = {}
    for name, order in schedules(groups, tr.groups_per_minibatch).items():
        if eng.kv_tokens or eng.decode_per_kv_token_s:
            done, victims = rollout_kv(groups, eng, order=order)
            if eng.kv_tokens:  # the same order admitted so that nothing is preempted
                held, _ = rollout_kv(groups, eng, order=order, reserve=True)
                got[f"{name}+reserve"] = (train_end(groups, held, eng, tr), 0)
        else:
            done, victims = rollout(groups, eng, order=order), []
        got[name] = (train_end(groups, done, eng, tr), len(victims))
    best = min(got, key=lambda k: (got[k][0], k))
    return Oracle(got[best][0], best, got["fifo"][0], got[best][1], got["fifo"][1])


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
