"""The emulated engine's KV cache: block accounting, whom it preempts, the re-queue, and the decode
time that grows with the cached tokens (issue 26, part 1).  No Redis; the accounting is checked on
hand-built batches, the whole loop on a batch that cannot fit."""

from __future__ import annotations

import asyncio
import itertools
import math
import random

import pytest
from pydantic import ValidationError

from rolloutpipe.config import EmulatedEngineConfig
from rolloutpipe.engines.emulated import EmulatedEngine, _Seq
from rolloutpipe.tools.timeline import preemptions
from tests.support.events import engine_request as req


def cfg(**kw: object) -> EmulatedEngineConfig:
    base = dict(max_num_seqs=8, decode_base_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.001,
                prompt_tokens=8, length_median=40, length_sigma=0.0, max_response_tokens=40,
                time_scale=0.02, kv_cache_tokens=64, kv_block_tokens=16)  # fmt: skip
    base.update(kw)
    return EmulatedEngineConfig(**base)  # type: ignore[arg-type]


def seq(eng: EmulatedEngine, i: int, done: float, priority: int = 0) -> _Seq:
    fut: asyncio.Future = asyncio.get_running_loop().create_future()
    return _Seq(req(i, priority), 40, True, fut, done_tokens=done, arrival=i)


async def test_kv_steps_is_the_largest_step_count_whose_blocks_fit() -> None:
    """Against brute force, one token at a time, on random batches."""
    eng = EmulatedEngine(cfg(kv_cache_tokens=4096, prompt_tokens=0, max_response_tokens=4096))
    rnd = random.Random(7)
    for _ in range(200):
        seqs = [seq(eng, i, rnd.randrange(0, 300) + rnd.random() * 0.9) for i in range(rnd.randrange(1, 12))]
        ctx = [int(s.done_tokens + 1e-6) for s in seqs]
        k = 0
        while sum(math.ceil((c + k + 1) / 16) for c in ctx) <= 4096 // 16:
            k += 1
        assert eng.kv_steps(seqs) == k


async def test_by_hand_two_sequences_of_8_tokens_in_4_blocks_of_16() -> None:
    # each needs ceil((8 + k) / 16) blocks: 2 each while k <= 24
    eng = EmulatedEngine(cfg())
    assert eng.kv_steps([seq(eng, 0, 0.0), seq(eng, 1, 0.0)]) == 24
    assert eng.kv_steps([seq(eng, 0, 0.0)]) == 56  # one sequence alone: 4 blocks hold 64 = 8 + 56


@pytest.mark.parametrize(
    ("preemption", "policy", "victim"),
    [
        ("vllm", "priority", 2),  # the largest (priority, arrival): priority 5
        ("vllm", "fcfs", 3),  # the latest scheduled: the last of the running list
        ("sglang", "priority", 1),  # the fewest decoded tokens
    ],
)
async def test_a_full_cache_preempts_the_engines_victim(preemption: str, policy: str, victim: int) -> None:
    eng = EmulatedEngine(cfg(preemption=preemption, scheduling_policy=policy))
    # the next token needs ceil((8 + 12 + 1) / 16) = 2, 1, 2 and 1 blocks: 6 of 4
    eng.running = [seq(eng, 0, 12.0, 1), seq(eng, 1, 1.0, 1), seq(eng, 2, 14.5, 5), seq(eng, 3, 7.0, 2)]
    assert eng._make_room()
    first = eng.kv_preemptions[0]
    assert first.request_id == f"0:{victim}:0"
    assert sum(eng._blocks(s) for s in eng.running) <= 4
    assert len(eng.running) + len(eng.waiting) == 4  # preempted, not lost
    assert all(not s.fut.done() for s in eng.waiting)  # re-queued inside the engine, not returned


async def test_a_victim_keeps_its_whole_tokens_and_pays_their_prefill_again() -> None:
    eng = EmulatedEngine(cfg(scheduling_policy="fcfs"))
    eng.running = [seq(eng, 0, 30.0), seq(eng, 1, 20.6)]  # 8+31 -> 3 blocks, 8+21 -> 2: 5 > 4
    assert eng._make_room()
    [back] = eng.waiting
    assert back.req.request_id == "0:1:0"  # fcfs: the latest scheduled
    assert back.done_tokens == 20.0  # the partial token went with the cache
    assert back.prefill_left == pytest.approx(0.001 * (8 + 20))  # recompute: prompt + its tokens
    assert eng.kv_preemptions[0].tokens == 20
    assert not eng._make_room()  # it fits now


