"""Long-tail migration on the ``transformers`` engine (the tiny model, CPU).

A request preempted mid-decode on one engine and resumed as a continuation (``prefix_ids``) on
another must yield what it would have yielded unmigrated: token for token, logprobs within 1e-5,
greedy and sampled (the sampler's draw at a response position depends only on seed, position and
logits).  Preemption is made deterministic with a forward hook that calls ``preempt`` from the
decoding thread during a chosen decode step (that step's token is dropped).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rolloutpipe.broker.events import RolloutRequest
from rolloutpipe.config import Config
from rolloutpipe.engines.base import Generation, Preemptible
from rolloutpipe.engines.hf import TransformersEngine
from tests.support.config import make_config

MAX_NEW = 40
GREEDY_PROMPTS = ("3+4=", "9*9=", "12-7=", "1+2=")
SEEDS = tuple(range(8))
MIN_LEN = 8  # trajectories shorter than this leave too little to preempt in the middle of


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory, model_cache: str) -> Config:
    return make_config(tmp_path_factory.mktemp("mig"), "migration", f"model.cache_dir={model_cache}")


@pytest.fixture()
async def engines(cfg: Config) -> AsyncIterator[tuple[TransformersEngine, TransformersEngine]]:
    """Two workers' engines on the same weights."""
    a, b = TransformersEngine(cfg), TransformersEngine(cfg)
    await a.start()
    await b.start()
    yield a, b
    await a.close()
    await b.close()


def _req(rid: str, prompt: str, temperature: float, seed: int = 0) -> RolloutRequest:
    return RolloutRequest(run="mig", step=0, policy_version=0, request_id=rid, group_id="g0", prompt_index=0,
                          sample_index=0, prompt=prompt, answer="0", seed=seed, max_new_tokens=MAX_NEW,
                          temperature=temperature, released_at=0.0)  # fmt: skip


def _resume(req: RolloutRequest, ids: np.ndarray, lps: np.ndarray) -> RolloutRequest:
    """``req`` as a continuation after response tokens ``ids`` (validated: the prefix must fit)."""
    return RolloutRequest(
        **{**dict(req), "prefix_ids": ids, "prefix_logprobs": lps, "segment": 1, "origin": "1-0"}
    )


def _on_step(engine: TransformersEngine, fn: Callable[[int, int], None]) -> Any:
    """Call ``fn(step, batch_size)`` on each decode step's forward pass (on the decoding thread)."""
    n = [0]

    def hook(_mod: Any, _args: Any, kwargs: dict[str, Any], _out: Any) -> None:
        n[0] += 1
        fn(n[0], int(kwargs["input_ids"].shape[0]))

    return engine.model.register_forward_hook(hook, with_kwargs=True)


async def _preempted_at(engine: TransformersEngine, req: RolloutRequest, step: int) -> Generation:
    """``req`` generated alone on ``engine``, preempted during decode step ``step``."""
    hits: list[bool] = []
    handle = _on_step(
        engine, lambda n, _b: hits.append(engine.preempt(req.request_id)) if n == step else None
    )
    try:
        g = await engine.generate(req)
    finally:
        handle.remove()
    assert hits == [True]
    return g


def assert_same(a: Generation, b: Generation) -> None:
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert a.logprobs.dtype == b.logprobs.dtype == np.float32
    assert (a.text, a.finish_reason) == (b.text, b.finish_reason)


async def _long(
    engine: TransformersEngine, reqs: list[RolloutRequest]
) -> list[tuple[RolloutRequest, Generation]]:
    out = [(r, await engine.generate(r)) for r in reqs]
    long = [(r, g) for r, g in out if len(g.response_ids) >= MIN_LEN]
    assert len(long) >= 2, [len(g.response_ids) for _, g in out]
    return long


