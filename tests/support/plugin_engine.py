"""``rollout.engine_plugin`` factories for tests: the shipped engines under a plug-in's name, so that
a test can reach what only a plug-in engine sees (its prompts are not checked against the model's
tokenizer when they load, ``model.lm.prompt_measure``)."""

from __future__ import annotations

from rolloutpipe.config import Config
from rolloutpipe.engines.hf import TransformersEngine


def transformers(cfg: Config) -> TransformersEngine:
    return TransformersEngine(cfg)
