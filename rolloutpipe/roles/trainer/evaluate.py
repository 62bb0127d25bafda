"""Held-out reward: the score that "reaching the target" means in ``rolloutpipe bench --suite allocation``.

The trainer calls :class:`Evaluator` on the weights it has just made, before it publishes them, so
the score of version k+1 is in step k's metrics (``eval_reward``) and its cost (``eval_s``) is kept
apart from the step's own timings.  Prompts come from the dataset's ``eval`` split, which training
never draws.  Responses are sampled at the rollout temperature with seeds fixed per (prompt,
sample): every version is scored on the same random draws, so a change in score is the policy's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rolloutpipe.config import Config
from rolloutpipe.model.lm import decode_batch, prompt_measure, sampler, tokenizer_for
from rolloutpipe.tasks.datasets import task_prompts
from rolloutpipe.tasks.reward import ScoreInput, Scorer


class Evaluator:
    def __init__(self, cfg: Config) -> None:
        ec = cfg.eval
        self.every = ec.every
        prompts = task_prompts(cfg.task, ec.num_prompts, ec.seed, split="eval", measure=prompt_measure(cfg))
        self.codec = tokenizer_for(cfg.model)
        self.scorer = Scorer(cfg.task)  # as the rollout workers score: same pool, same timeout
        n = ec.samples_per_prompt
        self.items = [(p, j) for p in prompts for j in range(n)]
        self.ids = [self.codec.encode_prompt(p.text, p.messages) for p, _ in self.items]
        self.seeds = [ec.seed * 1_000_003 + i for i in range(len(self.items))]
        self.temperature = cfg.rollout.temperature
        self.max_new = cfg.rollout.max_new_tokens

    def due(self, step: int) -> bool:
        """After step k when k+1 is a multiple of ``every`` (version k+1 is what is scored)."""
        return self.every > 0 and (step + 1) % self.every == 0

    def __call__(self, model: Any) -> float:
        """Mean reward of ``model`` over the eval prompts x samples."""
        was_training = bool(getattr(model, "training", False))
        model.eval()
        try:
            pick = sampler([self.temperature] * len(self.ids), self.seeds)
            resp, _ = decode_batch(
                model, self.ids, [self.max_new] * len(self.ids), self.codec.eos_token_id, pick
            )
        finally:
            if was_training:
                model.train()
        rewards = [
            self.scorer.score_sync(
                ScoreInput(self.codec.decode(np.asarray(r)), p.answer, p.text, p.data_source, p.extra_info)
            ).reward
            for r, (p, _) in zip(resp, self.items, strict=True)
        ]
        return sum(rewards) / len(rewards)
