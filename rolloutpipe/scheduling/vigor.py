"""VIGOR: a few rollouts for every prompt of the step, then extra rollouts to the step's
highest-variance groups until the step's budget is spent.

Source: *VarIance Guided Online Rollout allocation* (VIGOR; the abstract in the project's seeds):
begin with a small number of rollouts for all examples in a batch, then iteratively allocate
additional rollouts to those with the highest group reward variance until a fixed total rollout
budget is reached.  Under RLVR the group reward variance controls the gradient magnitude, so extra
samples go where they move the policy most.  The paper's code is not available here; this file
follows the abstract, point by point:

* **n0 for every prompt**: every group of the step starts with ``n0`` samples and is not final;
* **the whole step's budget**: ``budget`` samples per prompt on average (default G), i.e. the step
  spends B x budget, what ``fixed`` spends, pooled over the *whole step* (not per mini-batch);
* **rounds over the whole step**: once every open group's current round is complete, the top
  ``top_frac`` of the open groups with variance > 0 (highest first, ties in plan order) get
  ``round`` more samples each, while the budget allows and no group passes ``cap``;
* **final groups go at once**: a group is final as soon as its count cannot change: its complete
  rewards have no variance (it is never ranked: a zero-variance group is never the highest), it
  reached ``cap``, or the budget cannot pay for another round.  So it goes to the trainer without
  waiting for other groups' rounds; only groups still in the running wait for the round.
  A step's flat groups are therefore the first to reach the trainer, and fill whole mini-batches
  whose gradient is zero: under ``trainer.flat_minibatch: step`` AdamW still steps on them, by
  momentum alone, so run VIGOR with ``skip`` (``configs/allocation.yaml`` does; docs/allocation.md,
  "Why VIGOR fell").

Rounds are decided on complete rounds only, so response length never decides who gets more.  The
budget left when no group has variance is not spent (the abstract spends it on the highest
variance, and there is none).  Admission is FGD's (``fgd.py``): frontier groups first.

With ``trainer.loss_agg: token-mean`` a group with more samples also weighs more in the loss;
``group-mean-token-mean`` weighs each group as one prompt, so extra samples reduce its noise
instead (docs/grpo.md, "Groups of unequal size").  The allocation suite says which it runs.

Parameters (``controller.policy_args``), with the reason for each default (the abstract gives none):
``n0`` (G/4, at least 2: the smallest group with a variance, and the 4x spread between the smallest
and the average group that makes an allocation worth it), ``budget`` (G: the same rollouts as
GRPO), ``round`` (n0: each round doubles a chosen pilot), ``top_frac`` (0.5: half the groups with
signal per round, so several rounds refine the estimate), ``cap`` (4 x G: one prompt may take at
most a quarter of a 16-prompt step's budget, so no round feeds one prompt alone); FGD's ``slack``
as in ``fgd.py``.  FGD's window is always off: a round waits for every group of the step, so a
window that held later groups back would leave the frontier's groups waiting for groups it never
starts.
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
    REORDERS = False  # rounds rank in plan order on ties: keeps the plan's order
    OWN = ("n0", "budget", "round", "top_frac", "cap")

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        super().__init__(cfg, **args)
        own = self.args
        G = cfg.group_size
        self.n0 = int(own.get("n0", max(2, G // 4)))
        self.budget = float(own.get("budget", G))
        self.round = int(own.get("round", self.n0))
        self.top_frac = float(own.get("top_frac", 0.5))
        self.cap = int(own.get("cap", 4 * G))
        if not (1 <= self.n0 <= self.budget and self.round >= 1 and 0 < self.top_frac <= 1
                and self.cap >= self.n0):  # fmt: skip
            raise ConfigError("vigor: need 1 <= n0 <= budget, round >= 1, 0 < top_frac <= 1 and cap >= n0")
        if self.window_mode == "on":
            raise ConfigError(
                "vigor: a round waits for every group of the step, so FGD's window cannot be on"
            )

    def use_window(self, info: StepInfo) -> bool:
        # A round is the whole step's: it waits for every group's round to complete, so holding later
        # groups back (the window) would leave the frontier's groups waiting for groups never started.
        return False

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        self.window = self.use_window(info)
        return [GroupSpec(p, self.n0, final=False) for p in info.prompts]

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]:
        out: list[Decision] = []
        if group.waiting and (reward_variance(group) == 0 or group.target + self.round > self.cap):
            why = "no reward variance" if reward_variance(group) == 0 else f"at the cap ({self.cap})"
            out.append(Finalize(group.group_id, why))  # it can never get more: to the trainer now
        groups = list(view.groups.values())
        open_ = [g for g in groups if g.status == "open" and not (out and g is group)]
        if not open_ or any(not g.waiting for g in open_):
            return out  # the step's round is not complete yet
        left = math.floor(len(groups) * self.budget) - sum(g.target for g in groups)
        ranked = sorted(
            (g for g in open_ if reward_variance(g) > 0 and g.target + self.round <= self.cap),
            key=lambda g: (-reward_variance(g), g.order),
        )
        k = math.ceil(len(ranked) * self.top_frac)
        chosen = ranked[: min(k, max(0, left) // self.round)]
        if chosen:
            return out + [Extend(g.group_id, self.round, final=False,
                                 reason=f"variance {reward_variance(g):.3f}") for g in chosen]  # fmt: skip
        why = "budget spent" if ranked else "no reward variance left"
        return out + [Finalize(g.group_id, why) for g in open_]
