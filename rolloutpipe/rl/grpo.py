"""GRPO: group-relative advantages, the clipped-ratio policy loss, KL and entropy terms, and the
loss aggregation modes.  Pure functions; both torch backends (and DeepSpeed) call these.

The exactness argument.  The loss of a mini-batch is accumulated group by group as a *sum* (the
numerator) and a *normaliser*, and divided only at the optimizer step.  Gradients are linear, so
this gives exactly the gradient of the mini-batch loss without knowing the mini-batch before it is
complete.  It holds for every aggregation mode because each mode's normaliser is itself a sum over
groups that a group can count on its own: the token count (``token-mean``), the sequence count
(``seq-mean-token-mean``, ``seq-mean-token-sum``), the sequence count times a constant length
(``seq-mean-token-sum-norm``) or one (``group-mean-token-mean``).  The divisions that are not
additive, a sequence's own token mean in ``seq-mean-token-mean`` and a group's own token mean in
``group-mean-token-mean``, are local to the sequence or the group, so they are done when its group
arrives.
See ``docs/grpo.md`` for each option against verl and TRL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

    from rolloutpipe.config import Config, TrainerConfig

LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
    "group-mean-token-mean",
]  # fmt: skip
AdvStd = Literal["unbiased", "biased", "none"]
KlEstimator = Literal["k1", "k2", "k3"]


def group_advantages(rewards: np.ndarray, std: AdvStd = "unbiased", eps: float = 1e-6) -> np.ndarray:
    """One group's advantages: ``(r - mean) / (std + eps)``, or ``r - mean`` with ``std="none"``
    (Dr. GRPO).  ``unbiased`` divides the variance by G - 1 (verl, TRL), ``biased`` by G.

    A group of one, or one whose rewards are all equal, carries no signal: its advantages are
    exactly zero (never NaN).  A std in (0, eps) is not zeroed: ``eps`` bounds the division, as in
    verl and TRL.  Any group size works, so allocation policies may extend groups.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.size <= 1 or np.all(r == r[0]):
        return np.zeros(r.shape, dtype=np.float32)
    centred = r - r.mean()
    if std == "none":
        none: np.ndarray = centred.astype(np.float32)
        return none
    sd = r.std(ddof=1 if std == "unbiased" else 0)
    out: np.ndarray = (centred / (sd + eps)).astype(np.float32)
    return out


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
    logratio_clamp: float | None = None,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss; the mask where the clip is the active branch; and the mask where
    the dual clip is (negative advantages only).  All ``[B, T]``; ``adv`` is ``[B]``.

    ``r = exp(clamp(logp - old_logp, ±logratio_clamp))``; ``l = max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high))``; with ``clip_ratio_c`` (dual clip, Ye et al. 2019) ``l = min(l, -A c)`` where
    ``A < 0``.  ``is_weight`` (truncated importance sampling, detached) multiplies the result.
    """
    import torch

    logratio = logp - old_logp
    if logratio_clamp is not None:
        logratio = torch.clamp(logratio, -logratio_clamp, logratio_clamp)
    ratio = torch.exp(logratio)
    a = adv.unsqueeze(-1)
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if clip_ratio_c is not None:
        floor = -a * clip_ratio_c
        dual_active = (loss > floor) & (a < 0)
        loss = torch.where(a < 0, torch.minimum(loss, floor), loss)
    if is_weight is not None:
        loss = loss * is_weight.detach()
    return loss, clip_active, dual_active


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KlEstimator, logratio_clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens (Schulman, "Approximating KL
    divergence", 2020): k1 = log(pi/pi_ref); k2 = (log(pi/pi_ref))^2 / 2; k3 = pi_ref/pi - 1 -
    log(pi_ref/pi), unbiased and low-variance (verl's ``low_var_kl``, TRL's only estimator)."""
    import torch

    d = logp - ref_logp
    if logratio_clamp is not None:
        d = torch.clamp(d, -logratio_clamp, logratio_clamp)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(-d) + d - 1.0


def tis_weight(trainer_old_logp: torch.Tensor, engine_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weight ``min(pi_trainer_old / pi_engine, cap)`` per token
    (Yao et al. 2025; verl ``tis_imp_ratio_cap``, slime ``--tis-clip``, TRL
    ``vllm_importance_sampling_cap``); detached."""
    import torch

    return torch.clamp(torch.exp(trainer_old_logp - engine_logp), max=cap).detach()


def aggregate_sum(
    losses: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg,
    norm_len: float = 1.0,
    group_tokens: float | None = None,
) -> tuple[torch.Tensor, float]:
    """The group's contribution to the mini-batch loss numerator, and to its normaliser.

    Summed over groups and divided once: ``token-mean`` = sum of tokens / tokens;
    ``seq-mean-token-mean`` = sum of per-sequence token means / sequences;
    ``seq-mean-token-sum`` = sum of per-sequence token sums / sequences;
    ``seq-mean-token-sum-norm`` = sum of per-sequence token sums / (sequences x ``norm_len``), the
    constant length of Dr. GRPO; ``group-mean-token-mean`` = sum of per-group token means / groups:
    each group weighs as one prompt, whatever its size, so extra samples of a prompt (VIGOR) cut
    that prompt's noise instead of raising its weight.  An empty response adds nothing to a
    numerator; it counts as a sequence in the ``seq-*`` normalisers (and as no token in
    ``token-mean``); a group of empty responses counts as a group.  ``group_tokens``: the whole
    group's token count, when ``losses`` hold only part of it (a DeepSpeed rank's share).
    """
    masked = losses * mask
    if mode == "token-mean":
        return masked.sum(), float(mask.sum().item())
    if mode == "group-mean-token-mean":
        tokens = float(mask.sum().item()) if group_tokens is None else group_tokens
        return masked.sum() / max(tokens, 1.0), 1.0
    n = float(losses.shape[0])
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), n
    if mode == "seq-mean-token-sum":
        return masked.sum(), n
    if mode == "seq-mean-token-sum-norm":
        return masked.sum(), n * norm_len
    raise ValueError(f"unknown loss aggregation {mode!r}")


def token_entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution from its log-softmax ``[..., V]``."""
    import torch

    return -(torch.exp(logp_all) * logp_all).sum(-1)


