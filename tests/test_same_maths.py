"""Pipelined (CGP) training gives the same weights as synchronous training on the same mini-batches.

A real ``cgp`` run (role processes, transformers engine, torch trainer) records every group it
consumed and its mini-batch composition.  The same groups are then fed, in the same mini-batches,
to a trainer process in ``sync`` mode starting from the same initial weights.  Old logprobs are
recomputed from a frozen version-k copy (``trainer.old_logprobs=frozen``), so recomputing them
with already-updated weights for later mini-batches would break the equality; the last test shows
that such a trainer does end elsewhere, so the comparison can fail.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC, iter_events
from rolloutpipe.broker.events import Group, GroupPlan, StepPlan
from rolloutpipe.broker.streams import DATA, Keys
from rolloutpipe.config import Config
from rolloutpipe.runner import Cluster, run_cluster
from tests.conftest import make_config
from tests.helpers import load_weights, max_abs_diff, step_metrics, wait_version

STEPS = 2
OVERRIDES = (
    "controller.mode=cgp",
    f"controller.steps={STEPS}",
    "controller.prompts_per_step=8",
    "controller.group_size=8",
    "controller.minibatches=4",  # four optimizer steps per rollout step
    "trainer.old_logprobs=frozen",
    "trainer.record_groups=true",
    "trainer.lr=0.003",  # large enough that wrong old logprobs move the weights visibly
    "rollout.workers=2",
    "trainer.keep_versions=0",  # the test compares v0 with the last version
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cgp_run(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, model_cache: str
) -> tuple[Config, Path]:
    tmp = tmp_path_factory.mktemp("cgp")
    cfg = make_config(tmp, "samemaths-cgp", *OVERRIDES, f"model.cache_dir={model_cache}")
    out = Path(cfg.out)
    metrics = run_cluster(cfg, redis_url, out, progress=False, timeout_s=240)
    assert [m.step for m in metrics] == list(range(STEPS))
    return cfg, out


def _recorded(out: Path) -> dict[str, Group]:
    groups = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
    return {g.group_id: g for g in groups}


def test_cgp_equals_sync_on_same_minibatches(
    cgp_run: tuple[Config, Path], redis_url: str, tmp_path: Path
) -> None:
    cfg, out = cgp_run
    r = redis.Redis.from_url(redis_url)
    recorded = _recorded(out)
    cgp_metrics = step_metrics(r, cfg.run)
    assert all(len(m.minibatches) == 4 for m in cgp_metrics)

    sync_cfg = cfg.model_copy(deep=True)
    sync_cfg.run = "samemaths-sync"
    sync_cfg.out = str(tmp_path / "sync")
    sync_cfg.trainer.schedule, sync_cfg.controller.policy = "barrier", "fifo"  # the "sync" preset
    assert sync_cfg.mode == "sync"
    sync_out = Path(sync_cfg.out)
    sync_out.mkdir(parents=True)
    keys = Keys(sync_cfg.run)
    cluster = Cluster(sync_cfg, redis_url, sync_out)
    sync_cfg.dump_yaml(sync_out / "config.yaml")
    try:
        cluster.spawn("trainer", "trainer", ["--out", str(sync_out)])
        for step, m in enumerate(cgp_metrics):
            wait_version(r, sync_cfg.run, step, cluster)
            gids = [gid for mb in m.minibatches for gid in mb]
            assert len(gids) == 8
            plan = StepPlan(
                run=sync_cfg.run,
                step=step,
                policy_version=step,
                policy="fifo",
                groups=[
                    GroupPlan(group_id=gid, prompt_index=recorded[gid].prompt_index, n=8) for gid in gids
                ],
                minibatches=4,
                groups_per_minibatch=2,
                created_at=time.time(),
            )
            r.set(keys.plan(step), DEFAULT_CODEC.encode(plan))
            for mb in m.minibatches:
                for gid in mb:
                    g = recorded[gid].model_copy(update={"run": sync_cfg.run})
                    r.xadd(keys.groups, {DATA: DEFAULT_CODEC.encode(g)})
        wait_version(r, sync_cfg.run, STEPS, cluster)
    finally:
        cluster.stop()
    sync_metrics = step_metrics(r, sync_cfg.run)
    r.close()
    assert [m.mode for m in sync_metrics] == ["sync"] * STEPS
    assert [m.minibatches for m in sync_metrics] == [m.minibatches for m in cgp_metrics]
    assert max_abs_diff(load_weights(out, 0), load_weights(sync_out, 0)) == 0.0  # same start
    diff = max_abs_diff(load_weights(out, STEPS), load_weights(sync_out, STEPS))
    assert diff <= 1e-6, f"cgp and sync weights differ by {diff}"
    assert max_abs_diff(load_weights(out, 0), load_weights(out, STEPS)) > 1e-3  # training did move them


def test_recomputing_old_logprobs_with_updated_weights_diverges(cgp_run: tuple[Config, Path]) -> None:
    """The bug the test above guards against, reproduced in-process: it ends elsewhere."""
    import torch

    from rolloutpipe.policy import ensure_model, load_model
    from rolloutpipe.trainer.backends import TorchBackend

    cfg, out = cgp_run
    recorded = _recorded(out)
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def replay(refresh_each_minibatch: bool) -> dict[str, torch.Tensor]:
        model = load_model(ensure_model(cfg.model))
        model.load_state_dict(load_weights(out, 0))
        be = TorchBackend(cfg, model=model)
        for row in rows:
            be.begin_step(row["step"])
            for mb in row["minibatches"]:
                if refresh_each_minibatch:
                    be.begin_step(row["step"])  # "old" logprobs from the already-updated weights
                for gid in mb:
                    be.accumulate(recorded[gid])
                be.optimizer_step()
        return be.state_dict()

    final = load_weights(out, STEPS)
    assert max_abs_diff(replay(False), final) <= 1e-6
    assert max_abs_diff(replay(True), final) > 1e-6
