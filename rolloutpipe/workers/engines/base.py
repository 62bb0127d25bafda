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
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    @property
    def capacity(self) -> int:
        """Sequences the engine runs at once (continuous-batching slots)."""
        ...

    async def start(self) -> None: ...

    async def generate(self, req: RolloutRequest) -> Generation: ...

    async def load_weights(self, pv: PolicyVersion) -> None:
        """Load published weights after verifying their sha256; raise on mismatch."""
        ...

    async def close(self) -> None: ...
