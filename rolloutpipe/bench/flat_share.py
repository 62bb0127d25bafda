"""The policy-free statistic of an allocation regime: the base model's share of flat groups at G.

A group whose G rewards are all equal has zero advantages and gives GRPO no gradient; an allocation
policy (VIGOR, Pilot-Commit, dynamic sampling) can only pay where such groups are common.  So before
any policy runs, the allocation suite samples the base model G times on each of ``n`` training
prompts, at the regime's temperature, scores them with the task's verifier, and records:

* ``flat_share``: the share of groups whose rewards are all equal (``p0_share`` all 0, ``p1_share``
  all 1: never and always solved);
* ``ceiling``: 1 / (1 - flat_share), the most rollouts an oracle that skipped every flat group for
  free could save, if learning per step is set by the groups with signal;
* ``pilot_flat_share`` and ``pilot_in_window_share``: of the first G/4 samples of each group (a
  pilot), the share all equal, and the share whose pass rate lies in Pilot-Commit's default window
  [0.125, 0.75]: what VIGOR's first round and Pilot-Commit's verdicts see.

It is measured on the base model, not during training: it says whether the regime *can* show the
effect, not what a policy will do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rolloutpipe.config import Config


def flat_share(cfg: Config, n: int = 256, seed: int = 12345) -> dict[str, Any]:
    """Sample the base model of ``cfg`` G times on ``n`` training prompts at ``cfg``'s temperature."""
    from rolloutpipe.model.lm import ensure_model, load_model, prompt_measure, tokenizer_for
    from rolloutpipe.roles.trainer.evaluate import sample_rewards
    from rolloutpipe.tasks.datasets import task_prompts
    from rolloutpipe.tasks.reward import Scorer

    G = cfg.controller.group_size
    prompts = task_prompts(cfg.task, n, seed, split="train", measure=prompt_measure(cfg))
    codec = tokenizer_for(cfg.model)
    items = [(p, j) for p in prompts for j in range(G)]
    ids = [codec.encode_prompt(p.text, p.messages) for p, _ in items]
    seeds = [seed * 1_000_003 + i for i in range(len(ids))]
    model = load_model(ensure_model(cfg.model), 1)
    rewards = sample_rewards(model, codec, Scorer(cfg.task), items, ids, seeds, cfg.rollout.temperature,
                             cfg.rollout.max_new_tokens, batch=1024)  # fmt: skip
    r = np.asarray(rewards, np.float64).reshape(len(prompts), G)
    flat = r.max(1) == r.min(1)
    p0 = flat & (r.max(1) <= 0)
    share = float(flat.mean())
    k = max(1, G // 4)  # a pilot of G/4: the first k samples of each group (any k of them are alike)
    pilot = (r[:, :k] > 0).mean(1)
    return {
        "pilot_size": k,
        "pilot_flat_share": float((r[:, :k].max(1) == r[:, :k].min(1)).mean()),
        "pilot_in_window_share": float(((pilot >= 0.125) & (pilot <= 0.75)).mean()),
        "flat_share": share,
        "p0_share": float(p0.mean()),
        "p1_share": float((flat & ~p0).mean()),
        "ceiling": 1.0 / max(1e-9, 1.0 - share),
        "mean_reward": float(r.mean()),
        "prompts": len(prompts),
        "group_size": G,
        "temperature": cfg.rollout.temperature,
    }
