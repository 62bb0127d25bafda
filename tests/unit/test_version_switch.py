"""A weight switch never publishes old work under the new version (``rollout.on_new_version``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from rolloutpipe.broker.events import DeadLetter, PolicyVersion, RolloutRequest, Sample
from rolloutpipe.broker.streams import Broker
from rolloutpipe.config import Config
from rolloutpipe.engines.base import Generation
from rolloutpipe.roles.rollout import RolloutWorker
from tests.support.config import make_config


class SlowEngine:
    """Version-0 requests take ``slow_s``; later ones return at once.  Records loads and aborts."""

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s
        self.loaded: list[int] = []
        self.cancelled = 0

    @property
    def capacity(self) -> int:
        return 8

    async def start(self) -> None:
        pass

    async def generate(self, req: RolloutRequest) -> Generation:
        try:
            if req.policy_version == 0:
                await asyncio.sleep(self.slow_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = np.asarray([3], np.int32)
        return Generation(np.asarray([1, 3], np.int32), ids, np.zeros(1, np.float32), "0", "length")

    async def load_weights(self, pv: PolicyVersion) -> None:
        self.loaded.append(pv.policy_version)

    async def close(self) -> None:
        pass


def _req(run: str, step: int, i: int) -> RolloutRequest:
    return RolloutRequest(
        run=run,
        step=step,
        policy_version=step,
        request_id=f"s{step}-r{i}",
        group_id=f"s{step}-g0",
        prompt_index=0,
        sample_index=i,
        prompt="1+1=",
        answer="2",
        seed=i,
        max_new_tokens=1,
        temperature=1.0,
        released_at=time.time(),
    )


async def _switch(cfg: Config, broker: Broker, engine: SlowEngine) -> tuple[list[Sample], list[DeadLetter]]:
    k = broker.keys
    pv = PolicyVersion(run=broker.run, step=0, policy_version=0, path="", sha256={}, published_at=0.0)
    await broker.r.set(k.version, broker.encode(pv))
    await broker.ensure_group(k.requests, "rollout")
    worker = RolloutWorker(cfg, broker, engine, "w0")  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    for i in range(2):
        await broker.publish(k.requests, _req(broker.run, 0, i))
    while len(worker.inflight) < 2:
        await asyncio.sleep(0.01)
    # version 1 is published while both version-0 requests are still generating
    pv1 = pv.model_copy(update={"step": 1, "policy_version": 1})
    await broker.r.set(k.version, broker.encode(pv1))
    await broker.publish(k.requests, _req(broker.run, 1, 0))
    deadline = time.monotonic() + 10
    while await broker.r.xlen(k.samples) + await broker.r.xlen(k.dlq) < 3:
        assert time.monotonic() < deadline, "the switch did not complete"
        await asyncio.sleep(0.01)
    stop.set()
    await task
    samples = [broker.codec.decode_as(f[b"d"], Sample) for _, f in await broker.r.xrange(k.samples)]
    dead = [broker.codec.decode_as(f[b"d"], DeadLetter) for _, f in await broker.r.xrange(k.dlq)]
    pending = await broker.r.xpending(k.requests, "rollout")
    assert pending["pending"] == 0, "every request was either published or dead-lettered"
    return samples, dead


@pytest.mark.parametrize("policy", ["finish", "abort"])
async def test_old_work_never_goes_out_under_the_new_version(
    tmp_path: Path, run_name: str, broker: Broker, policy: str
) -> None:
    cfg = make_config(tmp_path, run_name, "rollout.engine=emulated", f"rollout.on_new_version={policy}")
    engine = SlowEngine(slow_s=0.5)
    samples, dead = await _switch(cfg, broker, engine)
    assert engine.loaded == [0, 1]
    by_step = {(s.step, s.sample_index): s for s in samples}
    assert all(s.policy_version == s.step for s in samples), "each sample carries its generating version"
    assert (1, 0) in by_step
    if policy == "finish":
        assert {(0, 0), (0, 1)} <= by_step.keys() and not dead and engine.cancelled == 0
    else:
        assert engine.cancelled == 2
        assert not any(s.step == 0 for s in samples)
        assert len(dead) == 2 and all("aborted when policy version 1" in d.reason for d in dead)
        assert await broker.stat("aborted_requests") == 2
