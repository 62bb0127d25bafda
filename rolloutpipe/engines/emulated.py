"""An emulated continuous-batching engine, for benchmarks with an honest wall clock.

Model: at most ``max_num_seqs`` sequences run at once; every decode step advances each running
sequence by one token and takes ``decode_base_s + decode_per_seq_s * running`` seconds; a request
joining the batch adds a prefill cost proportional to its prompt length.  Response lengths are
drawn from a long-tailed (log-normal) distribution truncated at ``max_response_tokens``.
Emulated seconds are multiplied by ``time_scale`` and actually slept through.

Between events (an arrival or a completion) the batch is constant, so the engine jumps straight
to the next event instead of sleeping once per token.  Prefill stalls the batch and is paid in
full: an arrival that interrupts it leaves the rest to be paid before decoding resumes.

Requests beyond ``max_num_seqs`` wait in the engine's queue.  ``scheduling_policy: priority``
admits them by ``RolloutRequest.priority`` (lower first, then arrival), as vLLM's priority
scheduler does; ``fcfs`` by arrival.  No KV-cache limit is modelled, so nothing is preempted
for memory.

Long-tail migration: :meth:`EmulatedEngine.preempt` stops a running sequence at the end of
its last whole token and returns the response so far (``finish_reason="preempted"``).  A
continuation (``RolloutRequest.prefix_ids``) is the same trajectory (its length and tokens are
functions of the request id) resumed after the prefix, and it pays what vLLM pays to resume
without a KV cache to move: the prefill of prompt + prefix, at ``prefill_per_token_s``.  A
worker of a shared pool that loads another run's weights waits ``switch_s`` (its source is in
``EmulatedEngineConfig``).

``time_scale: 0`` is an instant engine: each request returns its response at once, with the same
lengths, tokens and rewards, so a benchmark measures only the streaming path around the engine
(``rolloutpipe bench --suite broker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from dataclasses import dataclass, field

import numpy as np

from rolloutpipe.broker.events import PolicyVersion, RolloutRequest
from rolloutpipe.config import EmulatedEngineConfig
from rolloutpipe.engines.base import Generation
from rolloutpipe.runtime import wait_event


def _rng(*parts: object) -> np.random.Generator:
    h = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


@dataclass
class _Seq:
    req: RolloutRequest
    length: int
    correct: bool
    fut: asyncio.Future[Generation]
    done_tokens: float = 0.0
    prefill_left: float = 0.0  # emulated seconds of prefill still to pay
    started: float = field(default_factory=time.monotonic)
    arrival: int = 0
    preempt: bool = False


class EmulatedEngine:
    def __init__(self, cfg: EmulatedEngineConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = seed
        self.running: list[_Seq] = []
        self.waiting: list[_Seq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.busy_s = 0.0  # wall seconds with at least one running sequence
        self._arrivals = 0
        self._prefill_due = 0.0  # emulated seconds of prefill the batch still has to stall for
        self.run = ""  # whose weights it holds (a worker of a shared pool switches: ``switch_s``)
        self.switches = 0
        self.switch_wall_s = 0.0

    @property
    def capacity(self) -> int:
        return self.cfg.max_num_seqs

    def response_length(self, req: RolloutRequest) -> int:
        c = self.cfg
        z_sample = _rng(self.seed, req.request_id, "len").standard_normal()
        z_prompt = _rng(self.seed, req.prompt_index, req.prompt, "len").standard_normal()
        share = min(max(c.length_prompt_share, 0.0), 1.0)
        z = math.sqrt(share) * z_prompt + math.sqrt(1.0 - share) * z_sample  # still N(0, 1)
        n = round(math.exp(math.log(c.length_median) + c.length_sigma * z))
        return max(1, min(n, c.max_response_tokens))

    def pass_rate(self, req: RolloutRequest) -> float:
        r = _rng(self.seed, req.prompt_index, req.prompt, "difficulty")
        return float(r.beta(self.cfg.pass_rate_alpha, self.cfg.pass_rate_beta))

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def generate(self, req: RolloutRequest) -> Generation:
        length = self.response_length(req)
        correct = bool(_rng(self.seed, req.request_id, "reward").random() < self.pass_rate(req))
        if self.cfg.time_scale == 0:  # an instant engine: no batching model, nothing to wait for
            return self._generation(req, length, correct)
        if self._task is None:
            await self.start()
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        resumed = len(req.prefix_ids)
        seq = _Seq(
            req,
            length,
            correct,
            fut,
            done_tokens=float(min(resumed, length)),
            prefill_left=self.cfg.prefill_per_token_s * (self.cfg.prompt_tokens + resumed),
            arrival=self._arrivals,
        )
        self._arrivals += 1
        self.waiting.append(seq)
        self._wake.set()
        return await fut

    def preempt(self, request_id: str) -> bool:
        """Stop a request at its last whole token (``Preemptible``); a queued one comes back as it
        came.  False if it is not here."""
        for s in self.running:
            if s.req.request_id == request_id and not s.fut.done():
                s.preempt = True
                self._wake.set()  # the loop accounts the tokens decoded so far, then hands it back
                return True
        for s in self.waiting:  # queued, not started: handed back as it came (its prefix, if any)
            if s.req.request_id == request_id and not s.fut.done():
                self.waiting.remove(s)
                self._hand_back(s)
                return True
        return False

    def queued(self, request_id: str) -> bool:
        """``request_id`` waits for a slot (``Queueing``): ``preempt`` hands it back, nothing decoded."""
        return any(s.req.request_id == request_id and not s.fut.done() for s in self.waiting)

    def _step_time(self, batch: int) -> float:
        return self.cfg.decode_base_s + self.cfg.decode_per_seq_s * batch

    async def _loop(self) -> None:
        scale = self.cfg.time_scale
        while True:
            if len(self.running) < self.cfg.max_num_seqs and self.waiting:
                if self.cfg.scheduling_policy == "priority":
                    self.waiting.sort(key=lambda s: (s.req.priority, s.arrival))
                while len(self.running) < self.cfg.max_num_seqs and self.waiting:
                    self.running.append(self.waiting.pop(0))
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Prefill of newly admitted sequences stalls the whole batch (as in a real engine).
            for s in self.running:
                self._prefill_due += s.prefill_left
                s.prefill_left = 0.0
            prefill = self._prefill_due
            dt_tok = self._step_time(len(self.running))
            tokens_to_next = min(s.length - s.done_tokens for s in self.running)
            emu = prefill + dt_tok * max(tokens_to_next, 0.0)
            self._wake.clear()
            t0 = time.monotonic()
            # an arrival interrupts the interval so it can join the batch (continuous batching)
            await wait_event(self._wake, emu * scale)
            elapsed_emu = (time.monotonic() - t0) / scale
            self.busy_s += time.monotonic() - t0
            self._prefill_due = max(0.0, prefill - elapsed_emu)  # an interrupted prefill is still owed
            advanced = max(0.0, elapsed_emu - prefill) / dt_tok
            still: list[_Seq] = []
            for s in self.running:
                s.done_tokens += advanced
                if s.done_tokens >= s.length - 1e-6:
                    self._finish(s)
                elif s.preempt:
                    self._hand_back(s)
                else:
                    still.append(s)
            self.running = still

    def _finish(self, s: _Seq) -> None:
        if not s.fut.done():
            s.fut.set_result(self._generation(s.req, s.length, s.correct))

    def _hand_back(self, s: _Seq) -> None:
        """A preempted sequence: its whole tokens so far (the prefix included), resumable."""
        done = max(int(s.done_tokens + 1e-6), len(s.req.prefix_ids))
        if not s.fut.done():
            s.fut.set_result(self._generation(s.req, s.length, s.correct, upto=done))

    def _generation(self, req: RolloutRequest, length: int, correct: bool, upto: int = -1) -> Generation:
        """The trajectory of ``req`` (a function of its id), or its first ``upto`` tokens, preempted."""
        r = _rng(self.seed, req.request_id, "tokens")
        ids = r.integers(3, 18, size=length, dtype=np.int32)
        logprobs = np.log(r.uniform(0.2, 1.0, size=length)).astype(np.float32)
        n = len(req.prefix_ids)
        if n:  # a continuation keeps the tokens and logprobs it was handed
            ids[:n], logprobs[:n] = req.prefix_ids[:length], req.prefix_logprobs[:length]
        text = req.answer if correct else "x"
        reason = "length" if length >= self.cfg.max_response_tokens else "stop"
        if 0 <= upto < length:
            ids, logprobs, text, reason = ids[:upto], logprobs[:upto], "", "preempted"
        return Generation(np.zeros(self.cfg.prompt_tokens, np.int32), ids, logprobs, text, reason)

    async def load_weights(self, pv: PolicyVersion) -> None:
        if pv.sha256:  # the emulated trainer publishes no files; real files are still verified
            from rolloutpipe.model.weights import verify_weights

            await asyncio.to_thread(verify_weights, pv)
        if self.run and pv.run != self.run and self.cfg.time_scale > 0:  # another run's weights
            t0 = time.monotonic()
            await asyncio.sleep(self.cfg.switch_s * self.cfg.time_scale)
            self.switch_wall_s += time.monotonic() - t0
            self.switches += 1
        self.run = pv.run

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for s in self.running + self.waiting:
            if not s.fut.done():
                s.fut.cancel()
