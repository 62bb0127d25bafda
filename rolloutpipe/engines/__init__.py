"""Generation engines behind one small interface."""

from __future__ import annotations

from rolloutpipe.config import Config
from rolloutpipe.engines.base import Engine, Generation
from rolloutpipe.plugins import import_string

__all__ = ["Engine", "Generation", "make_engine"]


def make_engine(cfg: Config) -> Engine:
    """The engine named by ``rollout.engine`` (or a dotted ``rollout.engine_plugin`` factory)."""
    if cfg.rollout.engine_plugin:
        factory = import_string(cfg.rollout.engine_plugin)
        engine: Engine = factory(cfg)
        return engine
    if cfg.rollout.engine == "emulated":
        from rolloutpipe.engines.emulated import EmulatedEngine

        return EmulatedEngine(cfg.rollout.emulated, seed=cfg.rollout.seed)
    if cfg.rollout.engine == "vllm":
        from rolloutpipe.engines.vllm_engine import VllmEngine

        return VllmEngine(cfg)
    from rolloutpipe.engines.hf import TransformersEngine

    return TransformersEngine(cfg)
