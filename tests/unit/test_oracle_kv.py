"""The oracle on KV-limited engines (bench/oracle.py ``rollout_kv``, issue 26): its simulator written
again from the emulated engine's docstring, checked against the engine's own code run in virtual
time, against the unlimited simulator, and its place between the bound and its family."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from rolloutpipe.bench.bound import EngineModel, TrainerModel, r2t_bound
from rolloutpipe.bench.oracle import oracle, rollout, rollout_kv, schedules, sync_model, train_end
from rolloutpipe.config import EmulatedEngineConfig
from rolloutpipe.engines import emulated
from rolloutpipe.engines.emulated import EmulatedEngine
from tests.support.events import engine_request as req
from tests.support.lengths import workload


def kv_model(eng: EngineModel, kv: int, k: float = 0.0, preemption: str = "vllm") -> EngineModel:
    return EngineModel(eng.engines, eng.slots, eng.decode_base_s, eng.decode_per_seq_s, eng.prefill_s,
                       eng.time_scale, kv_tokens=kv, kv_block_tokens=16, decode_per_kv_token_s=k,
                       prefill_per_token_s=eng.prefill_s / 20, preemption=preemption)  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_a_cache_that_never_fills_is_the_unlimited_simulator(seed: int) -> None:
    """Two engines, a global queue: the late binding of rollout_kv against rollout's."""
    groups = workload(seed)
    eng = EngineModel(engines=2, slots=5, decode_base_s=0.006, decode_per_seq_s=0.0008, prefill_s=0.002)
    for order in schedules(groups, 3).values():
        done, victims = rollout_kv(groups, kv_model(eng, 10**9), order=order)
        assert done == pytest.approx(rollout(groups, eng, order=order), rel=1e-9) and not victims


async def engine_in_virtual_time(c: EmulatedEngineConfig, n: int, monkeypatch: pytest.MonkeyPatch):
    """The emulated engine's own loop with its clock replaced by a virtual one: every request of
    priority i submitted at once; each one's completion time (emulated s) and the preemptions."""
    clock = [0.0]

    async def wait_event(ev: asyncio.Event, timeout: float) -> bool:
        if ev.is_set():
            return True
        await asyncio.sleep(0)  # the requests that just completed record the time first
        clock[0] += timeout
        return False

    monkeypatch.setattr(emulated, "wait_event", wait_event)
    monkeypatch.setattr(emulated, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    eng = EmulatedEngine(c)
    ends: dict[int, float] = {}

    async def one(i: int) -> None:
        await eng.generate(req(i, priority=i))
        ends[i] = clock[0] / c.time_scale

    await asyncio.gather(*(one(i) for i in range(n)))
    await eng.close()
    lengths = [eng.response_length(req(i)) for i in range(n)]
    return [ends[i] for i in range(n)], [p.request_id for p in eng.kv_preemptions], lengths


@pytest.mark.parametrize(("preemption", "k"), list(itertools.product(("vllm", "sglang"), (0.0, 2e-6))))
async def test_one_engine_is_the_emulated_engine_run_in_virtual_time(
    preemption: str, k: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same completion times and the same victims, in the same order, as the engine's code."""
    c = EmulatedEngineConfig(max_num_seqs=6, decode_base_s=0.001, decode_per_seq_s=0.0001,
                             prefill_per_token_s=0.0005, prompt_tokens=8, length_median=60, length_sigma=0.7,
                             max_response_tokens=200,
                             time_scale=0.5, kv_cache_tokens=320, kv_block_tokens=16, preemption=preemption,
                             scheduling_policy="priority", decode_per_kv_token_s=k)  # fmt: skip
    n = 14
    ends, victims, lengths = await engine_in_virtual_time(c, n, monkeypatch)
    groups = [[(8, L)] for L in lengths]  # a group a request
    eng = EngineModel(1, 6, 0.001, 0.0001, 0.0005 * 8, 0.5, kv_tokens=320, kv_block_tokens=16,
                      decode_per_kv_token_s=k, prefill_per_token_s=0.0005, preemption=preemption)  # fmt: skip
    done, mine = rollout_kv(groups, eng, placed=[[(i, 0) for i in range(n)]])
    assert len(victims) >= 3  # the cache binds: the check is not vacuous
    assert [f"0:{g}:0" for g, _ in mine] == victims
    assert done == pytest.approx(ends, rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_the_kv_oracle_lies_between_the_bound_and_every_schedule_of_its_family(seed: int) -> None:
    groups = workload(seed)
    base = EngineModel(engines=2, slots=8, decode_base_s=0.006, decode_per_seq_s=0.0008, prefill_s=0.002,
                       time_scale=0.5)  # fmt: skip
    longest = max(pt + rt for g in groups for pt, rt in g)
    eng = kv_model(base, max(1500, longest + 16), k=1e-6)  # it holds the longest sequence (as vLLM must)
    tr = TrainerModel(5000.0, 2.0, 0.01, 0.03, 3, time_scale=0.5)
    assert rollout_kv(groups, eng, order=schedules(groups, 3)["fifo"])[1]  # the cache binds here
    best = oracle(groups, eng, tr)
    assert r2t_bound(groups, eng, tr).r2t <= best.r2t * (1 + 1e-9)  # the bound holds with a cache
    every = [train_end(groups, rollout(groups, eng, order=o), eng, tr) for o in schedules(groups, 3).values()]
    assert best.r2t == pytest.approx(min(every)) and best.fifo == pytest.approx(every[0])
    assert sync_model(groups, eng, tr) >= best.fifo
    # a cache only adds cost: no schedule is faster with one than without
    assert best.r2t >= oracle(groups, base, tr).r2t * (1 - 1e-9)


def test_a_request_that_cannot_fit_an_empty_engine_is_refused() -> None:
    eng = EngineModel(1, 4, 0.001, 0.0, 0.0, kv_tokens=32, kv_block_tokens=16)
    with pytest.raises(ValueError, match="does not fit"):
        rollout_kv([[(40, 5)]], eng, order=[(0, 0)])


@pytest.mark.parametrize("seed", range(3))
def test_reserve_never_preempts_and_never_overfills_the_cache(seed: int) -> None:
    groups = workload(seed)
    longest = max(pt + rt for g in groups for pt, rt in g)
    eng = kv_model(EngineModel(2, 8, 0.006, 0.0008, 0.002), max(1500, longest + 16))
    binds = False
    for order in schedules(groups, 3).values():
        done, victims = rollout_kv(groups, eng, order=order, reserve=True)
        assert not victims and all(d > 0 for d in done)
        binds = binds or bool(rollout_kv(groups, eng, order=order)[1])
    assert binds  # without reserve the cache preempts: the check is not vacuous
    best = oracle(groups, eng, TrainerModel(5000.0, 2.0, 0.01, 0.03, 3))
    names = [f"{n}{r}" for n in schedules(groups, 3) for r in ("", "+reserve")]
    assert best.schedule in names
