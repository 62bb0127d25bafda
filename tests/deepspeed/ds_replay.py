"""Run under torchrun by test_deepspeed.py: the same groups through ``DeepSpeedBackend`` (rank 0,
the other ranks in ``follow``) and through ``TorchBackend`` (in rank 0), side by side.

    torchrun --nproc_per_node 2 -m -- tests.deepspeed.ds_replay CONFIG GROUPS.msgpack REPORT.json

Rank 0 writes, for every optimizer step, both backends' stats, and for every published version
the largest weight difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rolloutpipe.broker.codec import iter_events
from rolloutpipe.broker.events import Group
from rolloutpipe.config import load_config
from rolloutpipe.model.weights import load_verified_state
from rolloutpipe.roles.trainer import ds_backend
from rolloutpipe.roles.trainer.backends import TorchBackend
from tests.deepspeed.ds_groups import minibatches


def main(config: str, groups_file: str, report: str) -> int:
    cfg = load_config(config, environ={})
    if ds_backend.rank() > 0:
        return ds_backend.follow(cfg)
    groups = [g for g in iter_events(Path(groups_file).read_bytes()) if isinstance(g, Group)]
    steps = sorted({g.step for g in groups})
    ds = ds_backend.DeepSpeedBackend(cfg)
    ref = TorchBackend(cfg)
    out = Path(cfg.out) / "weights"
    rows: list[dict[str, object]] = []
    diffs: list[float] = []

    def weight_diff(version: int) -> float:
        got = load_verified_state(ds.publish(out, cfg.run, version))
        want = ref.state_dict()
        assert got.keys() == want.keys()
        return max(float((got[k] - want[k]).abs().max()) for k in want)

    try:
        diffs.append(weight_diff(0))
        for step in steps:
            ds.begin_step(step)
            ref.begin_step(step)
            for mb in minibatches([g for g in groups if g.step == step]):
                for g in mb:
                    ds.accumulate(g)
                    ref.accumulate(g)
                rows.append({"ds": ds.optimizer_step(), "torch": ref.optimizer_step()})
            diffs.append(weight_diff(step + 1))
    finally:
        ds.close()
    Path(report).write_text(json.dumps({"steps": rows, "weight_diffs": diffs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
