"""The r2t bound (``rolloutpipe/bench/bound.py``) against an independent simulation of the same models.

The simulator below is written from the cost models' definitions, not from the bound: engines
with continuous batching (a step of n sequences costs a + c*n, a prefill stalls the batch), any
admission order, engine assignment, window and batch cap, then a serial trainer (pipelined or
barrier).  No schedule it can produce may beat the bound; and in cases where the bound is exact
(one group; everything on one slot) it must be met, so a bound that is too high fails too.
"""

from __future__ import annotations

import math
import random

import pytest

from rolloutpipe.bench.bound import EngineModel, TrainerModel, r2t_bound, wait_ratio_bound


def simulate(groups, eng, tr, *, order, assign, cap, window, barrier):
    """One step of the emulated system.  Returns (r2t, trainer busy).  ``order``: request order;
    ``assign(i)``: the engine of the i-th admitted request; ``cap``: at most this many running per
    engine (<= slots); ``window``: at most this many groups started beyond those complete."""
    a, c, p = eng.decode_base_s, eng.decode_per_seq_s, eng.prefill_s
    left = {gi: len(g) for gi, g in enumerate(groups)}
    done_at: dict[int, float] = {}
    running: list[list[list[float]]] = [[] for _ in range(eng.engines)]  # [tokens left, group]
    prefill_due = [0.0] * eng.engines
    queue = list(order)
    started: set[int] = set()
    t, admitted = 0.0, 0
    while queue or any(running):
        # admit
        while queue:
            open_new = len(started) - len(done_at) < window
            pick = next((i for i, (gi, _) in enumerate(queue) if gi in started or open_new), None)
            e = assign(admitted)
            if pick is None or len(running[e]) >= cap:
                break
            gi, si = queue.pop(pick)
            started.add(gi)
            running[e].append([float(groups[gi][si][1]), gi])
            prefill_due[e] += p
            admitted += 1
        # advance to the next completion
        dts = [prefill_due[e] + min(x[0] for x in r) * (a + c * len(r)) for e, r in enumerate(running) if r]
        dt = min(dts)
        for e, r in enumerate(running):
            if not r:
                continue
            pf = min(prefill_due[e], dt)
            prefill_due[e] -= pf
            adv = (dt - pf) / (a + c * len(r))
            keep = []
            for x in r:
                x[0] -= adv
                if x[0] <= 1e-9:
                    left[x[1]] -= 1
                    if left[x[1]] == 0:
                        done_at[x[1]] = t + dt
                else:
                    keep.append(x)
            running[e] = keep
        t += dt
    # the trainer: groups in completion order, an optimizer step every gpm groups and at the end
    tau = {gi: tr.group_s(sum(pt + rt for pt, rt in g)) for gi, g in enumerate(groups)}
    gpm, now, busy = tr.groups_per_minibatch, 0.0, 0.0
    arrivals = sorted(done_at, key=done_at.get)  # type: ignore[arg-type]
    start_all = max(done_at.values()) if barrier else 0.0
    for i, gi in enumerate(arrivals):
        now = max(now, done_at[gi], start_all) + tau[gi]
        busy += tau[gi]
        if (i + 1) % gpm == 0 or i + 1 == len(arrivals):
            now += tr.optimizer_step_s
            busy += tr.optimizer_step_s
    return now, busy


def random_case(rng: random.Random):
    eng = EngineModel(
        engines=rng.randint(1, 3),
        slots=rng.randint(1, 8),
        decode_base_s=rng.uniform(0.001, 0.01),
        decode_per_seq_s=rng.uniform(0.0, 0.002),
        prefill_s=rng.uniform(0.0, 0.01),
    )
    n_groups = rng.randint(1, 10)
    gpm = rng.randint(1, n_groups)
    tr = TrainerModel(
        tokens_per_s=rng.uniform(500, 50_000),
        passes=rng.choice([1.0, 4 / 3]),
        call_overhead_s=rng.uniform(0, 0.05),
        optimizer_step_s=rng.uniform(0, 0.1),
        groups_per_minibatch=gpm,
    )
    G = rng.randint(1, 6)
    share = rng.random()
    groups = []
    for _ in range(n_groups):
        zp = rng.gauss(0, 1)
        zs = [share**0.5 * zp + (1 - share) ** 0.5 * rng.gauss(0, 1) for _ in range(G)]
        groups.append([(16, max(1, min(400, round(math.exp(3.5 + 0.9 * z))))) for z in zs])
    return groups, eng, tr


