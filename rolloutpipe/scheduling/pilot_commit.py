"""Pilot-Commit: a pilot of a few rollouts per prompt, then commit the rest of its budget or skip it.

Source: *Pilot-Commit* (the abstract in the project's seeds): a pilot stage estimates each prompt's
informativeness with a fraction of the budget; the remaining rollouts go to high-leverage prompts,
and low-signal prompts are skipped.  Group updates carry signal only where rewards vary.

Streamed inside one step, on its weights:

* every group starts with a pilot of ``n_pilot`` samples and is not final;
* a pilot has signal when its pass rate (share of rewards > 0) lies strictly between
  ``min_pass_rate`` and ``max_pass_rate``; by default (0, 1), i.e. its rewards are not all equal;
* with ``commit_frac`` 1 (the default) a pilot with signal commits at once: ``n_commit`` more
  samples, final; a pilot without signal is skipped (not trained; its samples are counted as
  discarded).  Each decision uses only the group's own pilot, so nothing waits on another group;
* with ``commit_frac`` < 1 only that share of a mini-batch's groups may commit: once every pilot of
  the mini-batch is in, those with signal commit in order of pilot variance (ties in plan order),
  the rest are skipped.  The mini-batch's groups wait for each other, never for a later mini-batch.

Admission is FGD's (``fgd.py``): frontier groups first, pilots and commits alike.

Parameters (``controller.policy_args``), with the reason for each default (the abstract gives none):
``n_pilot`` (G/4, at least 2: the smallest sample that can show a variance), ``n_commit``
(G - n_pilot: a committed prompt costs what GRPO spends on every prompt), ``min_pass_rate`` 0 and
``max_pass_rate`` 1 (signal = any reward variance), ``commit_frac`` 1.
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
    Skip,
    StepInfo,
    StepView,
)
from rolloutpipe.scheduling.fgd import FrontierPolicy
from rolloutpipe.scheduling.vigor import reward_variance


class PilotCommitPolicy(FrontierPolicy):
    REORDERS = False  # decides per plan mini-batch: keeps the plan's order
    changes_groups = True  # skipped prompts leave the step
    OWN = ("n_pilot", "n_commit", "min_pass_rate", "max_pass_rate", "commit_frac")

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        super().__init__(cfg, **args)
        own = self.args
        G = cfg.group_size
        self.n_pilot = int(own.get("n_pilot", max(2, G // 4)))
        self.n_commit = int(own.get("n_commit", max(0, G - self.n_pilot)))
        self.lo = float(own.get("min_pass_rate", 0.0))
        self.hi = float(own.get("max_pass_rate", 1.0))
        self.commit_frac = float(own.get("commit_frac", 1.0))
        if not (
            self.n_pilot >= 1
            and self.n_commit >= 0
            and 0 <= self.lo < self.hi <= 1
            and 0 < self.commit_frac <= 1
        ):
            raise ConfigError(
                "pilot-commit: need n_pilot >= 1, n_commit >= 0, 0 <= min_pass_rate < max_pass_rate <= 1, "
                "0 < commit_frac <= 1"
            )

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        self.window = self.use_window(info)
        return [GroupSpec(p, self.n_pilot, final=False) for p in info.prompts]

    def signal(self, g: GroupView) -> bool:
        rate = float(np.mean(np.asarray(g.rewards) > 0)) if len(g.rewards) else 0.0
        return self.lo < rate < self.hi

    def verdict(self, g: GroupView, commit: bool) -> Decision:
        if not commit:
            return Skip(g.group_id, "pilot shows no signal")
        if self.n_commit > 0:
            return Extend(g.group_id, self.n_commit, final=True, reason="pilot shows signal: commit")
        return Finalize(g.group_id, "pilot shows signal; nothing more to commit")

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]:
        if self.commit_frac >= 1:
            return [self.verdict(group, self.signal(group))] if group.waiting else []
        members = [g for g in view.groups.values() if g.minibatch == group.minibatch]
        pilots = [g for g in members if g.status == "open"]
        if not pilots or any(not g.waiting for g in pilots):
            return []  # the mini-batch's pilots are not all in
        seats = math.floor(len(members) * self.commit_frac)
        ranked = sorted((g for g in pilots if self.signal(g)), key=lambda g: (-reward_variance(g), g.order))
        commit = {g.group_id for g in ranked[:seats]}
        return [self.verdict(g, g.group_id in commit) for g in pilots]
