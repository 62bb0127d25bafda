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

pytestmark = pytest.mark.slow
KEYS = ("rollouts_to_target_mean", "rollouts_to_target_per_seed", "wall_s_to_target_mean",
        "final_eval_reward_mean", "eval_reward_at_budget_mean", "rollout_to_train_end_s_median")  # fmt: skip


def test_allocation_bench_quick(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    text, _ = run_allocation("allocation", tmp_path, [], url=redis_server.url, progress=False, quick=True)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(doc["policies"]) == {"fixed", "dynamic-sampling", "vigor", "pilot-commit"}
    assert (tmp_path / "allocation.png").stat().st_size > 10_000
    assert doc["seeds"] == [0] and doc["steps"] == 6
    for name, row in doc["policies"].items():
        for key in KEYS:
            assert key in row, (name, key)
        assert name in text
        rows = [json.loads(x) for x in (tmp_path / name / "seed0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(6))
        released = sum(r["samples"] + r["samples_wasted"] for r in rows)
        assert row["total_rollouts_per_seed"] == [released]
        curve = row["curves"][0]
        assert [p[0] for p in curve] == [0] + [sum(r["samples"] + r["samples_wasted"] for r in rows[: k + 1])
                                               for k in (1, 3, 5)]  # fmt: skip
        assert curve[0][1] == doc["base_eval_reward"]["0"]  # every policy starts from the same base model
        assert all(r["eval_reward"] is not None for r in rows[1::2])
    fixed = doc["policies"]["fixed"]
    assert fixed["rollouts_per_step_mean"] == 16 * 16 and fixed["groups_skipped_per_step_mean"] == 0
    pc = doc["policies"]["pilot-commit"]
    assert pc["rollouts_per_step_mean"] <= 16 * 16  # a skipped prompt costs its pilot only
