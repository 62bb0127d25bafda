"""The ``transformers`` engine: a real (tiny) model on CPU, batched, with per-request seeds.

Requests that arrive while a batch runs wait for the next batch.  Behaviour logprobs are the
log-softmax of the logits each token was sampled from, i.e. the policy of this version.

Long-tail migration: ``preempt`` stops a request of the running batch at its next token boundary
(its ``generate`` returns the response so far, ``finish_reason="preempted"``; a queued request is
not running: False).  A continuation (``prefix_ids``) decodes on from prompt + prefix.  The draw at
each response position depends only on (seed, position, logits) (``policy.sampler``), so on the same
weights a continuation, on any worker, yields what the unmigrated request would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutpipe.broker.events import PolicyVersion, RolloutRequest
from rolloutpipe.config import Config
from rolloutpipe.engines.base import Generation
from rolloutpipe.model.lm import decode_batch, ensure_model, load_model, sampler, tokenizer_for

log = logging.getLogger("rolloutpipe.rollout")


@dataclass
class _Pending:
    req: RolloutRequest
    fut: asyncio.Future[Generation]


@dataclass
class _Slot:
    """A request of the batch being decoded; shared with the decoding thread under ``_mu``."""

    request_id: str
    tokens: int  # response tokens so far, prefix included
    done: bool  # finished (or stopped): preempt no longer applies
    stop: bool = False  # preempt asked for it
    preempted: bool = False  # and the decoding thread stopped it


class TransformersEngine:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.codec = tokenizer_for(cfg.model)
        self.model: Any = None
        self.queue: list[_Pending] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # weights never change under a running batch
        self._mu = threading.Lock()  # _slots: read and written by the decoding thread and preempt
        self._slots: list[_Slot] = []

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

    def preempt(self, request_id: str) -> bool:
        """Stop ``request_id`` if it is in the batch being decoded and not finished (thread-safe).

        The token being decoded when this is called is dropped, so True always means ``generate``
        returns ``finish_reason="preempted"`` with the response so far (or raises, if the batch
        fails).  A queued request is left queued (False), as is an unknown or finished one."""
        hit = False
        with self._mu:
            for s in self._slots:
                if s.request_id == request_id and not s.done:
                    s.stop = hit = True
        return hit

    def decoded(self, request_id: str) -> int | None:
        """Response tokens so far (prefix included) of a request in the running batch, else None."""
        with self._mu:
            return next((s.tokens for s in self._slots if s.request_id == request_id), None)

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

    def _should_stop(self, slots: list[_Slot]) -> Callable[[int, bool], bool]:
        def should_stop(i: int, last: bool) -> bool:
            with self._mu:
                s = slots[i]
                if s.stop:
                    s.preempted = s.done = True
                    return True
                s.tokens += 1
                s.done = last
                return False

        return should_stop

    def _generate_batch(self, reqs: list[RolloutRequest]) -> list[Generation]:
        eos = self.codec.eos_token_id
        prompts = [self.codec.encode_prompt(r.prompt, r.messages) for r in reqs]
        prefixes = [np.asarray(r.prefix_ids, np.int32) for r in reqs]
        # a prefix that already ends in EOS is a finished response: nothing to decode
        budget = [
            0 if len(p) and p[-1] == eos else r.max_new_tokens - len(p)
            for r, p in zip(reqs, prefixes, strict=True)
        ]
        slots = [_Slot(r.request_id, len(p), b <= 0) for r, p, b in zip(reqs, prefixes, budget, strict=True)]
        with self._mu:
            self._slots = slots
        try:
            pick = sampler([r.temperature for r in reqs], [r.seed for r in reqs], [len(p) for p in prefixes])
            resp, lps = decode_batch(
                self.model,
                [np.concatenate([q, p]) for q, p in zip(prompts, prefixes, strict=True)],
                budget,
                eos,
                pick,
                self._should_stop(slots),
                [set(r.stop_token_ids) for r in reqs],
            )
        finally:
            with self._mu:
                self._slots = []
        out = []
        for i, r in enumerate(reqs):
            ids_i = np.concatenate([prefixes[i], np.asarray(resp[i], np.int32)])
            lps_i = np.concatenate(
                [np.asarray(r.prefix_logprobs, np.float32), np.asarray(lps[i], np.float32)]
            )
            if slots[i].preempted:
                reason = "preempted"
            else:
                ends = {eos, *r.stop_token_ids}
                reason = "stop" if len(ids_i) and int(ids_i[-1]) in ends else "length"
            out.append(Generation(prompts[i], ids_i, lps_i, self.codec.decode(ids_i), reason))
        return out

    async def load_weights(self, pv: PolicyVersion) -> None:
        from rolloutpipe.model.weights import load_verified_state

        state = await asyncio.to_thread(load_verified_state, pv)  # raises on a bad checksum
        async with self._lock:
            self.model.load_state_dict(state, strict=True)
        log.info("loaded policy version %d from %s", pv.policy_version, pv.path)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