async def test_fcfs_requeues_a_victim_at_the_front_and_priority_by_its_rank() -> None:
    for policy, head in (("fcfs", "0:3:0"), ("priority", "0:9:0")):
        eng = EmulatedEngine(cfg(scheduling_policy=policy))
        eng.waiting = [seq(eng, 9, 0.0, 0)]  # queued, priority 0
        eng.running = [seq(eng, 0, 30.0, 3), seq(eng, 3, 20.0, 3)]
        assert eng._make_room()
        eng._admit()  # 1 block is free: the queue's head is the victim (2 blocks) or request 9 (1)
        order = [s.req.request_id for s in eng.running + eng.waiting]
        assert order[1] == head, (policy, order)


async def test_admission_waits_for_blocks_and_does_not_skip_the_head() -> None:
    eng = EmulatedEngine(cfg(scheduling_policy="fcfs"))
    eng.running = [seq(eng, 0, 30.0)]  # 3 blocks for its next token: 1 free
    eng.waiting = [seq(eng, 1, 20.0), seq(eng, 2, 0.0)]  # the head needs 2 blocks, the next 1
    eng._admit()
    assert [s.req.request_id for s in eng.running] == ["0:0:0"]
    eng.running = []
    eng._admit()
    assert [s.req.request_id for s in eng.running] == ["0:1:0", "0:2:0"]  # 2 + 1 of 4 blocks


async def test_without_a_limit_nothing_is_preempted_and_admission_fills_the_slots() -> None:
    eng = EmulatedEngine(cfg(kv_cache_tokens=0, max_num_seqs=3))
    eng.waiting = [seq(eng, i, 39.0) for i in range(5)]
    eng._admit()
    assert not eng._make_room() and len(eng.running) == 3


async def test_decode_time_is_the_sum_of_steps_that_each_read_one_more_token() -> None:
    eng = EmulatedEngine(cfg(decode_per_seq_s=0.0002, decode_per_kv_token_s=0.00001))
    eng.running = [seq(eng, 0, 3.0), seq(eng, 1, 10.0), seq(eng, 2, 0.0)]
    cached = (8 + 3) + (8 + 10) + 8
    by_step = sum(0.001 + 0.0002 * 3 + 0.00001 * (cached + 3 * j) for j in range(17))
    assert eng._decode_time(17) == pytest.approx(by_step)
    for steps in (0.0, 0.5, 1.0, 17.0, 123.4):
        assert eng._decoded_in(eng._decode_time(steps)) == pytest.approx(steps)


async def run_all(c: EmulatedEngineConfig, n: int) -> tuple[EmulatedEngine, dict[str, list[int]], int]:
    """The engine, every response's tokens, and the preemptions the responses report."""
    eng = EmulatedEngine(c)
    await eng.start()
    gens = await asyncio.gather(*(eng.generate(req(i, priority=i % 3)) for i in range(n)))
    await eng.close()
    reported = sum(len(g.kv_preempted_at) for g in gens)
    return eng, {f"0:{i}:0": list(g.response_ids) for i, g in enumerate(gens)}, reported


async def test_a_batch_that_cannot_fit_is_preempted_and_every_trajectory_completes_unchanged() -> None:
    """8 requests of 8 + 40 tokens (3 blocks each at the end) in 8 blocks: the cache fills, the
    engine preempts and re-queues, and every response is the same as without a limit."""
    for preemption, policy in itertools.product(("vllm", "sglang"), ("priority", "fcfs")):
        c = cfg(kv_cache_tokens=128, preemption=preemption, scheduling_policy=policy)
        eng, limited, reported = await run_all(c, 8)
        free, unlimited, _ = await run_all(cfg(kv_cache_tokens=0), 8)
        assert limited == unlimited
        assert all(len(v) == 40 for v in limited.values())
        assert eng.kv_preemptions, (preemption, policy)  # 8 sequences reached 3 blocks each: 24 > 8
        assert not free.kv_preemptions
        assert reported == len(eng.kv_preemptions)  # every one reaches the sample (and the timeline)
        assert not eng.running and not eng.waiting


def test_a_cache_that_cannot_hold_one_sequence_is_refused() -> None:
    with pytest.raises(ValidationError, match="cannot hold one sequence"):
        EmulatedEngineConfig(kv_cache_tokens=1000, prompt_tokens=256, max_response_tokens=8192)
    EmulatedEngineConfig(kv_cache_tokens=8448, prompt_tokens=256, max_response_tokens=8192)


def test_the_timeline_reads_preemptions_from_the_sample_rows_and_older_rows_have_none() -> None:
    rec = {"groups": [{"samples": [["w0", 10.0, 12.0, 8, 40, [10.5, 11.0]], ["w1", 10.0, 11.0, 8, 40, [10.2]],
                                   ["w0", 10.0, 11.0, 8, 40]]}]}  # fmt: skip
    assert preemptions([rec], "w0", 10.0) == [0.5, 1.0]
    assert preemptions([rec], "w1", 10.0) == pytest.approx([0.2])
