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
scheduler does; ``fcfs`` by arrival.

The KV cache (``kv_cache_tokens`` > 0; 0 models none): a sequence holds ceil((prompt + decoded) /
``kv_block_tokens``) blocks.  A queued request is admitted only when the blocks for its context
and its next token are free.  When the next decode step needs a block that is not free, the engine
preempts running sequences (``preemption``: vLLM's or SGLang's choice of victim) until it fits;
a victim keeps its tokens, goes back to the queue, and pays the prefill of prompt + tokens again
when it is readmitted (recompute).  No request is admitted in a step that preempted (as vLLM's V1
scheduler), which keeps a victim from being readmitted at once.  ``decode_per_kv_token_s`` charges
each step for the cached tokens it reads, so a batch slows down as its sequences grow; within an
interval the context grows by one token a step and the interval's time is the exact sum.

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
    kv_preempted_at: list[float] = field(default_factory=list)  # time.time() of each KV preemption


@dataclass(frozen=True)
class KvPreemption:
    """A running sequence preempted because the KV cache was full (for timelines and tests)."""

    t: float  # time.time()
    request_id: str
    tokens: int  # decoded tokens it keeps (and pays the prefill of again)


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
        self.kv_preemptions: list[KvPreemption] = []

    @property
    def capacity(self) -> int:
        return self.cfg.max_num_seqs

    @property
    def kv_tokens(self) -> int:
        """The KV cache in tokens (0: unlimited), reported in the heartbeat."""
        return self.cfg.kv_cache_tokens

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

    # -- the KV cache --------------------------------------------------------------------------

    def _context(self, s: _Seq) -> int:
        """Tokens ``s`` holds in the cache: its prompt and its whole decoded tokens."""
        return self.cfg.prompt_tokens + int(s.done_tokens + 1e-6)

    def _blocks(self, s: _Seq, ahead: int = 1) -> int:
        """Blocks ``s`` needs to decode ``ahead`` more tokens."""
        return -(-(self._context(s) + ahead) // self.cfg.kv_block_tokens)

    def _kv_blocks(self) -> int:
        return self.cfg.kv_cache_tokens // self.cfg.kv_block_tokens

    def kv_steps(self, seqs: list[_Seq]) -> int:
        """Decode steps ``seqs`` can take before a step needs a block that is not free (at least 1
        once :meth:`_make_room` has run); unbounded without a KV limit."""
        if not self.cfg.kv_cache_tokens or not seqs:
            return 1 << 62
        B, cap = self.cfg.kv_block_tokens, self._kv_blocks()
        ctx = np.fromiter((self._context(s) for s in seqs), np.int64, len(seqs))
        n, room = len(seqs), cap * B - int(ctx.sum())
        # blocks(k) = sum ceil((ctx + k) / B) lies in [(sum ctx + n k) / B, that + n): the largest
        # k with blocks(k) <= cap lies in [room / n - B, room / n]; bisect that window
        lo, hi = max(0, room // n - B), max(0, room // n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int((-(-(ctx + mid) // B)).sum()) <= cap:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _victim(self) -> _Seq:
        if self.cfg.preemption == "sglang":  # retract_decode: fewest decoded, then longest prompt
            return min(self.running, key=lambda s: (int(s.done_tokens + 1e-6), -self.cfg.prompt_tokens))
        if self.cfg.scheduling_policy == "priority":  # vLLM V1: max (priority, arrival)
            return max(self.running, key=lambda s: (s.req.priority, s.arrival))
        return self.running[-1]  # vLLM V1 fcfs: the latest scheduled

    def _make_room(self) -> bool:
        """Preempt running sequences until the next decode step fits; True if any was."""
        if not self.cfg.kv_cache_tokens:
            return False
        cap, preempted = self._kv_blocks(), False
        while self.running and sum(self._blocks(s) for s in self.running) > cap:
            s = self._victim()
            self.running.remove(s)
            whole = int(s.done_tokens + 1e-6)
            s.done_tokens = float(whole)  # a partial token is lost with the cache
            s.prefill_left = self.cfg.prefill_per_token_s * (self.cfg.prompt_tokens + whole)
            s.kv_preempted_at.append(time.time())
            self.kv_preemptions.append(KvPreemption(s.kv_preempted_at[-1], s.req.request_id, whole))
            if s.preempt:  # migration asked for it meanwhile: hand it back instead
                self._hand_back(s)
            elif self.cfg.scheduling_policy == "priority":
                self.waiting.append(s)  # admission sorts by (priority, arrival)
            else:
                self.waiting.insert(0, s)  # vLLM V1 fcfs: prepended
            preempted = True
        return preempted

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            return
        if self.cfg.scheduling_policy == "priority":
            self.waiting.sort(key=lambda s: (s.req.priority, s.arrival))
        limited = bool(self.cfg.kv_cache_tokens)
        free = self._kv_blocks() - sum(self._blocks(s) for s in self.running) if limited else 0
        while len(self.running) < self.cfg.max_num_seqs and self.waiting:
            if limited:
                need = self._blocks(self.waiting[0])
                if need > free:  # the head waits (no skipping ahead: vLLM admits in order)
                    return
                free -= need
            self.running.append(self.waiting.pop(0))

    def _step_time(self, batch: int, cached: int = 0) -> float:
        """One decode step of ``batch`` sequences that hold ``cached`` tokens in the cache."""
        c = self.cfg
        return c.decode_base_s + c.decode_per_seq_s * batch + c.decode_per_kv_token_s * cached

    def _decode_time(self, steps: float) -> float:
        """Emulated seconds for the running batch to decode ``steps`` tokens each: every step reads
        one more cached token a sequence than the last."""
        n, k = len(self.running), self.cfg.decode_per_kv_token_s
        cached = sum(self._context(s) for s in self.running) if k else 0  # unread without a KV cost
        return steps * self._step_time(n, cached) + k * n * steps * (steps - 1) / 2

    def _decoded_in(self, seconds: float) -> float:
        """Inverse of :meth:`_decode_time`: the steps decoded in ``seconds``."""
        n, k = len(self.running), self.cfg.decode_per_kv_token_s
        first = self._step_time(n, sum(self._context(s) for s in self.running) if k else 0)
        if k == 0 or seconds <= 0:
            return max(0.0, seconds) / first
        a, b = k * n / 2, first - k * n / 2  # a s^2 + b s = seconds
        return (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)

    async def _loop(self) -> None:
        scale = self.cfg.time_scale
        while True:
            if not self._make_room():  # no admission in a step that preempted (vLLM V1)
                self._admit()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Prefill of newly admitted sequences stalls the whole batch (as in a real engine).
            for s in self.running:
                self._prefill_due += s.prefill_left
                s.prefill_left = 0.0
            prefill = self._prefill_due
            tokens_to_next = min(s.length - s.done_tokens for s in self.running)
            kv_room = self.kv_steps(self.running)
            steps = min(max(tokens_to_next, 0.0), float(kv_room))
            emu = prefill + self._decode_time(steps)
            self._wake.clear()
            t0 = time.monotonic()
            # an arrival interrupts the interval so it can join the batch (continuous batching)
            await wait_event(self._wake, emu * scale)
            elapsed_emu = (time.monotonic() - t0) / scale
            self.busy_s += time.monotonic() - t0
            self._prefill_due = max(0.0, prefill - elapsed_emu)  # an interrupted prefill is still owed
            # the wall clock may overshoot the interval: the time counts, up to where the cache fills
            advanced = min(self._decoded_in(elapsed_emu - prefill), float(kv_room))
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
            s.fut.set_result(self._generation(s.req, s.length, s.correct, kv=s.kv_preempted_at))

    def _hand_back(self, s: _Seq) -> None:
        """A preempted sequence: its whole tokens so far (the prefix included), resumable."""
        done = max(int(s.done_tokens + 1e-6), len(s.req.prefix_ids))
        if not s.fut.done():
            s.fut.set_result(self._generation(s.req, s.length, s.correct, upto=done, kv=s.kv_preempted_at))

    def _generation(
        self, req: RolloutRequest, length: int, correct: bool, upto: int = -1, kv: list[float] | None = None
    ) -> Generation:
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
        prompt = np.zeros(self.cfg.prompt_tokens, np.int32)
        return Generation(prompt, ids, logprobs, text, reason, tuple(kv or ()))

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