@pytest.mark.parametrize("seed", range(400))
def test_no_simulated_schedule_beats_the_bound(seed: int) -> None:
    rng = random.Random(seed)
    groups, eng, tr = random_case(rng)
    b = r2t_bound(groups, eng, tr)
    reqs = [(gi, si) for gi, g in enumerate(groups) for si in range(len(g))]
    for trial in range(6):
        order = list(reqs)
        if trial == 1:  # longest groups first
            order.sort(key=lambda r: -max(rt for _, rt in groups[r[0]]))
        elif trial == 2:  # shortest groups first
            order.sort(key=lambda r: max(rt for _, rt in groups[r[0]]))
        elif trial >= 3:
            rng.shuffle(order)
        E = eng.engines
        assign = (lambda i, E=E: i % E) if trial % 2 else (lambda i, E=E: rng.randrange(E))
        cap = rng.randint(1, eng.slots)
        window = rng.choice([1, 2, len(groups)])
        for barrier in (False, True):
            r2t, busy = simulate(groups, eng, tr, order=order, assign=assign, cap=cap, window=window,
                                 barrier=barrier)  # fmt: skip
            assert r2t >= b.r2t * (1 - 1e-9), (seed, trial, barrier, r2t, b)
            assert busy == pytest.approx(b.train_busy)
            assert 1 - busy / r2t >= wait_ratio_bound(b.train_busy, b.r2t) - 1e-9


def test_the_bound_is_met_where_it_is_exact() -> None:
    """One group of one sample: prefill, L steps at batch 1, its training, one optimizer step."""
    eng = EngineModel(engines=2, slots=4, decode_base_s=0.01, decode_per_seq_s=0.001, prefill_s=0.05)
    tr = TrainerModel(tokens_per_s=1000, passes=1.0, call_overhead_s=0.02, optimizer_step_s=0.3,
                      groups_per_minibatch=1)  # fmt: skip
    groups = [[(10, 100)]]
    b = r2t_bound(groups, eng, tr)
    exact = 0.05 + 100 * 0.011 + (0.02 + 110 / 1000) + 0.3
    assert b.r2t == pytest.approx(exact)
    r2t, _ = simulate(groups, eng, tr, order=[(0, 0)], assign=lambda i: 0, cap=4, window=1, barrier=False)
    assert r2t == pytest.approx(exact)


def test_a_training_bound_step_is_bounded_by_the_trainer() -> None:
    """Slow training: the bound is the first group's readiness plus all training, and a
    shortest-first schedule on one slot per group meets it."""
    eng = EngineModel(engines=4, slots=1, decode_base_s=0.001, decode_per_seq_s=0.0, prefill_s=0.0)
    tr = TrainerModel(tokens_per_s=10, passes=1.0, call_overhead_s=0.0, optimizer_step_s=0.0,
                      groups_per_minibatch=2)  # fmt: skip
    groups = [[(0, 10)], [(0, 20)], [(0, 30)], [(0, 40)]]
    b = r2t_bound(groups, eng, tr)
    assert b.r2t == pytest.approx(10 * 0.001 + (10 + 20 + 30 + 40) / 10)
    assert b.trainer == b.r2t
    r2t, _ = simulate(groups, eng, tr, order=[(i, 0) for i in range(4)], assign=lambda i: i, cap=1,
                      window=4, barrier=False)  # fmt: skip
    assert r2t == pytest.approx(b.r2t)


def test_wait_ratio_bound() -> None:
    assert wait_ratio_bound(3.0, 4.0) == pytest.approx(0.25)
    assert wait_ratio_bound(5.0, 4.0) == 0.0
    with pytest.raises(ValueError, match="at least one group"):
        r2t_bound([], EngineModel(1, 1, 0.1, 0.0, 0.0), TrainerModel(1.0, 1.0, 0.0, 0.0, 1))
