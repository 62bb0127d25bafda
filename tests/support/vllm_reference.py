"""What the vLLM tests share: the engine's test config, the prompts, and the reference they check.

``Reference`` is a transformers forward of given weights (greedy tokens, per-token logprobs); vLLM's
outputs must match it within ``ATOL``.  Nothing here imports vLLM.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutpipe.broker.events import PolicyVersion, RolloutRequest
from rolloutpipe.model.lm import EOS, load_model, response_logprobs
from rolloutpipe.model.weights import WEIGHTS_FILE

# fp32 on both sides; vLLM's CPU kernels and torch's differ by ~1e-6 in the logprobs.
ATOL = 1e-4
ENGINE = (
    "rollout.engine=vllm",
    "rollout.max_concurrency=8",
    "rollout.max_new_tokens=8",
    "rollout.vllm.dtype=float32",
    "rollout.vllm.enforce_eager=true",  # skips torch.compile: a much faster start on CPU
    "rollout.vllm.kv_cache_space_gib=1",
    "rollout.heartbeat_s=0.3",
    "controller.mode=cgp-fgd",
)
PROMPTS = ["1+2=", "7+8=", "3*4=", "9-5="]


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Weights far enough from ``state`` that greedy outputs and logprobs change."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def corrupt(pv: PolicyVersion) -> None:
    """Flip one byte of the tensor data: still loadable, silently wrong, caught only by sha256."""
    f = Path(pv.path) / WEIGHTS_FILE
    b = bytearray(f.read_bytes())
    b[-10] ^= 0xFF
    f.write_bytes(bytes(b))


def request(run: str, version: int, name: str, prompt: str, temperature: float, seed: int) -> RolloutRequest:
    return RolloutRequest(
        run=run,
        step=version,
        policy_version=version,
        request_id=f"{name}:0",
        group_id=name,
        prompt_index=0,
        sample_index=0,
        prompt=prompt,
        answer="0",
        seed=seed,
        max_new_tokens=8,
        temperature=temperature,
        released_at=time.time(),
    )


class Reference:
    """A transformers forward of given weights: greedy decoding and per-token logprobs."""

    def __init__(self, path: Path) -> None:
        self.model: Any = load_model(path)

    def load(self, state: dict[str, torch.Tensor]) -> Reference:
        self.model.load_state_dict(state, strict=True)
        return self

    @torch.no_grad()
    def greedy(self, prompt_ids: np.ndarray, n: int = 8) -> np.ndarray:
        ids, out = [int(i) for i in prompt_ids], []
        for _ in range(n):
            tok = int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == EOS:
                break
        return np.asarray(out, np.int32)

    @torch.no_grad()
    def logprobs(self, prompt_ids: np.ndarray, response: np.ndarray, temperature: float) -> np.ndarray:
        lp, _ = response_logprobs(self.model, [prompt_ids], [response], temperature)
        out: np.ndarray = lp[0, : len(response)].numpy()
        return out

    def check(self, prompt_ids: np.ndarray, response: np.ndarray, logprobs: np.ndarray, t: float) -> None:
        """Greedy (t == 0): same tokens, logprobs of log_softmax(logits); else those of logits / t."""
        assert logprobs.dtype == np.float32 and logprobs.shape == response.shape
        if t == 0:
            np.testing.assert_array_equal(response, self.greedy(prompt_ids))
        np.testing.assert_allclose(logprobs, self.logprobs(prompt_ids, response, t or 1.0), atol=ATOL)
