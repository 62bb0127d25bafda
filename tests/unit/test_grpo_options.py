"""Each GRPO loss option (docs/grpo.md) against a hand computation on small fixed inputs.

The expected values are written out as literals or computed with plain Python loops over floats,
never by calling the function under test.  Edge cases: a group of one, all-equal rewards, a std
between 0 and eps, empty responses, a log-ratio above the clamp.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rolloutpipe.config import Config
from rolloutpipe.errors import ConfigError
from rolloutpipe.rl.grpo import (
    aggregate_sum,
    group_advantages,
    group_loss,
    group_normaliser,
    kl_penalty,
    policy_loss,
    tis_weight,
    token_entropy,
)
from rolloutpipe.roles.trainer import backends
from tests.support.config import make_config


def _hand_adv(r: list[float], ddof: int | None, eps: float) -> list[float]:
    n = len(r)
    m = sum(r) / n
    if ddof is None:
        return [x - m for x in r]
    var = sum((x - m) ** 2 for x in r) / (n - ddof)
    return [(x - m) / (math.sqrt(var) + eps) for x in r]


# ---------------------------------------------------------------------------------------- advantages


def test_advantage_std_modes_on_fixed_rewards() -> None:
    r = np.array([1.0, 0.0, 0.0, 1.0])
    # mean 0.5; unbiased std sqrt(1/3) = 0.57735; biased std 0.5
    u, b = 0.8660239, 0.999998  # 0.5 / (0.57735 + 1e-6), 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(group_advantages(r, "unbiased", 1e-6), [u, -u, -u, u], rtol=1e-6)
    np.testing.assert_allclose(group_advantages(r, "biased", 1e-6), [b, -b, -b, b], rtol=1e-6)
    np.testing.assert_allclose(group_advantages(r, "none", 1e-6), [0.5, -0.5, -0.5, 0.5])
    assert group_advantages(r).dtype == np.float32
    np.testing.assert_array_equal(group_advantages(r), group_advantages(r, "unbiased", 1e-6))  # the default


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 1.0, 1.0], [0.3, 2.0, -1.0], [5.0, 1.0]])
@pytest.mark.parametrize(("std", "ddof"), [("unbiased", 1), ("biased", 0), ("none", None)])
@pytest.mark.parametrize("eps", [1e-6, 1e-4, 0.5])
def test_advantages_match_a_loop(rewards: list[float], std: str, ddof: int | None, eps: float) -> None:
    """Variable group sizes (allocation policies extend groups): G = 2, 3, 5."""
    got = group_advantages(np.array(rewards), std, eps)  # type: ignore[arg-type]
    np.testing.assert_allclose(got, _hand_adv(rewards, ddof, eps), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("std", ["unbiased", "biased", "none"])
def test_a_group_of_one_and_equal_rewards_give_exact_zeros(std: str) -> None:
    for r in ([1.0], [0.0], [0.7, 0.7, 0.7], [0.1] * 7):
        adv = group_advantages(np.array(r), std)  # type: ignore[arg-type]
        assert adv.shape == (len(r),)
        assert np.all(adv == 0.0), (r, adv)  # exact zeros, not NaN or rounding noise


def test_std_between_zero_and_eps_is_bounded_by_eps() -> None:
    """std = 7.07e-8 < eps: (r - mean) / (std + eps), as verl and TRL compute it (not zeroed, not huge)."""
    r = np.array([0.0, 1e-7])
    sd = math.sqrt(((0.0 - 5e-8) ** 2 + (1e-7 - 5e-8) ** 2) / 1)
    assert 0 < sd < 1e-6
    want = 5e-8 / (sd + 1e-6)  # 0.04670
    np.testing.assert_allclose(group_advantages(r, "unbiased", 1e-6), [-want, want], rtol=1e-5)
    assert abs(want - 0.046704) < 1e-5


# ---------------------------------------------------------------------------------------- policy loss


def _hand_pg(d: float, a: float, lo: float, hi: float, c: float | None, clamp: float | None) -> float:
    if clamp is not None:
        d = max(-clamp, min(clamp, d))
    r = math.exp(d)
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


RATIOS = [0.5, 0.7, 0.85, 1.0, 1.1, 1.25, 1.5, 4.0]


@pytest.mark.parametrize(("lo", "hi"), [(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)])
@pytest.mark.parametrize("c", [None, 3.0])
def test_policy_loss_matches_a_loop(lo: float, hi: float, c: float | None) -> None:
    d = [math.log(x) for x in RATIOS]
    logp = torch.tensor([d, d], dtype=torch.float64)
    old = torch.zeros_like(logp)
    adv = torch.tensor([1.5, -0.5], dtype=torch.float64)
    loss, clip, dual = policy_loss(logp, old, adv, lo, hi, c, 20.0)
    want = [[_hand_pg(x, a, lo, hi, c, 20.0) for x in d] for a in (1.5, -0.5)]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64))
    # the clip is active where the clipped branch is the larger loss
    for i, a in enumerate((1.5, -0.5)):
        for j, x in enumerate(RATIOS):
            clipped_r = min(max(x, 1 - lo), 1 + hi)
            assert bool(clip[i, j]) == (-a * clipped_r > -a * x), (a, x)
            assert bool(dual[i, j]) == (c is not None and a < 0 and max(-a * x, -a * clipped_r) > -a * c)


def test_clip_high_is_asymmetric() -> None:
    """DAPO clip-higher: with A > 0 a ratio of 1.25 is kept under clip_high 0.28, clipped under 0.2."""
    logp = torch.log(torch.tensor([[1.25, 0.75]]))
    old = torch.zeros_like(logp)
    sym, _, _ = policy_loss(logp, old, torch.tensor([1.0]), 0.2, 0.2)
    asym, _, _ = policy_loss(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    torch.testing.assert_close(sym, torch.tensor([[-1.2, -0.75]]))
    torch.testing.assert_close(asym, torch.tensor([[-1.25, -0.75]]))
    neg, _, _ = policy_loss(logp, old, torch.tensor([-1.0]), 0.1, 0.28)  # A < 0: the low side is 1 - 0.1
    torch.testing.assert_close(neg, torch.tensor([[1.25, 0.9]]))


def test_dual_clip_bounds_a_negative_advantage() -> None:
    logp = torch.log(torch.tensor([[2.0, 5.0, 100.0]]))
    old = torch.zeros_like(logp)
    off, _, _ = policy_loss(logp, old, torch.tensor([-2.0]), 0.2, 0.2, None)
    on, _, dual = policy_loss(logp, old, torch.tensor([-2.0]), 0.2, 0.2, 3.0)
    torch.testing.assert_close(off, torch.tensor([[4.0, 10.0, 200.0]]))
    torch.testing.assert_close(on, torch.tensor([[4.0, 6.0, 6.0]]))  # min(-A r, -A c) = min(., 6)
    assert dual.tolist() == [[False, True, True]]
    pos, _, dual_pos = policy_loss(logp, old, torch.tensor([2.0]), 0.2, 0.2, 3.0)  # A > 0: untouched
    torch.testing.assert_close(pos, torch.tensor([[-2.4, -2.4, -2.4]]))
    assert not dual_pos.any()


def test_a_log_ratio_above_the_clamp() -> None:
    """log(pi/pi_old) = 30 > 20: the ratio is exp(20), not exp(30), and carries no gradient."""
    logp = torch.tensor([[30.0, -30.0, 0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    loss, _, _ = policy_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), 0.2, 0.2, None, 20.0)
    assert loss[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-12)  # 4.85e8, not 1.07e13
    assert loss[0, 1].item() == pytest.approx(0.8)  # exp(-20) clipped up to 1 - 0.2
    loss.sum().backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 2].item() == pytest.approx(math.exp(0.5))  # inside the clamp: d(-A r)/dlogp = r
    unclamped, _, _ = policy_loss(logp.detach(), old, torch.tensor([-1.0], dtype=torch.float64), 0.2, 0.2)
    assert unclamped[0, 0].item() == pytest.approx(math.exp(30.0), rel=1e-12)  # the clamp did the bounding


def test_tis_weight_is_truncated_and_multiplies_the_loss() -> None:
    trainer_old = torch.tensor([[-1.0, 0.0, -3.0]])
    engine = torch.tensor([[-1.5, -2.0, -2.0]])
    w = tis_weight(trainer_old, engine, 2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), 2.0, math.exp(-1.0)]]))
    logp = trainer_old.clone()
    loss, _, _ = policy_loss(logp, trainer_old, torch.tensor([1.0]), 0.2, 0.2, None, 20.0, w)
    torch.testing.assert_close(loss, -w)  # ratio 1: loss = -A x 1 x w


# ---------------------------------------------------------------------------------------- KL, entropy


def test_kl_estimators_by_hand() -> None:
    logp = torch.tensor([[-1.0, -2.5, -0.3]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -2.0, -0.3]], dtype=torch.float64)
    ds = [1.0, -0.5, 0.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([ds], dtype=torch.float64))
    torch.testing.assert_close(
        kl_penalty(logp, ref, "k2"), torch.tensor([[0.5 * d * d for d in ds]], dtype=torch.float64)
    )
    k3 = [math.exp(-d) - 1 + d for d in ds]  # r - 1 - log r with r = pi_ref / pi
    assert k3[0] == pytest.approx(0.36787944) and k3[1] == pytest.approx(0.14872127) and k3[2] == 0.0
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([k3], dtype=torch.float64))
    far = kl_penalty(torch.tensor([[-40.0]]), torch.tensor([[0.0]]), "k3", 20.0)  # d = -40 -> -20
    assert far.item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_entropy_by_hand() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    got = token_entropy(torch.log_softmax(logits, -1))
    want = []
    for row in ([2.0, 0.0, -1.0], [0.0, 0.0, 0.0]):
        z = sum(math.exp(x) for x in row)
        want.append(-sum(math.exp(x) / z * math.log(math.exp(x) / z) for x in row))
    assert want[1] == pytest.approx(math.log(3))
    torch.testing.assert_close(got, torch.tensor([want], dtype=torch.float64))


# ---------------------------------------------------------------------------------------- aggregation

LOSSES = [[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 99.0, 99.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]  # lengths 3, 2 and an empty response


@pytest.mark.parametrize(
    ("mode", "num", "den"),
    [
        ("token-mean", 15.0, 5.0),  # 1+2+3+4+5 over 5 tokens
        ("seq-mean-token-mean", 6.5, 3.0),  # 6/3 + 9/2 + 0 (empty) over 3 sequences
        ("seq-mean-token-sum", 15.0, 3.0),  # 6 + 9 + 0 over 3 sequences
        ("seq-mean-token-sum-norm", 15.0, 24.0),  # over 3 sequences x norm_len 8
        ("group-mean-token-mean", 3.0, 1.0),  # the group's token mean, 15 / 5, as one prompt
    ],
)
def test_aggregation_modes_by_hand(mode: str, num: float, den: float) -> None:
    got_num, got_den = aggregate_sum(torch.tensor(LOSSES), torch.tensor(MASK), mode, 8.0)  # type: ignore[arg-type]
    assert got_num.item() == pytest.approx(num) and got_den == den
    assert group_normaliser([3, 2, 0], mode, 8.0) == den  # type: ignore[arg-type]


def test_a_group_of_empty_responses_adds_nothing() -> None:
    losses, mask = torch.zeros((2, 0)), torch.zeros((2, 0))
    assert aggregate_sum(losses, mask, "token-mean")[1] == 0.0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        num, den = aggregate_sum(losses, mask, mode)  # type: ignore[arg-type]
        assert num.item() == 0.0 and den == 2.0
    num, den = aggregate_sum(losses, mask, "group-mean-token-mean")
    assert num.item() == 0.0 and den == 1.0  # still a prompt of the mini-batch


def test_a_group_split_over_ranks_keeps_its_own_token_mean() -> None:
    """DeepSpeed gives each rank every world-th sample of a group: with the whole group's token
    count, the ranks' numerators add up to the group's token mean (not a mean of two means)."""
    losses, mask = torch.tensor(LOSSES), torch.tensor(MASK)
    whole, _ = aggregate_sum(losses, mask, "group-mean-token-mean")
    parts = [
        aggregate_sum(losses[r::2], mask[r::2], "group-mean-token-mean", group_tokens=5.0)[0] for r in (0, 1)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item()) == pytest.approx(3.0)
    alone = [aggregate_sum(losses[r::2], mask[r::2], "group-mean-token-mean")[0].item() for r in (0, 1)]
    assert sum(alone) != pytest.approx(3.0)  # each part's own mean would be wrong: 2.0 + 4.5


@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "group-mean-token-mean",
    ],
)
def test_sum_then_normalise_equals_the_minibatch_loss(mode: str) -> None:
    """Groups one by one (sums, one division) == the mode's loss of the whole padded mini-batch,
    written as a loop."""
    g = torch.Generator().manual_seed(0)
    groups = []
    for n, t in ((4, 6), (1, 3), (3, 5)):
        lo = torch.randn(n, t, generator=g, dtype=torch.float64)
        lengths = [int(x) for x in torch.randint(0, t + 1, (n,), generator=g)]
        m = torch.tensor([[1.0 if j < ln else 0.0 for j in range(t)] for ln in lengths], dtype=torch.float64)
        groups.append((lo, m, lengths))
    nums, dens = zip(*(aggregate_sum(lo, m, mode, 6.0) for lo, m, _ in groups), strict=True)  # type: ignore[arg-type]
    got = float(sum(x.item() for x in nums)) / sum(dens)
    seqs = [(lo[i, :ln].tolist()) for lo, _, lengths in groups for i, ln in enumerate(lengths)]
    if mode == "token-mean":
        want = sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    elif mode == "seq-mean-token-mean":
        want = sum(sum(s) / len(s) if s else 0.0 for s in seqs) / len(seqs)
    elif mode == "seq-mean-token-sum":
        want = sum(sum(s) for s in seqs) / len(seqs)
    elif mode == "group-mean-token-mean":
        per_group = [[lo[i, :ln].tolist() for i, ln in enumerate(lengths)] for lo, _, lengths in groups]
        means = [sum(map(sum, g)) / max(sum(map(len, g)), 1) for g in per_group]
        want = sum(means) / len(means)
    else:
        want = sum(sum(s) / 6.0 for s in seqs) / len(seqs)
    assert got == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------- the whole loss


def test_group_loss_with_every_term_by_hand(tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path, "gl", "trainer.clip_low=0.2", "trainer.clip_high=0.28", "trainer.kl_coef=0.1",
        "trainer.kl_estimator=k3", "trainer.entropy_coef=0.01", "trainer.old_logprobs=recompute",
        "trainer.tis_cap=2.0", "trainer.loss_agg=seq-mean-token-mean",
    )  # fmt: skip
    tc = cfg.trainer
    logp_l = [[-1.0, -0.5, -2.0], [-0.2, -3.0, 0.0]]
    old_l = [[-1.2, -0.5, -1.0], [-1.5, -1.0, 0.0]]  # -0.2 - -1.5: a ratio of 3.7 > clip_ratio_c
    eng_l = [[-1.0, -1.5, -1.0], [-0.3, -0.9, 0.0]]
    ref_l = [[-1.1, -0.4, -2.5], [-0.25, -2.0, 0.0]]
    ent_l = [[0.9, 1.1, 0.3], [0.5, 0.7, 0.0]]
    mask_l = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    adv_l = [0.7, -1.3]

    def t(x: list[list[float]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float64)

    logp = t(logp_l).requires_grad_(True)
    num, den, sums = group_loss(
        tc,
        logp,
        t(mask_l),
        torch.tensor(adv_l, dtype=torch.float64),
        t(eng_l),
        t(old_l),
        t(ref_l),
        t(ent_l),
        4.0,
    )
    want_num, clipn, duals, kls, ents, mism, tis = 0.0, 0, 0, 0.0, 0.0, 0.0, 0.0
    for i, a in enumerate(adv_l):
        seq, n = 0.0, 0
        for j in range(3):
            if not mask_l[i][j]:
                continue
            d = logp_l[i][j] - old_l[i][j]
            r = math.exp(d)
            w = min(math.exp(old_l[i][j] - eng_l[i][j]), 2.0)
            pg1, pg2 = -a * r, -a * min(max(r, 0.8), 1.28)
            pg = max(pg1, pg2)
            clipn += pg2 > pg1
            if a < 0 and pg > -a * 3.0:
                pg, duals = -a * 3.0, duals + 1
            dk = logp_l[i][j] - ref_l[i][j]
            kl = math.exp(-dk) + dk - 1
            seq += pg * w + 0.1 * kl - 0.01 * ent_l[i][j]
            n += 1
            kls, ents, tis = kls + kl, ents + ent_l[i][j], tis + w
            mism += abs(old_l[i][j] - eng_l[i][j])
        want_num += seq / n
    assert num.item() == pytest.approx(want_num, rel=1e-12)
    assert den == 2.0  # two sequences
    assert sums["tokens"] == 5.0 and sums["clipfrac"] == clipn and sums["clipfrac_lower"] == duals
    assert sums["kl"] == pytest.approx(kls) and sums["entropy"] == pytest.approx(ents)
    assert sums["tis_weight"] == pytest.approx(tis) and sums["logprob_mismatch"] == pytest.approx(mism)
    assert clipn > 0 and duals > 0  # the inputs exercise both clips


# ---------------------------------------------------------------------------------------- config


def test_config_defaults_and_names(tmp_path: Path) -> None:
    tc = Config().trainer
    assert (tc.adv_std, tc.adv_eps, tc.clip_range, tc.clip_ratio_c, tc.logratio_clamp) == (
        "unbiased", 1e-6, (0.2, 0.2), 3.0, 20.0
    )  # fmt: skip
    assert (tc.kl_coef, tc.kl_estimator, tc.entropy_coef, tc.loss_agg, tc.old_logprobs, tc.tis_cap) == (
        0.0, "k3", 0.0, "token-mean", "engine", 0.0
    )  # fmt: skip
    cfg = make_config(tmp_path, "c", "trainer.clip_eps=0.3", "trainer.clip_high=0.4")
    assert cfg.trainer.clip_range == (0.3, 0.4)  # clip_eps is the shorthand for whichever is unset
    assert make_config(tmp_path, "c", "trainer.old_logprobs=frozen").trainer.old_logprobs == "recompute"
    assert make_config(tmp_path, "c", "trainer.clip_ratio_c=null").trainer.clip_ratio_c is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("trainer.tis_cap=2.0",), "needs old_logprobs=recompute"),
        (("trainer.tis_cap=0.5", "trainer.old_logprobs=recompute"), "tis_cap must be >= 1"),
        (("trainer.clip_ratio_c=1.0",), "clip_ratio_c must be > 1"),
        (("trainer.ref_path=/x",), "kl_coef is 0"),
        (("trainer.backend=deepspeed", "trainer.kl_coef=0.01"), "deepspeed backend loads no reference"),
        (("trainer.adv_std=sample",), "adv_std"),
        (("trainer.loss_agg=seq-sum",), "loss_agg"),
        (("trainer.kl_estimator=k4",), "kl_estimator"),
    ],
)
def test_config_rejects(tmp_path: Path, overrides: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_config(tmp_path, "c", *overrides)


# ---------------------------------------------------------------------------------------- emulated costs


@pytest.mark.parametrize(
    ("overrides", "passes"),
    [
        ((), 1.0),
        (("trainer.kl_coef=0.01",), 1.0 + 1 / 3),
        (("trainer.old_logprobs=recompute",), 1.0 + 1 / 3),
        (("trainer.kl_coef=0.01", "trainer.old_logprobs=recompute"), 1.0 + 2 / 3),
        (("trainer.entropy_coef=0.01", "trainer.clip_high=0.28", "trainer.loss_agg=seq-mean-token-sum"), 1.0),
        (("trainer.old_logprobs=recompute", "trainer.emulated.forward_pass_cost=0.5"), 1.5),
        (("trainer.activation_checkpointing=true",), 1.0 + 1 / 3),
        # slime's default (its scripts/run-qwen3-4B.sh): reference, old logprobs, full recompute
        (
            (
                "trainer.kl_coef=0.001",
                "trainer.old_logprobs=recompute",
                "trainer.activation_checkpointing=true",
            ),
            2.0,
        ),
    ],
)
def test_emulated_trainer_charges_the_extra_forwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...], passes: float
) -> None:
    from rolloutpipe.broker.events import Group
    from tests.support.events import make_group

    cfg = make_config(tmp_path, "e", "trainer.backend=emulated", "trainer.emulated.tokens_per_s=1000",
                      "trainer.emulated.time_scale=0.5", *overrides)  # fmt: skip
    slept: list[float] = []
    monkeypatch.setattr(backends.time, "sleep", slept.append)
    g: Group = make_group()
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in g.samples)
    backends.EmulatedBackend(cfg).accumulate(g)
    assert slept == [pytest.approx(tokens * passes / 1000 * 0.5)]


def test_emulated_trainer_charges_a_call_overhead_per_group_and_an_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each forward+backward call (one per group, as the real trainer makes) costs the overhead on
    top of its tokens; each optimizer step costs ``optimizer_step_s``; nothing else is charged."""
    from tests.support.events import make_group

    cfg = make_config(tmp_path, "e", "trainer.backend=emulated", "trainer.emulated.tokens_per_s=1000",
                      "trainer.emulated.time_scale=0.5", "trainer.emulated.call_overhead_s=0.2",
                      "trainer.emulated.optimizer_step_s=0.7")  # fmt: skip
    slept: list[float] = []
    monkeypatch.setattr(backends.time, "sleep", slept.append)
    g = make_group()
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in g.samples)
    be = backends.EmulatedBackend(cfg)
    be.accumulate(g)
    be.accumulate(g)
    be.optimizer_step()
    assert slept == [pytest.approx((0.2 + tokens / 1000) * 0.5)] * 2 + [pytest.approx(0.7 * 0.5)]