def has_gradient(tc: TrainerConfig, advantages: list[np.ndarray]) -> bool:
    """Whether a mini-batch's loss can have a nonzero gradient: some advantage is nonzero, or the
    loss has a KL or an entropy term.

    With every advantage 0 (every group flat: all its rewards equal) and neither term, each token's
    loss is 0 x its ratio, so the gradient is exactly zero, yet AdamW's step on it still moves the
    weights, by its momentum (and weight decay) alone.  ``trainer.flat_minibatch: skip`` takes no
    step there.
    """
    return tc.kl_coef > 0 or tc.entropy_coef != 0 or any(bool(np.any(a != 0)) for a in advantages)


def recomputes(tc: TrainerConfig) -> bool:
    """Whether old logprobs come from the version-k trainer weights (``frozen`` is the old name)."""
    return tc.old_logprobs in ("recompute", "frozen")


def norm_len(cfg: Config) -> float:
    """The constant length ``seq-mean-token-sum-norm`` divides by (Dr. GRPO's MAX_TOKENS)."""
    return float(cfg.trainer.loss_agg_norm_len or cfg.rollout.max_new_tokens)


def group_normaliser(lengths: list[int], mode: LossAgg, norm_len: float = 1.0) -> float:
    """A group's share of the mini-batch normaliser from its response lengths alone: what
    ``aggregate_sum`` returns as its second value (DeepSpeed ranks count the whole group with it)."""
    if mode == "token-mean":
        return float(sum(lengths))
    if mode == "group-mean-token-mean":
        return 1.0
    return float(len(lengths)) * (norm_len if mode == "seq-mean-token-sum-norm" else 1.0)


TOKEN_STATS = ("clipfrac", "clipfrac_lower", "kl", "entropy", "logprob_mismatch", "tis_weight")


def group_loss(
    tc: TrainerConfig,
    logp: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    engine_logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
    norm_len: float,
    group_tokens: float | None = None,
) -> tuple[torch.Tensor, float, dict[str, float]]:
    """One group's loss numerator (with its graph), its normaliser, and sums of per-token stats.

    Per token: ``policy_loss`` (times the TIS weight when ``tis_cap``) ``+ kl_coef x kl - entropy_coef
    x entropy``, then aggregated by ``loss_agg`` (so the KL and entropy terms are aggregated like
    the policy loss, as verl does).  ``old_logp`` is ``engine_logp`` unless recomputed.  The stats
    are sums over the group's response tokens (divided by the mini-batch token count at the step);
    ``logprob_mismatch`` is ``|log pi_trainer - log pi_engine|`` with the trainer's version-k
    logprobs when recomputed, else the current ones (exact in a step's first mini-batch).
    """
    lo, hi = tc.clip_range
    is_w = tis_weight(old_logp, engine_logp, tc.tis_cap) if tc.tis_cap > 0 else None
    tok, clip, dual = policy_loss(logp, old_logp, adv, lo, hi, tc.clip_ratio_c, tc.logratio_clamp, is_w)
    trainer_logp = old_logp if recomputes(tc) else logp.detach()
    sums = {
        "tokens": float(mask.sum().item()),
        "clipfrac": float((clip.float() * mask).sum().item()),
        "clipfrac_lower": float((dual.float() * mask).sum().item()),
        "logprob_mismatch": float(((trainer_logp - engine_logp).abs() * mask).sum().item()),
    }
    if is_w is not None:
        sums["tis_weight"] = float((is_w * mask).sum().item())
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, tc.kl_estimator, tc.logratio_clamp)
        tok = tok + tc.kl_coef * kl
        sums["kl"] = float((kl.detach() * mask).sum().item())
    if entropy is not None:
        if tc.entropy_coef:
            tok = tok - tc.entropy_coef * entropy
        sums["entropy"] = float((entropy.detach() * mask).sum().item())
    num, den = aggregate_sum(tok, mask, tc.loss_agg, norm_len, group_tokens)
    sums["loss"] = float(num.detach().item())
    return num, den, sums


def step_stats(sums: dict[str, float], norm: float) -> dict[str, float]:
    """A mini-batch's stats from the summed group stats: the loss over the normaliser, the rest as
    token means."""
    out = {"loss": sums.get("loss", 0.0) / max(norm, 1.0)}
    tokens = max(sums.get("tokens", 0.0), 1.0)
    for k in TOKEN_STATS:
        if k in sums:
            out[k] = sums[k] / tokens
    return out
