"""GRPO: group-relative advantages and the clipped-ratio loss.

The loss of a mini-batch is accumulated group by group as *sums* and divided by the mini-batch
normaliser (token count, or sequence count) only at the optimizer step.  Gradients are linear, so
this gives exactly the gradient of the mean, without knowing the mini-batch before it is complete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

LossAgg = Literal["token-mean", "seq-mean-token-mean"]


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(r - mean) / (std + eps) within one group; a zero-variance group gets zeros."""
    r = np.asarray(rewards, dtype=np.float64)
    std = r.std()
    if std < eps:
        return np.zeros(r.shape, dtype=np.float32)
    out: np.ndarray = ((r - r.mean()) / (std + eps)).astype(np.float32)
    return out


def clipped_token_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(r A, clip(r) A)``, ``r = exp(logp - old_logp)``; and the clip mask."""
    import torch

    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(-1)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * a
    return -torch.minimum(unclipped, clipped), clipped < unclipped  # where the clip is the active branch


def aggregate_sum(losses: torch.Tensor, mask: torch.Tensor, mode: LossAgg) -> tuple[torch.Tensor, float]:
    """The group's contribution to the mini-batch loss numerator, and to its normaliser."""
    if mode == "token-mean":
        return (losses * mask).sum(), float(mask.sum().item())
    per_seq = (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum(), float(losses.shape[0])
