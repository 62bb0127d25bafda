"""VIGOR, Pilot-Commit and dynamic sampling on the tiny model, through real role processes.

Each policy runs with FGD's admission and the pipelined trainer (``cgp-fgd`` with its own
allocation).  The groups the trainer consumed (``groups.msgpack``) must be exactly what the
policy's rule allows, every sample from the step's weights, and the step's accounting (skipped
groups, discarded samples) must add up.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC, iter_events
from rolloutpipe.broker.events import Group, StepPlan
from rolloutpipe.broker.keys import Keys
from rolloutpipe.launch.cluster import run_cluster
from tests.support.config import make_config

pytestmark = pytest.mark.slow
STEPS = 2
B, G, MB = 8, 8, 2


def split(n: int, gpm: int = B // MB) -> list[int]:
    """Mini-batch sizes of a step that trains ``n`` groups: runs of ``gpm``, a shorter last one, and
    a lone last group joined to the one before (``trainer.lone_group: merge``, the default)."""
    sizes = [gpm] * (n // gpm) + ([n % gpm] if n % gpm else [])
    if len(sizes) > 1 and sizes[-1] == 1 and gpm > 1:
        sizes[-2:] = [gpm + 1]
    return sizes


def run(
    tmp_path: Path, run_name: str, redis_url: str, model_cache: str, policy: str, args: dict[str, object]
):
    cfg = make_config(
        tmp_path, run_name,
        f"controller.policy={policy}", f"controller.policy_args={json.dumps(args)}",
        f"controller.prompts_per_step={B}", f"controller.group_size={G}", f"controller.minibatches={MB}",
        f"controller.steps={STEPS}", "trainer.record_groups=true", f"model.cache_dir={model_cache}",
    )  # fmt: skip
    assert cfg.mode == f"pipelined/{policy}"
    ms = run_cluster(cfg, redis_url, Path(cfg.out), progress=False, timeout_s=240)
    assert [m.step for m in ms] == list(range(STEPS))
    trained = [
        g for g in iter_events((Path(cfg.out) / "groups.msgpack").read_bytes()) if isinstance(g, Group)
    ]
    assert max(Counter((g.step, g.group_id) for g in trained).values()) == 1  # exactly once
    for g in trained:  # on-policy, samples 0..n-1
        assert g.policy_version == g.step and all(s.policy_version == s.step == g.step for s in g.samples)
        assert [s.sample_index for s in g.samples] == list(range(len(g.samples)))
        assert len(g.samples) == g.allocation.counts[-1]
    for m in ms:
        assert m.fence_rejections == 0
        assert m.groups == sum(1 for g in trained if g.step == m.step)
    return ms, trained


def test_vigor_on_the_tiny_model(tmp_path: Path, run_name: str, redis_url: str, model_cache: str) -> None:
    ms, trained = run(tmp_path, run_name, redis_url, model_cache, "vigor", {"n0": 2, "round": 2})
    assert all(m.groups == B and m.groups_skipped == 0 and m.samples_wasted == 0 for m in ms)
    for step in range(STEPS):
        gs = [g for g in trained if g.step == step]
        assert all(g.allocation.initial == 2 for g in gs)
        assert sum(len(g.samples) for g in gs) <= B * G  # the budget: GRPO's B x G
        for g in gs:
            extended = len(g.allocation.counts) > 1
            if extended:  # only a group with reward variance in its earlier rounds gets more
                early = [s.reward for s in g.samples[: g.allocation.counts[-2]]]
                assert max(early) > min(early), g.group_id
    assert any(len(g.allocation.counts) > 1 for g in trained)  # some groups did get extra rounds


def test_pilot_commit_on_the_tiny_model(
    tmp_path: Path, run_name: str, redis_url: str, model_cache: str, sr: redis.Redis
) -> None:
    args = {"n_pilot": 4, "pool": 1.5, "max_rounds": 3}
    ms, trained = run(tmp_path, run_name, redis_url, model_cache, "pilot-commit", args)
    k = Keys(run_name)
    first = 0
    for m in ms:
        gs = [g for g in trained if g.step == m.step]
        for g in gs:  # committed: the pilot's pass rate in the window, and the group has pilot + commit
            assert g.allocation.counts == [4, G]
            assert 0.125 <= np.mean([s.reward > 0 for s in g.samples[:4]]) <= 0.75
        plan = DEFAULT_CODEC.decode_as(sr.get(k.plan(m.step)), StepPlan)
        assert len(plan.groups) == 12 and plan.first_prompt == first  # the stream goes on where it stopped
        candidates = m.groups + m.groups_skipped
        assert candidates % 12 == 0 and candidates <= 36
        # the batch is full, or every pool of the cap was drawn
        assert m.groups == B or (m.groups < B and candidates == 36)
        assert [len(mb) for mb in m.minibatches] == split(m.groups)  # MB of them when full
        assert m.samples == G * m.groups and m.samples_wasted <= 4 * m.groups_skipped
        assert np.isfinite(m.first_group_s) and m.rollout_to_train_end_s > 0
        first += candidates
    assert sum(m.groups_skipped for m in ms) > 0  # the untrained model's pilots are often all wrong


def test_dynamic_sampling_on_the_tiny_model(
    tmp_path: Path, run_name: str, redis_url: str, model_cache: str
) -> None:
    ms, trained = run(tmp_path, run_name, redis_url, model_cache, "dynamic-sampling", {"max_refills": 8})
    for m in ms:
        gs = [g for g in trained if g.step == m.step]
        for g in gs:  # only groups with reward variance are trained
            r = np.asarray([s.reward for s in g.samples])
            assert r.max() > r.min(), g.group_id
            assert np.abs(g.advantages).sum() > 0
        refills = sum(1 for g in gs if int(g.group_id.split(":")[1]) >= B)
        assert m.groups <= B and refills <= 8
        assert [len(mb) for mb in m.minibatches] == split(m.groups)
        assert m.samples_wasted == G * m.groups_skipped  # a flat group trains none of its G
    # the untrained model passes ~1 in 10: some groups are flat, so skips and refills both happened
    assert sum(m.groups_skipped for m in ms) > 0
    assert any(int(g.group_id.split(":")[1]) >= B for g in trained)
