"""``controller.max_rollouts``: a run ends at the first step boundary past a rollout budget.

The allocation suite caps runs by rollouts, not steps, so that policies spending differently per
step get the same budget.  Real role processes, the emulated engine and trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from rolloutpipe.broker.keys import Keys
from rolloutpipe.launch.cluster import run_cluster
from tests.support.config import EMULATED_FAST, make_config

pytestmark = pytest.mark.slow


def test_a_run_stops_at_the_first_step_past_its_rollout_budget(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    cfg = make_config(
        tmp_path, run_name, *EMULATED_FAST,
        "controller.prompts_per_step=4", "controller.group_size=4", "controller.minibatches=2",
        "controller.steps=10", "controller.max_rollouts=40",  # 16 a step: past 40 after step 2
    )  # fmt: skip
    ms = run_cluster(cfg, redis_url, Path(cfg.out), progress=False, timeout_s=120)
    assert [m.step for m in ms] == [0, 1, 2]
    assert sum(m.samples + m.samples_wasted for m in ms) == 48
    rows = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    k = Keys(run_name)
    assert {int(s): int(n) for s, n in sr.hgetall(k.step_rollouts).items()} == {0: 16, 1: 16, 2: 16}
    assert sr.exists(k.done)
