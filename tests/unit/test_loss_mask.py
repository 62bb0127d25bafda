"""An episode's tool tokens carry no gradient (``Sample.loss_mask``), against a reference written here.

The reference does not use the trainer's helpers: one forward of the tiny model per sequence, each
response token's logprob read off the logits, and the on-policy token-mean loss
``-sum(A_i x ratio) / model tokens`` over the model's tokens only (at ratio 1 PPO's clipped
objective has exactly this gradient).  The trainer's accumulated gradient, divided by its
normaliser, must equal it; the same reference over every token must not (so the test can fail).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rolloutpipe.broker.events import Group, Sample
from rolloutpipe.model.lm import model_token_mask, model_tokens, response_logprobs
from rolloutpipe.roles.trainer.backends import TorchBackend
from tests.support.config import make_config
from tests.support.events import make_group

PROMPT = np.array([1, 5, 6, 17], np.int32)
RESPONSES = [np.array([7, 8, 9, 10, 11, 12], np.int32), np.array([13, 14, 15, 4], np.int32)]
MASKS = [np.array([1, 1, 0, 0, 1, 1], np.uint8), np.zeros(0, np.uint8)]  # tokens 2, 3: a tool's
ADV = np.array([1.0, -1.0], np.float32)


def _group(model: torch.nn.Module) -> Group:
    with torch.no_grad():
        lp, _ = response_logprobs(model, [PROMPT] * 2, RESPONSES)
    g = make_group()
    samples = []
    for i, (r, m) in enumerate(zip(RESPONSES, MASKS, strict=True)):
        logprobs = lp[i, : len(r)].numpy().astype(np.float32)
        if len(m):
            logprobs[m == 0] = 0.0  # what a worker sends for a tool's tokens
        update = {"prompt_ids": PROMPT, "response_ids": r, "logprobs": logprobs, "loss_mask": m}
        samples.append(g.samples[i].model_copy(update=update))
    return g.model_copy(update={"samples": samples, "advantages": ADV})


def _reference_grads(model: torch.nn.Module, masked: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros(()), 0
    for r, m, a in zip(RESPONSES, MASKS, ADV, strict=True):
        seq = torch.from_numpy(np.concatenate([PROMPT, r]).astype(np.int64))[None]
        logits = model(input_ids=seq).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        for t, tok in enumerate(r):
            if masked and len(m) and m[t] == 0:
                continue
            lt = logp[len(PROMPT) - 1 + t, int(tok)]
            total = total - float(a) * torch.exp(lt - lt.detach())
            count += 1
    (total / count).backward()  # type: ignore[no-untyped-call]
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


@pytest.fixture
def backend(tmp_path: Path, model_cache: str) -> TorchBackend:
    cfg = make_config(tmp_path, "mask", f"model.cache_dir={model_cache}", "trainer.loss_agg=token-mean",
                      "trainer.kl_coef=0", "trainer.entropy_coef=0")  # fmt: skip
    return TorchBackend(cfg)


def test_tool_tokens_carry_no_gradient(backend: TorchBackend) -> None:
    model = backend.model
    group = _group(model)
    assert [model_tokens(s) for s in group.samples] == [4, 4]
    model.zero_grad(set_to_none=True)
    backend.accumulate(group)
    assert backend.norm == 8.0  # token-mean: the model's tokens only
    got = [
        p.grad.detach() / backend.norm if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]
    want = _reference_grads(model, masked=True)
    unmasked = _reference_grads(model, masked=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert any(not torch.allclose(w, u, rtol=1e-3, atol=1e-6) for w, u in zip(want, unmasked, strict=True))


def test_the_mask_pads_like_the_logprobs() -> None:
    g = make_group()
    s0 = g.samples[0].model_copy(update={"loss_mask": np.array([1, 0, 1], np.uint8)})
    m = model_token_mask([s0, g.samples[1]], torch.zeros(2, 5))
    assert m.tolist() == [[1, 0, 1, 0, 0], [1, 1, 1, 1, 0]]


def test_a_mask_that_does_not_fit_is_refused() -> None:
    s = make_group().samples[0]  # 3 response tokens
    with pytest.raises(ValueError, match="2 loss-mask entries for 3 response tokens"):
        Sample.model_validate({**s.model_dump(), "loss_mask": np.array([1, 0], np.uint8)})
    with pytest.raises(ValueError, match="holds 0"):
        Sample.model_validate({**s.model_dump(), "loss_mask": np.array([1, 2, 1], np.uint8)})
