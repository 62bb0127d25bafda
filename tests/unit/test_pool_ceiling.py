"""The multiplex suite's simulated ceiling (``bench/pool_ceiling.py``), checked against an
independent implementation of the same engine model and against cases worked by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from rolloutpipe.bench import admission_oracle as oracle
from rolloutpipe.bench.pool_ceiling import Model, ceiling, simulate, steady, steady_of

SMALL = Model(prompts=16, group=4, minibatches=2, steps=4, slots=16, median=400, cap=2000)


@pytest.mark.parametrize("barrier", [False, True])
def test_one_run_on_its_own_engines_matches_the_admission_oracles_replay(barrier: bool) -> None:
    """One step of one run, prefill off: the group completions of ``admission_oracle.simulate`` (a
    separate implementation of continuous batching with late binding) and its trainer give the
    same step end."""
    m = Model(prefill_s=0.0, steps=1, barrier=barrier)
    t = simulate(1, 2, m, "static", seed=3)
    L = oracle.lengths(m.prompts, m.group, m.median, m.sigma, m.cap, m.share, 3 * 7919)
    done = oracle.simulate(L, oracle.orders(L)["fifo"])
    gpm = m.prompts // m.minibatches
    end, train, _ = oracle.trainer_end(done, L, gpm)
    want = done.max() + train if barrier else end
    assert t.ends[0][0] == pytest.approx(want, rel=1e-9)


def test_equal_lengths_by_hand() -> None:
    """sigma 0: every response is the median.  One engine, 8 sequences of 100 tokens: 8 prefills,
    then 100 decode steps at batch 8; then the trainer's 2 groups and 1 optimizer step."""
    m = Model(prompts=2, group=4, minibatches=1, steps=2, slots=8, median=100, sigma=0.0, cap=1000,
              prefill_s=0.001, barrier=True)  # fmt: skip
    t = simulate(1, 1, m, "static")
    roll = 8 * 0.001 + 100 * (m.a + m.c * 8)
    train = 2 * (m.call_s + 4 * (100 + m.prompt_tokens) / m.tps) + m.opt_s
    assert t.ends[0][0] == pytest.approx(roll + train)
    assert t.starts[0][1] == pytest.approx(roll + train)  # the next step's requests: at the publish
    assert t.ends[0][1] == pytest.approx(2 * (roll + train))


def test_a_lone_run_gains_nothing_from_a_pool() -> None:
    """One run: nobody to lend to, so ``ideal`` is ``static`` step for step."""
    a, b = simulate(1, 2, SMALL, "static", 1), simulate(1, 2, SMALL, "ideal", 1)
    assert a.ends == b.ends and b.switches == 0


def test_in_sync_the_pool_fills_the_training_phase() -> None:
    """Two sync runs whose training is about as long as their rollout of 4 waves: the pool lends
    each run's engines to the other while it trains, and packing the tails gains on every seed."""
    m = Model(prompts=64, group=4, minibatches=2, steps=8, slots=32, median=300, cap=3000, tps=20000.0,
              barrier=True)  # fmt: skip
    for seed in range(3):
        st = steady_of(simulate(2, 2, m, "static", seed)).samples_per_s
        pack = simulate(2, 2, m, "ideal-pack", seed)
        assert pack.switches > 0
        assert steady_of(pack).samples_per_s > 1.05 * st


def test_the_ceiling_never_falls_below_the_split_it_can_keep() -> None:
    """Greedy lending loses to the split here on seed 1 (a run's next step finds an engine busy
    with the other run's tail); the ceiling is the best schedule, the split among them."""
    m = Model(prompts=32, group=4, minibatches=2, steps=8, slots=32, median=300, cap=3000, tps=30000.0,
              barrier=True)  # fmt: skip
    st = steady_of(simulate(2, 2, m, "static", 1)).samples_per_s
    assert steady_of(simulate(2, 2, m, "ideal", 1)).samples_per_s < st
    c = ceiling(2, 2, m, seeds=2)
    assert all(r >= 1.0 for r in c["per_seed"]) and c["ceiling_ratio"] >= 1.0
    assert set(c["best"]) <= {"static", "ideal", "ideal-pack"}


def test_pack_frees_an_engine_and_conserves_every_sequence() -> None:
    """``ideal-pack`` moves stragglers; every step still completes (each group's samples counted
    once: a lost or doubled sequence would stall the step or end it early)."""
    t = simulate(2, 2, SMALL, "ideal-pack", 2)
    assert all(len(e) == SMALL.steps for e in t.ends)
    assert all(x < y for e in t.ends for x, y in itertools.pairwise(e))
    for s, e in zip(t.starts, t.ends, strict=True):  # a step starts once the one before has ended
        assert all(s2 >= e1 for s2, e1 in zip(s[1:], e, strict=False))


def test_steady_window_and_period() -> None:
    """Two runs, steps ending at 10, 20, ... and 15, 25, ...: the window is [25, 40] (the last run's
    second step, the first run's last), each run trains 1 step (100 samples) per 10 s there."""
    starts = [[0.0, 10, 20, 30], [5.0, 15, 25, 35]]
    ends = [[10.0, 20, 30, 40], [15.0, 25, 35, 45]]
    s = steady(starts, ends, [100, 100])
    assert (s.window_s, s.whole) == (15.0, False)
    assert s.samples_per_s == pytest.approx(20.0)
    assert s.period_s == [10.0, 10.0]


def test_steady_falls_back_to_the_whole_span_for_runs_of_unequal_length() -> None:
    starts, ends = [[0.0, 10.0], [0.0, 10, 20, 30]], [[10.0, 20.0], [10.0, 20, 30, 40]]
    s = steady(starts, ends, [100, 100])
    assert s.whole and s.window_s == 40.0
    assert s.samples_per_s == pytest.approx(600 / 40)
    assert math.isclose(s.period_s[1], 10.0) and np.isfinite(s.period_s[0])
