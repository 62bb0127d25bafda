"""GRPO maths and weight publishing, in isolation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rolloutpipe.errors import WeightsVerificationError
from rolloutpipe.model.weights import load_verified_state, publish_weights
from rolloutpipe.rl.grpo import aggregate_sum, group_advantages, policy_loss


def test_group_advantages() -> None:
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]))  # unbiased std sqrt(1/3), as verl and TRL
    np.testing.assert_allclose(adv, [0.8660254, -0.8660254, -0.8660254, 0.8660254], atol=1e-5)
    assert adv.dtype == np.float32
    assert not group_advantages(np.array([1.0, 1.0, 1.0])).any()  # zero variance: no signal


def test_clip_only_bites_beyond_eps() -> None:
    logp = torch.log(torch.tensor([[1.5, 1.1, 0.5]]))
    old = torch.zeros_like(logp)
    loss_pos, clipped_pos, _ = policy_loss(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    # positive advantage: ratio 1.5 is clipped to 1.2, ratio 1.1 is not, ratio 0.5 keeps its (worse) value
    torch.testing.assert_close(loss_pos, -torch.tensor([[1.2, 1.1, 0.5]]))
    assert clipped_pos.tolist() == [[True, False, False]]
    loss_neg, _, _ = policy_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.2)
    torch.testing.assert_close(loss_neg, torch.tensor([[1.5, 1.1, 0.8]]))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_sum_then_normalise_equals_the_minibatch_mean(mode: str) -> None:
    """Accumulating groups as sums and dividing at the step == the loss of the whole mini-batch."""
    g = torch.Generator().manual_seed(0)
    losses = [torch.randn(4, 6, generator=g) for _ in range(3)]
    masks = [(torch.rand(4, 6, generator=g) > 0.3).float() for _ in range(3)]
    for m in masks:
        m[:, 0] = 1.0
    num = sum(aggregate_sum(lo, m, mode)[0] for lo, m in zip(losses, masks, strict=True))  # type: ignore[arg-type]
    den = sum(aggregate_sum(lo, m, mode)[1] for lo, m in zip(losses, masks, strict=True))  # type: ignore[arg-type]
    big_l, big_m = torch.cat(losses), torch.cat(masks)
    if mode == "token-mean":
        want = (big_l * big_m).sum() / big_m.sum()
    else:
        want = ((big_l * big_m).sum(-1) / big_m.sum(-1)).mean()
    torch.testing.assert_close(num / den, want)


def test_weights_are_verified_before_loading(tmp_path: Path) -> None:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    pv = publish_weights(state, tmp_path, "r", 3)
    assert Path(pv.path).name == "v000003" and not list(tmp_path.glob(".tmp*"))
    manifest = json.loads((Path(pv.path) / "manifest.json").read_text())
    assert manifest["sha256"] == pv.sha256
    torch.testing.assert_close(load_verified_state(pv)["w"], state["w"])
    f = Path(pv.path) / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the tensor data
    f.write_bytes(bytes(raw))
    with pytest.raises(WeightsVerificationError, match="sha256"):
        load_verified_state(pv)
    f.write_bytes(bytes(raw[: len(raw) // 2]))  # a half-written file
    with pytest.raises(WeightsVerificationError):
        load_verified_state(pv)
    f.unlink()
    with pytest.raises(WeightsVerificationError, match="missing"):
        load_verified_state(pv)


def test_old_versions_are_pruned(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2)}
    for v in range(5):
        pv = publish_weights(state, tmp_path, "r", v, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003", "v000004"]
    load_verified_state(pv)  # the newest is intact
