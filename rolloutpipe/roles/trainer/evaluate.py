"""Held-out reward: the score that "reaching the target" means in ``rolloutpipe bench --suite allocation``.

The trainer calls :class:`Evaluator` on the weights it has just made, before it publishes them, so
the score of version k+1 is in step k's metrics (``eval_reward``) and its cost (``eval_s``) is kept
apart from the step's own timings.  Prompts come from the dataset's ``eval`` split, which training
never draws.  Responses are sampled at the rollout temperature with seeds fixed per (prompt,
sample): every version is scored on the same random draws, so a change in score is the policy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rolloutpipe.config import Config
from rolloutpipe.model.lm import decode_batch, prompt_measure, sampler, tokenizer_for
from rolloutpipe.tasks.datasets import Prompt, task_prompts
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
            rewards = sample_rewards(
                model,
                self.codec,
                self.scorer,
                self.items,
                self.ids,
                self.seeds,
                self.temperature,
                self.max_new,
            )
        finally:
            if was_training:
                model.train()
        return sum(rewards) / len(rewards)


def sample_rewards(
    model: Any,
    codec: Any,
    scorer: Scorer,
    items: Sequence[tuple[Prompt, int]],
    ids: Sequence[np.ndarray],
    seeds: Sequence[int],
    temperature: float,
    max_new: int,
    batch: int = 0,
) -> list[float]:
    """One sampled response per ``(prompt, j)`` of ``items`` (its token ids in ``ids``, its seed in
    ``seeds``), scored with the task's verifier; ``batch`` > 0 decodes that many at a time (a decode
    pads its whole batch), 0 all at once.  Each row's draws depend only on its seed."""
    step = batch or len(ids)
    rewards: list[float] = []
    for lo in range(0, len(ids), max(1, step)):
        hi = min(len(ids), lo + step)
        pick = sampler([temperature] * (hi - lo), list(seeds[lo:hi]))
        resp, _ = decode_batch(model, list(ids[lo:hi]), [max_new] * (hi - lo), codec.eos_token_id, pick)
        for toks, (p, _) in zip(resp, items[lo:hi], strict=True):
            inp = ScoreInput(codec.decode(np.asarray(toks)), p.answer, p.text, p.data_source, p.extra_info)
            rewards.append(scorer.score_sync(inp).reward)
    return rewards
