"""The paper suite's oracle (bench/oracle.py): its simulator checked against hand sums and an
independent simulator, and its place between the bound and the schedules it contains."""

from __future__ import annotations

import numpy as np
import pytest

from rolloutpipe.bench import admission_oracle
from rolloutpipe.bench.bound import EngineModel, TrainerModel, r2t_bound
from rolloutpipe.bench.oracle import oracle, replay, rollout, schedules, sync_model, train_end
from tests.support.lengths import workload

TR = TrainerModel(tokens_per_s=1000.0, passes=1.0, call_overhead_s=0.01, optimizer_step_s=0.03,
                  groups_per_minibatch=2)  # fmt: skip


def test_one_slot_is_a_sum_by_hand() -> None:
    eng = EngineModel(engines=1, slots=1, decode_base_s=0.01, decode_per_seq_s=0.001, prefill_s=0.5)
    groups = [[(5, 10), (5, 20)], [(5, 30)]]
    done = rollout(groups, eng, order=[(1, 0), (0, 1), (0, 0)])
    step = 0.011
    t1 = 0.5 + 30 * step
    t2 = t1 + 0.5 + 20 * step
    t3 = t2 + 0.5 + 10 * step
    assert done == pytest.approx([t3, t1])
    # trainer: group 1 at t1 (35 tokens), group 0 at t3 (40 tokens), one mini-batch of 2
    want = max(t1 + 0.01 + 35 / 1000, t3) + 0.01 + 40 / 1000 + 0.03
    assert train_end(groups, done, eng, TR) == pytest.approx(want)
    assert train_end(groups, done, eng, TR, barrier=True) == pytest.approx(t3 + 0.02 + 75 / 1000 + 0.03)


@pytest.mark.parametrize("seed", range(4))
def test_one_engine_matches_an_independent_simulator(seed: int) -> None:
    """admission_oracle.simulate is a separate implementation of the same engine (no prefill)."""
    groups = workload(seed)
    L = np.array([[rt for _, rt in g] for g in groups])
    order = schedules(groups, 2)["lpt"]
    eng = EngineModel(engines=1, slots=7, decode_base_s=0.006, decode_per_seq_s=0.00008, prefill_s=0.0)
    want = admission_oracle.simulate(L, order, engines=1, slots=7, a=0.006, c=0.00008)
    assert rollout(groups, eng, order=order) == pytest.approx(list(want), rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_the_oracle_lies_between_the_bound_and_every_schedule_of_its_family(seed: int) -> None:
    groups = workload(seed)
    eng = EngineModel(engines=2, slots=8, decode_base_s=0.006, decode_per_seq_s=0.0008, prefill_s=0.002,
                      time_scale=0.5)  # fmt: skip
    tr = TrainerModel(5000.0, 2.0, 0.01, 0.03, 3, time_scale=0.5)
    best = oracle(groups, eng, tr)
    b = r2t_bound(groups, eng, tr).r2t
    assert b <= best.r2t * (1 + 1e-9)
    every = [train_end(groups, rollout(groups, eng, order=o), eng, tr) for o in schedules(groups, 3).values()]
    assert best.r2t == pytest.approx(min(every)) and best.fifo == pytest.approx(every[0])
    assert sync_model(groups, eng, tr) >= best.fifo  # a barrier only adds waiting


def test_a_replay_on_one_engine_is_the_global_queue_in_that_order() -> None:
    """With one engine the placement is forced: replay() and the global queue must agree."""
    groups = workload(7, n=6, g=3)
    one = EngineModel(engines=1, slots=2, decode_base_s=0.01, decode_per_seq_s=0.001, prefill_s=0.3)
    order = schedules(groups, 2)["spt"]
    for barrier in (False, True):
        assert replay(groups, [order], one, TR, barrier) == pytest.approx(
            train_end(groups, rollout(groups, one, order=order), one, TR, barrier)
        )
    with pytest.raises(ValueError, match="not both"):
        rollout(groups, one)
