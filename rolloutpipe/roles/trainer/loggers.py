"""Optional experiment logging (``trainer.log_to: [tensorboard, wandb]``) under the names slime
and verl users already chart: ``perf/*`` for timings, ``rollout/*`` for what was generated.

Neither package is a dependency; asking for one that is not installed is a ConfigError that says
what to install.  Only the trainer logs (rank 0 with DeepSpeed): it alone sees every step.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.config import Config
from rolloutpipe.errors import ConfigError


def step_scalars(m: StepMetrics) -> dict[str, float]:
    """One step's scalars, named as slime (``perf/wait_time_ratio``, ``rollout/raw_reward``) and
    verl (``response_length/mean``) name theirs."""
    window = max(m.rollout_to_train_end_s, 1e-9)
    held_out = {} if m.eval_reward is None else {"eval/reward": m.eval_reward}
    return held_out | {
        "rollout/raw_reward": m.reward_mean,
        "rollout/response_length/mean": m.tokens / max(m.samples, 1),
        "rollout/groups": float(m.groups),
        "rollout/fence_rejections": float(m.fence_rejections),
        "rollout/dead_letters": float(m.dead_letters),
        "rollout/groups_skipped": float(m.groups_skipped),
        "rollout/samples_wasted": float(m.samples_wasted),
        "perf/wait_time_ratio": m.trainer_wait_ratio,
        "perf/step_time": m.rollout_to_train_end_s,
        "perf/rollout_time": m.rollout_makespan_s,
        "perf/train_time": m.train_busy_s,
        "perf/first_group_time": m.first_group_s,
        "perf/group_dispatch_latency_p50": m.dispatch_latency_p50_s,
        "perf/tokens_per_s": m.tokens / window,
        **{f"actor/{k}": v for k, v in m.train.items()},  # verl's actor/* (pg_clipfrac, kl_loss, ...)
    }


def _import(name: str, extra: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        msg = f"trainer.log_to has {extra!r} but {name} is not installed: pip install {extra}"
        raise ConfigError(msg) from e


class StepLogger:
    """Sends each step's scalars to every backend in ``trainer.log_to``."""

    def __init__(self, cfg: Config, out: Path) -> None:
        self.sinks: list[Any] = []
        self.wandb: Any = None
        for kind in cfg.trainer.log_to:
            if kind == "tensorboard":
                tb = _import("torch.utils.tensorboard", "tensorboard")
                self.sinks.append(tb.SummaryWriter(log_dir=str(out / "tensorboard")))
            else:
                self.wandb = _import("wandb", "wandb")
                self.wandb.init(
                    project=cfg.trainer.wandb_project, name=cfg.run, config=cfg.model_dump(mode="json")
                )

    def log(self, m: StepMetrics) -> None:
        scalars = step_scalars(m)
        for w in self.sinks:
            for k, v in scalars.items():
                w.add_scalar(k, v, m.step)
            w.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=m.step)

    def close(self) -> None:
        for w in self.sinks:
            w.close()
        if self.wandb is not None:
            self.wandb.finish()
