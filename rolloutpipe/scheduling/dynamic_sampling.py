"""Dynamic sampling (DAPO), streamed: drop groups whose rewards are all equal, refill with new prompts.

Source: Yu et al. 2025, *DAPO: An Open-Source LLM Reinforcement Learning System at Scale*
(arXiv:2503.14476), section 3.3: a group whose G rewards are all equal (accuracy 0 or 1) has zero
advantages and gives no gradient, so it is filtered out and sampling continues until the batch is
full of groups with signal.  verl's DAPO recipe over-samples with ``gen_batch_size = 3 x
train_batch_size`` and caps the extra generation rounds with ``max_num_gen_batches``.

Here, inside one step and on its weights:

* every group is planned with G samples and is not final: its verdict needs all G rewards;
* a group whose rewards are all equal is skipped (not trained; its samples are counted as
  discarded) and, while the refill limit allows, a new group of G takes its place;
* ``oversample > 1`` plans ``ceil(B x oversample)`` groups up front (no refill latency); the step
  then trains the first B groups *in plan order* that have signal.  A group waits only for the
  verdicts of groups before it, never after it, so no frontier group waits on a later one, and
  which groups are kept never depends on which responses finish first.  With ``oversample = 1``
  (the default) every group with signal is final as soon as its own G samples are in.

Parameters (``controller.policy_args``):

* ``oversample`` (default 1.0): groups planned per prompt of the step.  verl's DAPO scripts
  generate 3 x the train batch a round (``gen_prompt_bsz = train_prompt_bsz * 3``); ``oversample:
  3`` is that round, with two differences: the groups beyond the first B with signal are aborted
  once those are known (verl generates them all), and a short round is topped up a group at a time
  (verl generates another round of 3 x B).
* ``max_refills`` (default ``30 x prompts_per_step`` less the planned groups, 29 x B at
  ``oversample`` 1): groups added per step at most, after which
  the step trains what it has (fewer groups).  The default is verl's recipe's cap: up to
  ``max_num_gen_batches`` = 10 generation batches of 3 x the train batch, 30 x B prompts a step
  (its scripts), where verl raises an error instead of training a short batch; 0 turns refills off.
  (It was 2 x B, one generation batch, until 2026-12-07: the batch then often did not fill.)

Refills and over-sampled groups are the dataset stream's next prompts (``StepInfo.first_prompt``),
as verl's recipe draws further generation batches from its data loader: the next step starts after
the last one drawn, so no prompt is drawn twice an epoch.

Admission is FGD's (``fgd.py``): frontier groups first, refills after the plan's groups.
"""

from __future__ import annotations

import math
from typing import Any

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.scheduling.base import (
    AddGroup,
    Decision,
    Finalize,
    GroupSpec,
    GroupView,
    Skip,
    StepInfo,
    StepView,
    in_order,
)
from rolloutpipe.scheduling.fgd import FrontierPolicy

# verl's DAPO recipe: at most max_num_gen_batches = 10 generation batches of 3 x the train batch
MAX_PROMPTS_PER_STEP = 10 * 3


def has_signal(g: GroupView) -> bool:
    """Rewards of the group's complete samples are not all equal (so its advantages are not all 0)."""
    return len(g.rewards) > 1 and float(g.rewards.max() - g.rewards.min()) > 0.0


class DynamicSamplingPolicy(FrontierPolicy):
    REORDERS = False  # decides per plan mini-batch: keeps the plan's order
    changes_groups = True
    stream = True  # refills are the dataset's next prompts; the next step starts after them
    OWN = ("oversample", "max_refills")

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        super().__init__(cfg, **args)
        own = self.args
        self.oversample = float(own.get("oversample", 1.0))
        planned = math.ceil(cfg.prompts_per_step * self.oversample)
        self.max_refills = int(own.get("max_refills", MAX_PROMPTS_PER_STEP * cfg.prompts_per_step - planned))
        if self.oversample < 1.0 or self.max_refills < 0:
            raise ConfigError("dynamic-sampling: oversample must be >= 1 and max_refills >= 0")
        self.want = cfg.prompts_per_step

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        self.window = self.use_window(info)
        self.want = len(info.prompts)
        n = math.ceil(len(info.prompts) * self.oversample)
        prompts = [(info.prompts[0] + i) % info.n_prompts for i in range(n)]  # the step's, then the next
        return [GroupSpec(p, info.group_size, final=False) for p in prompts]

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]:
        out: list[Decision] = []
        groups = in_order(view)
        flat = {
            g.group_id for g in groups if g.status == "open" and g.completed >= g.target and not has_signal(g)
        }
        alive = sum(1 for g in groups if g.status != "skipped" and g.group_id not in flat)
        refills = sum(1 for g in groups if g.added)
        for g in groups:
            if g.group_id not in flat:
                continue
            out.append(Skip(g.group_id, "no reward variance (DAPO dynamic sampling)"))
            if alive < self.want and refills < self.max_refills:
                out.append(AddGroup(g.initial, final=False, reason=f"refill for {g.group_id}"))
                alive += 1
                refills += 1
        kept = undecided = 0  # earlier groups kept, and earlier groups whose verdict is not in yet
        for g in groups:
            if g.status == "skipped" or g.group_id in flat:
                continue
            if g.status != "open":
                kept += 1
            elif g.completed < g.target:
                undecided += 1
            elif kept >= self.want:
                out.append(Skip(g.group_id, f"surplus: {self.want} earlier groups have signal"))
            elif kept + undecided < self.want:
                out.append(Finalize(g.group_id, "reward variance > 0"))
                kept += 1
            else:
                undecided += 1  # kept only if an earlier undecided group turns out flat
        return out
