"""Held-out reward: the score that "reaching the target" means in ``rolloutpipe bench --suite allocation``.

The trainer calls :class:`Evaluator` on the weights it has just made, before it publishes them, so
the score of version k+1 is in step k's metrics (``eval_reward``) and its cost (``eval_s``) is kept
apart from the step's own timings.  Prompts come from the dataset's ``eval`` split, which training
never draws.  Responses are sampled at the rollout temperature with seeds fixed per (prompt,
sample): every version is scored on the same random draws, so a change in score is the policy's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutpipe.config import Config
from rolloutpipe.engines.episode import Agent, make_agent, run_episode
from rolloutpipe.model.lm import decode_batch, prompt_measure, sampler, tokenizer_for
from rolloutpipe.tasks.datasets import Prompt, task_prompts
from rolloutpipe.tasks.reward import ScoreInput, Scorer


@dataclass(frozen=True)
class EvalScore:
    """A version's held-out score: the mean reward, its 95% interval over prompts, the tool-use
    rate (None without tools)."""

    reward: float
    lo: float
    hi: float
    tool_rate: float | None = None


def score_of(
    rewards: Sequence[float], prompts: Sequence[int], calls: Sequence[int] | None = None
) -> EvalScore:
    """The mean of ``rewards`` and its interval over the prompts they belong to (``prompts[i]``)."""
    by: dict[int, list[float]] = {}
    for r, p in zip(rewards, prompts, strict=True):
        by.setdefault(p, []).append(r)
    means = [sum(v) / len(v) for v in by.values()]
    mean = sum(rewards) / len(rewards)
    n, pm = len(means), sum(means) / len(means)
    sd = math.sqrt(sum((m - pm) ** 2 for m in means) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    rate = None if calls is None else sum(1 for c in calls if c > 0) / len(calls)
    return EvalScore(mean, mean - half, mean + half, rate)


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
        self.prompt_of = [i // n for i in range(len(self.items))]
        self.cfg = cfg
        self.agent = make_agent(cfg)  # None: single-turn

    def due(self, step: int) -> bool:
        """After step k when k+1 is a multiple of ``every`` (version k+1 is what is scored)."""
        return self.every > 0 and (step + 1) % self.every == 0

    def __call__(self, model: Any) -> float:
        """Mean reward of ``model`` over the eval prompts x samples."""
        return self.score(model).reward

    def score(self, model: Any) -> EvalScore:
        """``model``'s held-out score, with its interval (and tool-use rate, with tools)."""
        was_training = bool(getattr(model, "training", False))
        model.eval()
        try:
            if self.agent is not None:
                rewards, calls = asyncio.run(self._episodes(model, self.agent))
                return score_of(rewards, self.prompt_of, calls)
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
        return score_of(rewards, self.prompt_of)

    async def _episodes(self, model: Any, agent: Agent) -> tuple[list[float], list[int]]:
        """Every eval item as an episode on a transformers engine over ``model`` (batched as a
        worker batches them); its reward and its tool calls."""
        from rolloutpipe.broker.events import RolloutRequest
        from rolloutpipe.engines.hf import TransformersEngine

        engine = TransformersEngine(self.cfg)
        engine.model = model  # the trainer's weights, as they are: nothing loaded
        reqs = [
            RolloutRequest(run=self.cfg.run, step=0, policy_version=0, request_id=f"eval:{i}",
                           group_id=f"eval:{i}", prompt_index=i, sample_index=j, prompt=p.text,
                           answer=p.answer, seed=self.seeds[i], max_new_tokens=self.max_new,
                           temperature=self.temperature, released_at=0.0, messages=list(p.messages))
            for i, (p, j) in enumerate(self.items)
        ]  # fmt: skip
        try:
            eps = await asyncio.gather(*(run_episode(engine, r, agent) for r in reqs))
        finally:
            await engine.close()
        inputs = [ScoreInput(ep.gen.text, p.answer, p.text, p.data_source, p.extra_info)
                  for ep, (p, _) in zip(eps, self.items, strict=True)]  # fmt: skip
        scores = await asyncio.gather(*(self.scorer.score(x) for x in inputs))  # a verifier pool in parallel
        return [sc.reward for sc in scores], [ep.tool_calls for ep in eps]


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
