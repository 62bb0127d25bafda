"""The policy-free KV statistic (``bench/kv_pressure.py``), by hand and against the engine's own
preemption: where the statistic says the cache never fills, the KV-limited engine preempts nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rolloutpipe.bench.kv_pressure import pressure, table


def test_by_hand_two_sequences_on_one_engine() -> None:
    # lengths 10 and 20, no prompt, 1 s a step: demand 2t up to t = 10 (20 tokens), then the
    # survivor's 10 + (t - 10) up to t = 20; a cache of 15 is exceeded over [7.5, 10] and [15, 20]
    p = pressure(np.array([[10, 20]]), 15, prompt=0, engines=1, slots=2, a=1.0, c=0.0)
    assert p.makespan_s == pytest.approx(20.0)
    assert p.peak == pytest.approx(20 / 15)
    assert p.over == pytest.approx(7.5 / 20)
    # mean running context: (int 2t over 0..10 + int t over 10..20) / (2 x 10 + 10) = 250 / 30
    assert p.fit == pytest.approx(15 / (250 / 30))


def test_a_cache_above_the_peak_is_never_exceeded() -> None:
    p = pressure(np.array([[10, 20], [5, 7]]), 100, prompt=3, engines=2, slots=1, a=1.0, c=0.5)
    assert p.over == 0.0 and p.peak < 1.0


def test_requests_spread_over_the_engines_as_workers_pulling_at_once() -> None:
    # two requests of 10 tokens and two engines of 2 slots: one each (the suite's workers take about
    # their share of a step, issue 26 part 5), so no engine's demand passes 10 tokens.  Filling
    # engine 0's slots first would put both there: demand 20 against a cache of 15.
    p = pressure(np.array([[10, 10]]), 15, prompt=0, engines=2, slots=2, a=1.0, c=0.0)
    assert p.peak == pytest.approx(10 / 15)
    assert p.over == 0.0


def test_the_paper_settings_are_all_read() -> None:
    rows = table(Path("configs/bench/paper.yaml"), 600_000, seeds=1)
    assert len(rows) == 12 and all(r["peak"] > 0 for r in rows)


@pytest.mark.parametrize(("kv_tokens", "binds"), [(400, False), (128, True)])
async def test_where_the_statistic_says_the_cache_binds_the_engine_preempts(
    kv_tokens: int, binds: bool
) -> None:
    import asyncio

    from rolloutpipe.config import EmulatedEngineConfig
    from rolloutpipe.engines.emulated import EmulatedEngine
    from tests.support.events import engine_request as req

    # 8 sequences of 8 + 40 tokens (blocks of 16 hold them exactly: no rounding between the two)
    p = pressure(np.full((1, 8), 40), kv_tokens, prompt=8, engines=1, slots=8, a=0.001, c=0.0)
    assert (p.over > 0) == binds
    eng = EmulatedEngine(EmulatedEngineConfig(max_num_seqs=8, decode_base_s=0.001, decode_per_seq_s=0.0,
                                              prefill_per_token_s=0.0, prompt_tokens=8, length_median=40,
                                              length_sigma=0.0, max_response_tokens=40, time_scale=0.02,
                                              kv_cache_tokens=kv_tokens))  # fmt: skip
    await eng.start()
    await asyncio.gather(*(eng.generate(req(i)) for i in range(8)))
    await eng.close()
    assert bool(eng.kv_preemptions) == binds
