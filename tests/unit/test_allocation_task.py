"""The allocation task, its held-out evaluation and the benchmark's accounting, without Redis.

The accounting functions are checked against figures worked out by hand here, not against
themselves: cumulative rollouts count every released sample (trained + wasted), wall seconds leave
out evaluation time, and the ratio against ``fixed`` is paired by seed.
"""

from __future__ import annotations

import numpy as np
import pytest

from rolloutpipe.bench.allocation import Point, at, crossing, curve, summarise, target_by_rule
from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.config import load_config
from rolloutpipe.errors import ConfigError
from rolloutpipe.tasks.datasets import (
    digit_ops,
    digit_ops_answer,
    digit_ops_is_eval,
    load_dataset,
    mod10_addition,
)
from rolloutpipe.tasks.verifiers import exact_match
from tests.support.config import ROOT


def test_digit_ops_answers_by_hand() -> None:
    assert digit_ops_answer("-3141=") == "3141"
    assert digit_ops_answer("+3149=") == "4250"
    assert digit_ops_answer("*3141=") == "1413"
    assert digit_ops_answer("*7=") == "7"
    with pytest.raises(ValueError):
        digit_ops_answer("/12=")


def test_digit_ops_splits_are_disjoint_seeded_and_mixed() -> None:
    train = digit_ops(4000, seed=0)
    held = digit_ops(500, seed=0, split="eval")
    assert not {p.text for p in train} & {p.text for p in held}
    assert all(not digit_ops_is_eval(p.text) for p in train) and all(digit_ops_is_eval(p.text) for p in held)
    assert digit_ops(50, seed=0) == train[:50]  # same seed, same order
    assert digit_ops(50, seed=1) != train[:50]
    assert {len(p.answer) for p in train} == set(range(1, 7))  # one to six answer tokens (+ EOS)
    assert {p.text[0] for p in train} == {"-", "+", "*"}
    assert all(p.answer == digit_ops_answer(p.text) for p in train)
    with pytest.raises(ConfigError):
        digit_ops(1, 0, split="test")


def test_eval_split_needs_a_dataset_that_has_one() -> None:
    assert load_dataset("rolloutpipe.tasks.datasets:digit_ops", 3, 0, split="eval")
    with pytest.raises(ConfigError, match="held-out split"):
        load_dataset("rolloutpipe.tasks.datasets:mod10_addition", 3, 0, split="eval")
    assert mod10_addition(3, 0) == load_dataset("rolloutpipe.tasks.datasets:mod10_addition", 3, 0)


def _m(
    step: int,
    samples: int,
    wasted: int,
    ev: float | None,
    start: float,
    end: float,
    eval_s: float,
    mbs: int = 4,
) -> StepMetrics:
    return StepMetrics(
        run="r", step=step, policy_version=step, mode="m", rollout_to_train_end_s=end - start,
        trainer_wait_ratio=0.0, first_group_s=0.0, reward_mean=0.5, groups=1, samples=samples, tokens=0,
        fence_rejections=0, dead_letters=0, train_busy_s=0.0, rollout_makespan_s=0.0,
        last_minibatch_train_s=0.0, dispatch_latency_p50_s=0.0, dispatch_latency_p99_s=0.0,
        samples_wasted=wasted, step_start=start, train_end=end, eval_reward=ev, eval_s=eval_s,
        minibatches=[[f"{step}:{i}"] for i in range(mbs)],
    )  # fmt: skip


def test_curve_counts_wasted_rollouts_optimizer_steps_and_leaves_out_eval_time() -> None:
    ms = [
        _m(0, 100, 28, None, start=10.0, end=11.0, eval_s=0.0, mbs=4),
        _m(1, 64, 0, 0.30, start=11.0, end=12.0, eval_s=0.5, mbs=3),  # evaluated after step 1's training
        _m(2, 80, 16, None, start=12.5, end=13.5, eval_s=0.0, mbs=4),
        _m(3, 96, 32, 0.55, start=13.5, end=15.0, eval_s=0.5, mbs=4),
    ]
    pts = curve(ms, base_eval=0.2)
    # rollouts: 128, 192, 288, 416; wall: 12-10 = 2.0, then 15-10 minus the 0.5 s of step 1's eval
    assert pts == [Point(-1, 0, 0.2, 0.0, 0), Point(1, 192, 0.30, 2.0, 7), Point(3, 416, 0.55, 4.5, 15)]
    # the crossing, linear between the evaluations around it: 0.5 is 0.2/0.25 of the way from 0.30
    assert crossing(pts, 0.5) == pytest.approx(192 + 0.8 * 224)
    assert crossing(pts, 0.5, "opt_steps") == pytest.approx(7 + 0.8 * 8)
    assert crossing(pts, 0.2) == 0.0
    assert crossing(pts, 0.6) is None
    assert at(pts, 96) == pytest.approx(0.2 + 0.5 * 0.1)  # halfway from 0 to 192 rollouts
    assert at(pts, 304) == pytest.approx(0.30 + (112 / 224) * 0.25)
    assert at(pts, 10_000) == 0.55
    assert at(pts, 11, "opt_steps") == pytest.approx(0.30 + 0.5 * 0.25)
    # a non-monotone curve: the first crossing counts, not a later one
    wiggly = [
        Point(-1, 0, 0.2, 0.0),
        Point(0, 100, 0.6, 1.0),
        Point(1, 200, 0.4, 2.0),
        Point(2, 300, 0.7, 3.0),
    ]
    assert crossing(wiggly, 0.5) == pytest.approx(75.0)


