"""A run with the GRPO loss options set: its advantages and loss terms reach the step's metrics.

The options themselves are checked against hand computations in ``tests/unit/test_grpo_options.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.config import make_config


@pytest.mark.slow
def test_a_run_uses_the_configured_advantages_and_logs_the_loss_terms(
    tmp_path: Path, redis_url: str, model_cache: str
) -> None:
    """The aggregator computes advantages with ``trainer.adv_std``/``adv_eps``; the torch trainer's
    KL, entropy, TIS and engine/trainer mismatch reach the step's metrics."""
    import json

    from rolloutpipe.broker.codec import iter_events
    from rolloutpipe.broker.events import Group
    from rolloutpipe.launch.cluster import run_cluster

    cfg = make_config(
        tmp_path, "opts-e2e", f"model.cache_dir={model_cache}", "controller.mode=cgp", "controller.steps=2",
        "controller.prompts_per_step=4", "controller.group_size=4", "controller.minibatches=2",
        "trainer.adv_std=none", "trainer.kl_coef=0.1", "trainer.entropy_coef=0.01",
        "trainer.old_logprobs=recompute", "trainer.tis_cap=2.0", "trainer.record_groups=true",
    )  # fmt: skip
    out = Path(cfg.out)
    ms = run_cluster(cfg, redis_url, out, progress=False, timeout_s=240)
    assert [m.step for m in ms] == [0, 1]
    groups = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
    assert len(groups) == 8
    varied = 0
    for g in groups:
        r = [s.reward for s in g.samples]
        hand = [x - sum(r) / len(r) for x in r]  # adv_std none, eps 0: r - mean, no std
        np.testing.assert_allclose(g.advantages, hand, atol=1e-6)
        varied += len(set(r)) > 1
    assert varied > 0, "no group had mixed rewards: the check above would not tell none from unbiased"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        train = row["train"]
        assert {"loss", "grad_norm", "clipfrac", "clipfrac_lower", "kl", "entropy"} <= train.keys()
        assert {"logprob_mismatch", "tis_weight"} <= train.keys()
        assert train["entropy"] > 0 and train["kl"] >= 0 and 0 < train["tis_weight"] <= 2.0
    assert rows[0]["train"]["kl"] < rows[1]["train"]["kl"]  # k3 is 0 at the reference, grows as it trains