async def _migrate_and_check(
    a: TransformersEngine, b: TransformersEngine, req: RolloutRequest, full: Generation
) -> None:
    n = len(full.response_ids)
    assert n <= MAX_NEW
    for step in (2, n // 2 + 1, n):  # keeps 1, n // 2 and n - 1 tokens
        part = await _preempted_at(a, req, step)
        assert part.finish_reason == "preempted"
        assert 0 < len(part.response_ids) == step - 1 < n
        np.testing.assert_array_equal(part.response_ids, full.response_ids[: step - 1])
        np.testing.assert_allclose(part.logprobs, full.logprobs[: step - 1], atol=1e-5, rtol=0)
        cont = _resume(req, part.response_ids, part.logprobs)
        assert_same(await b.generate(cont), full)  # resumed on another worker


async def test_greedy_migration_is_exact(engines: tuple[TransformersEngine, TransformersEngine]) -> None:
    a, b = engines
    preemptible: Preemptible = a  # the protocol the worker migrates through (not runtime-checkable)
    assert callable(preemptible.preempt)
    for req, full in await _long(a, [_req(f"g{i}", p, 0.0) for i, p in enumerate(GREEDY_PROMPTS)]):
        assert full.finish_reason in ("stop", "length")
        assert_same(await a.generate(req), full)  # greedy is deterministic
        await _migrate_and_check(a, b, req, full)
        for k in (1, 3, len(full.response_ids) // 2, len(full.response_ids) - 1):  # hand-made prefixes
            assert_same(await b.generate(_resume(req, full.response_ids[:k], full.logprobs[:k])), full)


async def test_sampled_migration_with_a_fixed_seed_is_exact(
    engines: tuple[TransformersEngine, TransformersEngine],
) -> None:
    a, b = engines
    long = await _long(a, [_req(f"s{s}", "1+2=", 1.0, seed=s) for s in SEEDS])
    for req, full in long:
        await _migrate_and_check(a, b, req, full)
        for k in (1, len(full.response_ids) // 3, len(full.response_ids) - 1):
            assert_same(await b.generate(_resume(req, full.response_ids[:k], full.logprobs[:k])), full)
    assert any(g.finish_reason == "length" for _, g in long)  # max_new_tokens bounds prefix + the rest
    # the seed matters: two seeds do not draw the same trajectories
    assert len({tuple(g.response_ids) for _, g in long}) == len(long)


async def test_a_continuation_in_a_batch_decodes_as_alone(
    engines: tuple[TransformersEngine, TransformersEngine],
) -> None:
    a, b = engines
    (req, full), *_ = await _long(a, [_req(f"s{s}", "1+2=", 1.0, seed=s) for s in SEEDS])
    k = len(full.response_ids) // 2
    cont = _resume(req, full.response_ids[:k], full.logprobs[:k])
    others = [_req("o1", "9*9=", 0.0), _req("o2", "3+4=", 1.0, seed=5), _req("o3", "12-7=", 1.0, seed=9)]
    alone = [await b.generate(r) for r in [cont, *others]]
    sizes: list[int] = []
    handle = _on_step(b, lambda _n, bs: sizes.append(bs))
    try:
        together = await asyncio.gather(*(b.generate(r) for r in [cont, *others]))
    finally:
        handle.remove()
    assert sizes[0] == 4  # one batch
    for x, y in zip(alone, together, strict=True):
        assert_same(x, y)
    assert_same(together[0], full)


async def test_preempt_stops_one_request_and_the_batch_goes_on(
    engines: tuple[TransformersEngine, TransformersEngine],
) -> None:
    a, b = engines
    reqs = [_req("p", "3+4=", 1.0, seed=3), _req("q", "9*9=", 1.0, seed=6), _req("r", "12-7=", 0.0)]
    alone = [await a.generate(r) for r in reqs]
    hits: list[bool] = []
    handle = _on_step(a, lambda n, _b: hits.append(a.preempt("p")) if n == 3 else None)
    try:
        together = await asyncio.gather(*(a.generate(r) for r in reqs))
    finally:
        handle.remove()
    assert hits == [True]
    assert together[0].finish_reason == "preempted" and len(together[0].response_ids) == 2
    for x, y in zip(alone[1:], together[1:], strict=True):
        assert_same(x, y)
    cont = _resume(reqs[0], together[0].response_ids, together[0].logprobs)
    assert_same(await b.generate(cont), alone[0])


async def test_preempt_from_the_event_loop_while_decoding(
    engines: tuple[TransformersEngine, TransformersEngine],
) -> None:
    """The worker's path: ``preempt`` called on the loop while the batch decodes in a thread."""
    a, b = engines
    req = _req("g", "3+4=", 0.0)
    full = await a.generate(req)
    assert len(full.response_ids) >= MIN_LEN
    handle = _on_step(a, lambda _n, _b: time.sleep(0.01))  # slow decoding down
    try:
        task = asyncio.create_task(a.generate(req))
        while (a.decoded("g") or 0) < 3:
            await asyncio.sleep(0.001)
        assert a.preempt("g")
        part = await task
    finally:
        handle.remove()
    assert part.finish_reason == "preempted" and 3 <= len(part.response_ids) < len(full.response_ids)
    assert a.decoded("g") is None and not a.preempt("g")  # finished: nothing to stop
    cont = _resume(req, part.response_ids, part.logprobs)
    assert_same(await b.generate(cont), full)


async def test_preempt_is_false_for_unknown_queued_and_finished_requests(
    tmp_path: Path, model_cache: str
) -> None:
    cfg = make_config(tmp_path, "mig1", f"model.cache_dir={model_cache}", "rollout.max_concurrency=1")
    e = TransformersEngine(cfg)
    await e.start()
    try:
        assert not e.preempt("nobody")
        first, queued = _req("first", "3+4=", 0.0), _req("queued", "9*9=", 0.0)
        alone = await e.generate(queued)
        hits: list[tuple[bool, bool]] = []
        handle = _on_step(
            e, lambda n, _b: hits.append((e.preempt("queued"), e.preempt("nobody"))) if n == 2 else None
        )
        try:
            g1, g2 = await asyncio.gather(e.generate(first), e.generate(queued))
        finally:
            handle.remove()
        assert hits == [(False, False)]  # "queued" waits for the next batch (capacity 1)
        assert g1.finish_reason != "preempted"
        assert_same(g2, alone)
        assert not e.preempt("first") and not e.preempt("queued")  # finished
    finally:
        await e.close()


async def test_a_prefix_that_ends_in_eos_is_finished(
    engines: tuple[TransformersEngine, TransformersEngine],
) -> None:
    a, _ = engines
    full = await a.generate(_req("e", "1+2=", 0.0))
    assert full.finish_reason == "stop" and 1 < len(full.response_ids) < MAX_NEW, full
    # hand a continuation everything but nothing to decode: it ends as it was
    req = _resume(_req("e", "1+2=", 0.0), full.response_ids, full.logprobs)
    assert_same(await a.generate(req), full)
