"""``bench --suite multiplex --quick`` end to end on small runs: it writes the results the issues
ask for (``shared``/``static`` samples/s, per-run rollout-to-train-end; issue 30's steady ratios to
``static-migration`` and the simulated ceiling) and the timeline, and the static split never moves
a worker while the shared pool does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutpipe.bench.multiplex import run_multiplex

pytestmark = pytest.mark.slow

SMALL = (
    "controller.prompts_per_step=8",
    "controller.group_size=4",
    "controller.minibatches=2",
    "task.num_prompts=8",
    "rollout.emulated.length_median=300",
    "rollout.emulated.max_response_tokens=1500",
    "rollout.emulated.time_scale=0.1",
    "trainer.emulated.time_scale=0.5",
    "rollout.emulated.max_num_seqs=16",
)


def test_quick_multiplex_bench_writes_results_and_a_timeline(tmp_path: Path, redis_url: str) -> None:
    """Run b needs three times the steps of run a: once a is done (a done run is owed nothing) its
    workers must go to b, however the two runs' phases fall on a loaded machine.  Under load, two
    runs of equal length had kept their workers throughout (issue 31)."""
    unequal = [["controller.steps=2"], ["controller.steps=6"]]
    text, where = run_multiplex(
        tmp_path, list(SMALL), url=redis_url, progress=False, quick=True, run_overrides=unequal
    )
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["shared"]["samples_per_s"] > 0 and doc["static"]["samples_per_s"] > 0
    assert set(doc["runs"]) == {"mx2-a", "mx2-b"}
    assert all(v["static_r2t"] > 0 and v["shared_r2t"] > 0 for v in doc["runs"].values())
    (setting,) = doc["by_runs"].values()
    static, shared = setting["repeats"]["static"][0], setting["repeats"]["lookahead"][0]
    assert static["lease_changes"] == 0  # the static split never moves a worker
    assert shared["lease_changes"] >= 1  # at the latest when run a is done
    assert static["fence_rejections"] == shared["fence_rejections"] == 0
    assert 0 < static["pool_utilisation"] <= 1 and 0 < shared["pool_utilisation"] <= 1
    assert Path(setting["timeline_png"]).stat().st_size > 10_000
    # issue 30: the control, the simulated ceiling (never below the split it can keep), the share
    assert setting["ceiling_ratio"] >= 1.0 and len(setting["ceiling"]["per_seed"]) == 3
    for mode in ("static", "static-migration", "lookahead"):
        v = setting["modes"][mode]["steady_ratio_vs_static_migration"]
        assert v["mean"] > 0 and v["n"] == 1
        assert setting["repeats"][mode][0]["steady_samples_per_s"] > 0
    assert setting["modes"]["static-migration"]["steady_ratio_vs_static_migration"]["mean"] == 1.0
    assert "Simulated ceiling" in text and "Targets (issue 30)" in text and "results.json" in where
