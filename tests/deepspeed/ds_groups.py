"""Groups for the DeepSpeed tests, built with the tiny model: real prompts, random responses, and
behaviour logprobs of the version-0 model plus noise, so that ratios differ from 1 and the clip bites.

Each step has ``GROUPS`` groups in mini-batches of ``GPM``.  Group 1 of each step has a single
sample, so rank 1 of 2 has nothing to compute for it and must still take part in ZeRO's
collectives; the others have ``G`` = 5 samples, split 3 / 2 between the ranks.
"""

from __future__ import annotations

import time

import numpy as np

from rolloutpipe.broker.events import AllocationRecord, FrontierStatus, Group, Sample
from rolloutpipe.config import Config
from rolloutpipe.rl.grpo import group_advantages

GROUPS = 4  # per step
GPM = 2  # groups per mini-batch: 2 optimizer steps per step
G = 5


def make_groups(cfg: Config, step: int, rng: np.random.Generator) -> list[Group]:
    import torch

    from rolloutpipe.model.lm import ensure_model, load_model, response_logprobs
    from rolloutpipe.model.tokenizer import EOS, CharTokenizer

    model = load_model(ensure_model(cfg.model))
    codec = CharTokenizer()
    now = time.time()
    out = []
    for gi in range(GROUPS):
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        prompt = codec.encode_prompt(f"{a}+{b}=")
        n = 1 if gi == 1 else G
        responses = [
            np.append(rng.integers(3, 18, int(rng.integers(0, 4))), EOS).astype(np.int32) for _ in range(n)
        ]
        with torch.no_grad():
            logp, _ = response_logprobs(model, [prompt] * n, responses)
        rewards = rng.integers(0, 2, n).astype(np.float64)
        rewards[0], rewards[-1] = 1.0, 0.0
        adv = group_advantages(rewards) if n > 1 else np.ones(1, dtype=np.float32)
        gid = f"g{step}-{gi}"
        samples = [
            Sample(
                run=cfg.run,
                step=step,
                policy_version=step,
                sample_id=f"{gid}-{i}",
                request_id=f"{gid}-{i}",
                group_id=gid,
                prompt_index=gi,
                sample_index=i,
                worker="test",
                prompt_ids=prompt,
                response_ids=r,
                logprobs=(logp[i, : len(r)].numpy() + rng.normal(0, 0.3, len(r))).astype(np.float32),
                reward=float(rewards[i]),
                temperature=cfg.rollout.temperature,  # the logprobs above are at the config's temperature
                admitted_at=now,
                finished_at=now,
            )
            for i, r in enumerate(responses)
        ]
        frontier = FrontierStatus(
            minibatch=gi // GPM,
            position=gi,
            minibatch_size=GPM,
            needed=GPM - 1 - gi % GPM,
            total_groups=GROUPS,
        )
        out.append(
            Group(
                run=cfg.run,
                step=step,
                policy_version=step,
                group_id=gid,
                prompt_index=gi,
                samples=samples,
                advantages=adv,
                frontier=frontier,
                allocation=AllocationRecord(initial=n, counts=[n]),
                completed_at=now,
            )
        )
    return out


def minibatches(groups: list[Group]) -> list[list[Group]]:
    return [groups[i : i + GPM] for i in range(0, len(groups), GPM)]