def test_target_rule_is_a_share_of_the_calibration_runs_gain() -> None:
    pts = [Point(-1, 0, 0.2, 0.0)] + [
        Point(i, 100 * i, e, 0.0) for i, e in enumerate([0.3, 0.5, 0.6, 0.6, 0.3 + 0.6])
    ]
    # plateau: mean of the last 3 (0.6, 0.6, 0.9) = 0.7; 0.2 + 0.75 x 0.5
    assert target_by_rule(pts, {"gain": 0.75, "last": 3}) == pytest.approx(0.575)


def test_summary_ratios_are_paired_by_seed() -> None:
    def run(points: list[tuple[int, float]]) -> dict[str, object]:
        pts = [Point(-1, 0, 0.1, 0.0)] + [
            Point(i, r, e, float(i), 4 * (i + 1)) for i, (r, e) in enumerate(points)
        ]
        return {
            "curve": pts,
            "metrics": [_m(0, 10, 2, None, 0.0, 1.0, 0.0), _m(1, 10, 0, None, 1.0, 2.0, 0.0)],
        }

    runs = {
        "fixed": {0: run([(100, 0.3), (200, 0.6)]), 1: run([(100, 0.3), (400, 0.6)])},
        "pilot": {0: run([(50, 0.6), (150, 0.7)]), 1: run([(100, 0.6), (300, 0.7)])},
        "never": {0: run([(100, 0.2), (200, 0.3)]), 1: run([(100, 0.6), (200, 0.7)])},
    }
    doc = summarise(runs, target=0.5)
    p = doc["policies"]
    assert doc["budget_rollouts"] == 150  # the smallest total of any run
    # fixed crosses 0.5 two thirds of the way from 0.3 to 0.6: 100 + 2/3 x 100, 100 + 2/3 x 300
    assert p["fixed"]["rollouts_to_target_per_seed"] == pytest.approx([100 + 200 / 3, 300])
    # the pilot crosses between the base (0.1 at 0) and 0.6: 0.8 of the way
    assert p["pilot"]["rollouts_to_target_per_seed"] == pytest.approx([40, 80])
    assert p["pilot"]["ratio_vs_fixed_per_seed"] == pytest.approx([(500 / 3) / 40, 300 / 80])
    assert p["pilot"]["ratio_vs_fixed"] == pytest.approx(((500 / 3) / 40 + 300 / 80) / 2)
    assert p["pilot"]["ratio_vs_fixed_ci95"] is not None
    assert p["never"]["reached"] == 1
    assert p["never"]["rollouts_to_target_mean"] is None  # a seed that never got there is not averaged away
    assert p["never"]["ratio_vs_fixed"] is None
    assert len(p["never"]["ratio_vs_fixed_per_seed"]) == 1
    assert p["fixed"]["rollouts_per_step_mean"] == 11.0  # (10 + 2 + 10 + 0) / 2 per run
    assert p["fixed"]["optimizer_steps_per_step_mean"] == 4.0
    # at 150 rollouts: 0.3 + (50/100) x 0.3, and 0.3 + (50/300) x 0.3
    assert p["fixed"]["eval_reward_at_equal_rollouts_per_seed"] == pytest.approx([0.45, 0.35])
    # every run ends at 8 optimizer steps: the same reward as the last point, so the pilot is ahead
    assert p["pilot"]["per_optimizer_step_vs_fixed"] == pytest.approx(0.1)
    assert p["fixed"]["per_optimizer_step_vs_fixed"] == 0.0
    # every pair, by seed: never over the pilot, on the one seed never reached (80 / 80)
    assert p["pilot"]["ratio_vs"]["fixed"]["per_seed"] == p["pilot"]["ratio_vs_fixed_per_seed"]
    assert p["pilot"]["ratio_vs"]["never"]["per_seed"] == pytest.approx([1.0])
    assert p["pilot"]["ratio_vs"]["never"]["mean"] is None  # one seed of two: no mean


