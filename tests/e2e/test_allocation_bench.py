"""``rolloutpipe bench --suite allocation --quick`` end to end: real processes, the real tiny model.

It measures nothing (one seed, six steps); it checks that every policy runs through the bench, that
``results.json`` has the documented shape, and that its rollout counts agree with what the trainer
wrote in each run's ``metrics.jsonl``, read here independently.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutpipe.bench.allocation import run_allocation
from rolloutpipe.broker.embedded import EmbeddedRedis

# 12 runs of the real tiny model (2 regimes x 5 policies + 2 calibrations): about 3 minutes idle
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
KEYS = ("rollouts_to_target_mean", "rollouts_to_target_per_seed", "ratio_vs_fixed", "ratio_vs_fixed_per_seed",
        "optimizer_steps_to_target_per_seed", "eval_reward_at_equal_rollouts_mean",
        "eval_reward_at_equal_optimizer_steps_mean", "per_optimizer_step_vs_fixed", "final_eval_reward_mean",
        "rollout_to_train_end_s_median")  # fmt: skip


def test_allocation_bench_quick(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    text, _ = run_allocation("allocation", tmp_path, [], url=redis_server.url, progress=False, quick=True)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert list(doc["regimes"]) == ["t0.4", "t1.0"] and doc["seeds"] == [0]
    assert (tmp_path / "allocation.png").stat().st_size > 10_000
    flat = json.loads((tmp_path / "flat_share.json").read_text())
    # the policy-free statistic: a colder sampler solves more prompts always or never
    assert flat["t0.4"]["flat_share"] > flat["t1.0"]["flat_share"]
    for rname, reg in doc["regimes"].items():
        assert reg["flat_share"] == flat[rname]
        assert set(reg["policies"]) == {
            "fixed",
            "dynamic-sampling",
            "dynamic-sampling-3x",
            "vigor",
            "pilot-commit",
        }
        cal = reg["calibration"]["curve"]
        assert reg["calibration"]["seed"] == 100 and len(cal) == 4  # the base and 3 evaluations
        plateau = sum(p[1] for p in cal[-3:]) / 3
        assert abs(reg["target"] - (cal[0][1] + 0.75 * (plateau - cal[0][1]))) < 1e-9
        for name, row in reg["policies"].items():
            for key in KEYS:
                assert key in row, (rname, name, key)
            assert name in text
            rows = [
                json.loads(x)
                for x in (tmp_path / rname / name / "seed0" / "metrics.jsonl").read_text().splitlines()
            ]
            assert [r["step"] for r in rows] == list(range(6))
            released = sum(r["samples"] + r["samples_wasted"] for r in rows)
            assert row["total_rollouts_per_seed"] == [released]
            stepped = sum(len(r["minibatches"]) - len(r["flat_minibatches"]) for r in rows)
            assert row["total_optimizer_steps_per_seed"] == [stepped]
            curve = row["curves"][0]
            spent = [sum(r["samples"] + r["samples_wasted"] for r in rows[: k + 1]) for k in (1, 3, 5)]
            assert [p[0] for p in curve] == [0, *spent]
            assert curve[0][1] == reg["base_eval_reward"]  # every policy starts from the same base model
            assert all(r["eval_reward"] is not None for r in rows[1::2])
        fixed = reg["policies"]["fixed"]
        assert fixed["rollouts_per_step_mean"] == 16 * 16 and fixed["groups_skipped_per_step_mean"] == 0
        # 4 mini-batches a step; those with no gradient take no optimizer step (flat_minibatch: skip)
        for name in ("fixed", "vigor"):
            r = reg["policies"][name]
            n_flat = r["flat_minibatches_per_step_mean"]
            assert r["optimizer_steps_per_step_mean"] == pytest.approx(4 - n_flat)
            assert r["groups_trained_per_step_mean"] == 16
        # Pilot-Commit as published fills the batch: 16 committed groups, all with reward variance, so
        # 4 optimizer steps a step and never a flat mini-batch
        pc = reg["policies"]["pilot-commit"]
        assert pc["groups_trained_per_step_mean"] == 16 and pc["optimizer_steps_per_step_mean"] == 4
        assert pc["flat_minibatches_per_step_mean"] == 0
        # dynamic sampling fills the batch (verl's cap, 30 x B prompts a step, is far off here), all
        # of it groups with signal
        for name in ("dynamic-sampling", "dynamic-sampling-3x"):
            ds = reg["policies"][name]
            assert ds["flat_minibatches_per_step_mean"] == 0 and ds["groups_trained_per_step_mean"] == 16
