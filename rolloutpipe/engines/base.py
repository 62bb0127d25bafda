"""The engine interface: generate one request (engines batch internally), load verified weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rolloutpipe.broker.events import PolicyVersion, RolloutRequest


@dataclass
class Generation:
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray  # behaviour logprobs of the sampled tokens, float32
    text: str
    finish_reason: str  # "stop" | "length" | "preempted" (see Engine.preempt)
    # wall times (time.time()) at which the engine preempted it for KV-cache memory and re-queued
    # it (recompute); an engine that does not report them leaves it empty
    kv_preempted_at: tuple[float, ...] = ()


class Engine(Protocol):
    @property
    def capacity(self) -> int:
        """Sequences the engine runs at once (continuous-batching slots)."""
        ...

    async def start(self) -> None: ...

    async def generate(self, req: RolloutRequest) -> Generation:
        """The whole response to ``req``.  A continuation (``req.prefix_ids`` not empty) resumes after
        prompt + prefix; its Generation holds the prefix and what followed, with the prefix's
        logprobs as given, and at most ``req.max_new_tokens`` tokens in all."""
        ...

    async def load_weights(self, pv: PolicyVersion) -> None:
        """Load published weights after verifying their sha256; raise on mismatch."""
        ...

    async def close(self) -> None: ...


class Preemptible(Protocol):
    """An engine that can hand a running request back mid-decode, for long-tail migration."""

    def preempt(self, request_id: str) -> bool:
        """Stop ``request_id`` at its next token boundary: its ``generate`` then returns the response
        so far (prefix included) with ``finish_reason="preempted"``, which a continuation resumes
        token for token (greedy; sampled: on the same seed, as far as the engine allows).  False
        when the request is not running here (queued, unknown or finished): nothing changes."""
        ...


class Queueing(Protocol):
    """An engine with a waiting queue of its own that it can hand requests back from (the emulated
    engine; ``RolloutWorker.leave`` hands those back first: nothing of theirs is lost)."""

    def queued(self, request_id: str) -> bool:
        """``request_id`` waits in the engine's queue, not started: ``preempt`` hands it back with
        nothing decoded."""
        ...