def test_warm_start_makes_a_base_model_that_solves_some_held_out_prompts(tmp_path: object) -> None:
    """The base model RL starts from: warm-started, it scores well above the random model on the
    held-out split, and below perfect (there is something left to learn)."""
    from rolloutpipe.model.lm import ensure_model, load_model
    from rolloutpipe.roles.trainer.evaluate import Evaluator

    scores = {}
    for steps in (0, 100):
        cfg = load_config(
            ROOT / "configs" / "allocation.yaml",
            [f"model.warm_start.steps={steps}", f"model.cache_dir={tmp_path}", "eval.num_prompts=128"],
            environ={},
        )
        scores[steps] = Evaluator(cfg)(load_model(ensure_model(cfg.model), 1))
    assert scores[0] < 0.02  # a random char-level model almost never writes the digits and EOS
    assert 0.15 < scores[100] < 0.9, scores


def test_evaluator_uses_fixed_draws_and_the_verifier() -> None:
    import torch

    from rolloutpipe.model.lm import ensure_model, load_model
    from rolloutpipe.roles.trainer.evaluate import Evaluator

    cfg = load_config(ROOT / "configs" / "allocation.yaml", ["eval.num_prompts=64"], environ={})
    ev = Evaluator(cfg)
    assert all(digit_ops_is_eval(p.text) for p, _ in ev.items)
    assert ev.scorer.fn is exact_match and ev.scorer.mode == "inline"  # a cheap check: no pool
    model = load_model(ensure_model(cfg.model), 1)
    a, b = ev(model), ev(model)
    assert a == b  # the same weights, the same draws: the same score
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.from_numpy(np.random.default_rng(0).normal(0, 0.5, tuple(p.shape))).float())
    assert ev(model) != a


def test_tail_shows_skipped_wasted_and_held_out_reward() -> None:
    from rolloutpipe.tools.tail import _details

    with_eval = " ".join(
        _details(_m(3, 96, 32, 0.55, 0.0, 1.0, 0.1).model_copy(update={"groups_skipped": 2}))
    )
    assert "skipped 2 wasted 32 held-out 0.550" in with_eval
    assert "held-out" not in " ".join(_details(_m(2, 96, 0, None, 0.0, 1.0, 0.0)))


def test_targets_say_met_or_missed_and_by_how_much() -> None:
    from rolloutpipe.bench.allocation import targets

    def pol(
        r: float | None, ds: float | None = None, step_ci: list[float] | None = None
    ) -> dict[str, object]:
        vs = {"dynamic-sampling": {"mean": ds}}
        return {"ratio_vs_fixed": r, "ratio_vs": vs, "per_optimizer_step_vs_fixed": -0.05,
                "per_optimizer_step_vs_fixed_ci95": step_ci}  # fmt: skip

    def reg(flat: float, vigor: float, pc: float, pc_ds: float) -> dict[str, object]:
        return {"flat_share": {"flat_share": flat, "ceiling": 1 / (1 - flat)},
                "policies": {"fixed": pol(1.0), "vigor": pol(vigor, step_ci=[-0.1, -0.01]),
                             "pilot-commit": pol(pc, pc_ds)}}  # fmt: skip

    doc = {"regimes": {"hot": reg(0.2, 0.7, 0.9, 0.9), "cold": reg(0.7, 1.6, 1.3, 2.5)}}
    lines = targets(doc)
    assert "cold: vigor 1.60x fewer rollouts than fixed (target >= 1.5): met" in lines
    assert "cold: pilot-commit 1.30x fewer rollouts than fixed (target >= 1.5): missed by 0.20" in lines
    assert "cold: pilot-commit 2.50x fewer than dynamic sampling (target >= 2.0): met" in lines
    assert not any(x.startswith("hot: vigor 0.70") for x in lines)  # a ceiling below 2x: no target
    assert "vigor: ratio by flat share (hot 0.70, cold 1.60): rises" in lines
    assert any("hot: vigor is worse per optimizer step" in x for x in lines)
    assert not any("pilot-commit is worse" in x for x in lines)
