"""The ``transformers`` engine: a real (tiny) model on CPU, batched, with per-request seeds.

Requests that arrive while a batch runs wait for the next batch.  Behaviour logprobs are the
log-softmax of the logits each token was sampled from, i.e. the policy of this version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutpipe.broker.events import PolicyVersion, RolloutRequest
from rolloutpipe.config import Config
from rolloutpipe.policy import decode_batch, ensure_model, load_model, sampler, text_codec
from rolloutpipe.workers.engines.base import Generation

log = logging.getLogger("rolloutpipe.rollout")


@dataclass
class _Pending:
    req: RolloutRequest
    fut: asyncio.Future[Generation]


class TransformersEngine:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.codec = text_codec(cfg.model)
        self.model: Any = None
        self.queue: list[_Pending] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # weights never change under a running batch

    @property
    def capacity(self) -> int:
        return self.cfg.rollout.max_concurrency

    async def start(self) -> None:
        if self.model is None:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
            path = ensure_model(self.cfg.model)
            self.model = await asyncio.to_thread(load_model, path, 1)
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def generate(self, req: RolloutRequest) -> Generation:
        if self._task is None:
            await self.start()
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.queue.append(_Pending(req, fut))
        self._wake.set()
        return await fut

    async def _loop(self) -> None:
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(0)  # let requests read in the same tick join the batch
            batch, self.queue = self.queue[: self.capacity], self.queue[self.capacity :]
            async with self._lock:
                try:
                    gens = await asyncio.to_thread(self._generate_batch, [p.req for p in batch])
                except Exception as e:  # surface to every waiter; the worker dead-letters
                    for p in batch:
                        if not p.fut.done():
                            p.fut.set_exception(e)
                    continue
            for p, g in zip(batch, gens, strict=True):
                if not p.fut.done():
                    p.fut.set_result(g)

    def _generate_batch(self, reqs: list[RolloutRequest]) -> list[Generation]:
        prompts = [self.codec.encode_prompt(r.prompt, r.messages) for r in reqs]
        pick = sampler([r.temperature for r in reqs], [r.seed for r in reqs])
        resp, lps = decode_batch(
            self.model, prompts, [r.max_new_tokens for r in reqs], self.codec.eos_token_id, pick
        )
        out = []
        for i in range(len(reqs)):
            ids_i = np.asarray(resp[i], np.int32)
            reason = "stop" if len(ids_i) and ids_i[-1] == self.codec.eos_token_id else "length"
            out.append(
                Generation(
                    prompts[i], ids_i, np.asarray(lps[i], np.float32), self.codec.decode(ids_i), reason
                )
            )
        return out

    async def load_weights(self, pv: PolicyVersion) -> None:
        from rolloutpipe.trainer.weights import load_verified_state

        state = await asyncio.to_thread(load_verified_state, pv)  # raises on a bad checksum
        async with self._lock:
            self.model.load_state_dict(state, strict=True)
        log.info("loaded policy version %d from %s", pv.policy_version, pv.path)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
