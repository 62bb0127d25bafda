"""VIGOR: a few rollouts for every prompt, then extra rollouts to the highest-variance groups.

Source: *VarIance Guided Online Rollout allocation* (VIGOR; the abstract in the project's seeds):
begin with a small number of rollouts for every prompt, then iteratively give additional rollouts
to the groups with the highest reward variance until a fixed total budget is spent.  Under RLVR the
group reward variance controls the gradient magnitude, so extra samples go where they move the
policy most.

Streamed inside one step, on its weights, mini-batch by mini-batch:

* every group starts with ``n0`` samples and is not final;
* the budget is ``budget`` samples per prompt on average (default G, GRPO's cost), counted per
  mini-batch of the plan, so no group waits for groups of a later mini-batch (the frontier first);
* once every group of a mini-batch has its current round complete, the top ``top_frac`` of its
  groups by reward variance (those with variance > 0, ties in plan order) get ``round`` more
  samples each, while the mini-batch's budget allows; the others wait for the next round;
* when no group has variance left, or the budget cannot pay for another round, the mini-batch's
  counts are final.

Rounds are decided on complete rounds only, so response length never decides who gets more.
Admission is FGD's (``fgd.py``): frontier groups first.

Parameters (``controller.policy_args``), with the reason for each default (the abstract gives none):
``n0`` (G/4, at least 2: the smallest group with a variance, and the 4x spread between the smallest
and the average group that makes an allocation worth it), ``budget`` (G: the same rollouts as
GRPO), ``round`` (n0: each round doubles a chosen pilot), ``top_frac`` (0.5: half the groups with
signal per round, so several rounds refine the estimate); FGD's ``lookahead``, ``slack`` and
``window``, ``length_aware`` and ``kv_guard`` as in ``fgd.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.scheduling.base import (
    Decision,
    Extend,
    Finalize,
    GroupSpec,
    GroupView,
    StepInfo,
    StepView,
)
from rolloutpipe.scheduling.fgd import FrontierPolicy


def reward_variance(g: GroupView) -> float:
    """Unbiased variance of the group's complete rewards (0 with fewer than two)."""
    return float(np.var(g.rewards, ddof=1)) if len(g.rewards) > 1 else 0.0


class VigorPolicy(FrontierPolicy):
    REORDERS = False  # decides per plan mini-batch: keeps the plan's order
    OWN = ("n0", "budget", "round", "top_frac")

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        super().__init__(cfg, **args)
        own = self.args
        G = cfg.group_size
        self.n0 = int(own.get("n0", max(2, G // 4)))
        self.budget = float(own.get("budget", G))
        self.round = int(own.get("round", self.n0))
        self.top_frac = float(own.get("top_frac", 0.5))
        if not (1 <= self.n0 <= self.budget and self.round >= 1 and 0 < self.top_frac <= 1):
            raise ConfigError("vigor: need 1 <= n0 <= budget, round >= 1 and 0 < top_frac <= 1")

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        self.window = self.use_window(info)
        return [GroupSpec(p, self.n0, final=False) for p in info.prompts]

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]:
        members = [g for g in view.groups.values() if g.minibatch == group.minibatch]
        open_ = [g for g in members if g.status == "open"]
        if not open_ or any(g.completed < g.target for g in open_):
            return []  # the mini-batch's round is not complete yet
        left = math.floor(len(members) * self.budget) - sum(g.target for g in members)
        ranked = sorted(
            (g for g in open_ if reward_variance(g) > 0), key=lambda g: (-reward_variance(g), g.order)
        )
        k = math.ceil(len(ranked) * self.top_frac)
        chosen = ranked[: min(k, max(0, left) // self.round)]
        if chosen:
            return [Extend(g.group_id, self.round, final=False, reason=f"variance {reward_variance(g):.3f}")
                    for g in chosen]  # fmt: skip
        why = "budget spent" if ranked else "no reward variance left"
        return [Finalize(g.group_id, why) for g in open_]