def test_the_reference_model_is_the_initial_weights_or_ref_path(tmp_path: Path, model_cache: str) -> None:
    from rolloutpipe.model.lm import ensure_model, load_model
    from rolloutpipe.roles.trainer.backends import TorchBackend

    base = make_config(tmp_path, "ref", f"model.cache_dir={model_cache}")
    assert TorchBackend(base).ref is None  # kl_coef 0: nothing loaded
    init = load_model(ensure_model(base.model))
    other = load_model(ensure_model(base.model))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    other.save_pretrained(tmp_path / "ckpt")
    be = TorchBackend(make_config(tmp_path, "ref", f"model.cache_dir={model_cache}", "trainer.kl_coef=0.1"))
    assert be.ref is not None and not any(p.requires_grad for p in be.ref.parameters())
    for (name, p), q in zip(be.ref.named_parameters(), init.parameters(), strict=True):
        assert torch.equal(p, q), name
    with torch.no_grad():  # training the policy leaves the reference where it was
        next(be.model.parameters()).add_(1.0)
    assert not torch.equal(next(be.model.parameters()), next(be.ref.parameters()))
    be2 = TorchBackend(
        make_config(tmp_path, "ref", f"model.cache_dir={model_cache}", "trainer.kl_coef=0.1",
                    f"trainer.ref_path={tmp_path / 'ckpt'}")
    )  # fmt: skip
    assert be2.ref is not None
    for (name, p), q in zip(be2.ref.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_activation_checkpointing_recomputes_the_forward_and_changes_no_gradient(
    tmp_path: Path, model_cache: str
) -> None:
    """trainer.activation_checkpointing (slime's --recompute-granularity full): each decoder layer's
    MLP runs again in the backward (counted by a hook: a no-op option fails here), and the
    gradients equal those without it."""
    from rolloutpipe.roles.trainer.backends import TorchBackend
    from tests.support.events import make_group

    g = make_group()
    rng = np.random.default_rng(0)
    vocab = [  # ids the tiny model's 18-token vocabulary holds
        {"prompt_ids": np.array([1, 2, 3], dtype=np.int32),
         "response_ids": rng.integers(4, 18, size=len(s.response_ids)).astype(np.int32)}
        for s in g.samples
    ]  # fmt: skip
    g = g.model_copy(
        update={"samples": [s.model_copy(update=v) for s, v in zip(g.samples, vocab, strict=True)]}
    )
    grads, calls = [], []
    for on in (False, True):
        be = TorchBackend(make_config(tmp_path, "ac", f"model.cache_dir={model_cache}",
                                      f"trainer.activation_checkpointing={str(on).lower()}"))  # fmt: skip
        layer = next(m for m in be.model.modules() if type(m).__name__.endswith("DecoderLayer"))
        # a module inside the layer, counted by wrapping its forward: HF keeps the layer's hooks
        # outside the checkpoint, and the recompute does not run forward hooks
        n, forward = [0], layer.mlp.forward

        def counted(*a: object, _f: object = forward, _n: list[int] = n, **k: object) -> object:
            _n[0] += 1
            return _f(*a, **k)  # type: ignore[operator]

        layer.mlp.forward = counted
        be.accumulate(g)
        calls.append(n[0])
        grads.append([p.grad.clone() for p in be.model.parameters() if p.grad is not None])
    assert calls == [1, 2]  # one forward, then the same forward again in the backward
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
