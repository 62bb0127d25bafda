"""Experiment logging: slime/verl metric names reach TensorBoard and wandb (fake modules here)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.errors import ConfigError
from rolloutpipe.roles.trainer.loggers import StepLogger
from tests.support.config import make_config


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(
        run="r", step=step, policy_version=step, mode="cgp-fgd", rollout_to_train_end_s=2.0,
        trainer_wait_ratio=0.25, first_group_s=0.5, reward_mean=0.75, groups=4, samples=16, tokens=64,
        fence_rejections=0, dead_letters=1, train_busy_s=1.5, rollout_makespan_s=1.8,
        last_minibatch_train_s=0.3, dispatch_latency_p50_s=0.01, dispatch_latency_p99_s=0.02,
    )  # fmt: skip


def test_tensorboard_and_wandb_get_perf_and_rollout_names(
    tmp_path: Path, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scalars: list[tuple[str, float, int]] = []
    wandb_logs: list[tuple[dict[str, float], int]] = []
    calls: list[str] = []

    class Writer:
        def __init__(self, log_dir: str) -> None:
            calls.append(f"tb:{Path(log_dir).name}")

        def add_scalar(self, k: str, v: float, step: int) -> None:
            scalars.append((k, v, step))

        def flush(self) -> None: ...

        def close(self) -> None:
            calls.append("tb:close")

    tb: Any = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = Writer
    wandb: Any = types.ModuleType("wandb")
    wandb.init = lambda project, name, config: calls.append(f"wandb:{project}:{name}")
    wandb.log = lambda d, step: wandb_logs.append((d, step))
    wandb.finish = lambda: calls.append("wandb:finish")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb)
    monkeypatch.setitem(sys.modules, "wandb", wandb)

    cfg = make_config(tmp_path, run_name, "trainer.log_to=[tensorboard, wandb]")
    lg = StepLogger(cfg, tmp_path)
    lg.log(_metrics(3))
    lg.close()
    got = {k: v for k, v, step in scalars if step == 3}
    assert got["perf/wait_time_ratio"] == 0.25 and got["rollout/raw_reward"] == 0.75
    assert got["rollout/response_length/mean"] == 4.0 and got["perf/tokens_per_s"] == 32.0
    assert wandb_logs == [(got, 3)]
    assert calls == ["tb:tensorboard", f"wandb:rolloutpipe:{run_name}", "tb:close", "wandb:finish"]


def test_missing_logging_package_is_a_clear_error(
    tmp_path: Path, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    cfg = make_config(tmp_path, run_name, "trainer.log_to=[wandb]")
    with pytest.raises(ConfigError, match="pip install wandb"):
        StepLogger(cfg, tmp_path)
