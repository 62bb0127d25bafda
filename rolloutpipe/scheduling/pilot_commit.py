"""Pilot-Commit as published: pilot a pool of candidates, commit those in a pass-rate window until
the batch is full, defer the unsolved, evict the solved.

Sources: the *Pilot-Commit* abstract (the project's seeds) and its public code (databricks/
pilot-commit: ``recipe/pc/pc_ray_trainer.py``, ``pc_trainer.yaml``, ``train_scripts/pc_*``).  A
pilot stage estimates each prompt's informativeness with a fraction of the budget; the remaining
rollouts go to prompts whose pilot shows signal, and low-signal prompts are skipped.  Point by point,
with each difference from that code:

* **a pool of candidates**: a step pilots ``pool`` x B candidate prompts (default 3: the code
  generates pilots for over 3x the train batch), drawn in order from the dataset's stream
  (``StepInfo.first_prompt``), so the next step starts after the last candidate drawn;
* **a pilot of a fraction of the group**: ``pilot_frac`` x G samples (default 0.25: 16 of 64 and 32
  of 128 in the code), at least 1; ``n_pilot`` sets the count instead;
* **the commit window**: a pilot whose pass rate (share of rewards > 0) lies in ``[min_pass_rate,
  max_pass_rate]`` (default [0.125, 0.75], the code's) commits: its remaining G - pilot samples are
  allocated at once and the group, pilot samples included, trains on the step's weights as one
  group of G;
* **deferral and eviction from per-prompt history**: a pilot below the window is *deferred*: not
  trained now, piloted again when the stream next brings it (a later epoch).  A pilot at or above
  ``evict_pass_rate`` (default 1.0: solved) is *evicted*: skipped now, and never drawn again (a
  prompt whose last record in the history has that pass rate is passed over when the stream reaches
  it, at no cost).  A pilot above the window but below eviction is deferred too;
* **refill until the batch is full**: the first B committed candidates *in plan order* train; once
  the candidates drawn can no longer fill the batch (those committed plus those undecided < B),
  another pool of ``pool`` x B candidates is drawn, up to ``max_rounds`` pools a step (default 10,
  the code's); a step that reaches the cap trains the groups it committed.  Surplus pilots beyond
  the B-th commit are skipped (their in-flight requests aborted, unreleased ones never sent).

Streaming: a candidate's verdict waits only for the verdicts of candidates before it in the plan,
never after it, and which candidates train never depends on which responses finish first.  A
committed group's remaining samples are admitted at once (FGD: groups under way first), and each
complete group goes to the trainer as CGP does.  So the step spends *more* than GRPO (pilots of the
pool plus B commits: about 1.5x at a pool of 3 with every pilot sent) for a batch full of signal,
as the code does.

Differences from the code (databricks/pilot-commit at 6def20e), by design: this project is strictly
on-policy, so a committed pilot is never kept for a later step (the code's buffer trains pilots up
to 4 steps old, ``buffer_max_off_steps``); commits are the first B in plan order, not drawn at
random or by pilot std from a buffer; a pool is drawn as soon as the batch is known to need it;
at the cap the step trains what it committed (the code stops with an error).  The window's
defaults are the training scripts' ([0.125, 0.75]; the yaml's default is [0.25, 0.75]).  Full
comparison: docs/allocation.md, "The policies, point by point".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError, PolicyError
from rolloutpipe.scheduling.base import (
    AddGroup,
    Decision,
    Extend,
    Finalize,
    GroupSpec,
    GroupView,
    Skip,
    StepInfo,
    StepView,
    in_order,
)
from rolloutpipe.scheduling.fgd import FrontierPolicy


def pass_rate(g: GroupView) -> float:
    return float(np.mean(np.asarray(g.rewards) > 0)) if len(g.rewards) else 0.0


class PilotCommitPolicy(FrontierPolicy):
    REORDERS = False  # commits in plan order: keeps the plan's order
    changes_groups = True  # deferred, evicted and surplus pilots leave the step
    stream = True  # candidates beyond the step's B come from the dataset's stream
    history = 2  # a prompt's record before this step survives this step's record (restarts)
    OWN = ("pool", "pilot_frac", "n_pilot", "min_pass_rate", "max_pass_rate", "evict_pass_rate", "max_rounds")

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        super().__init__(cfg, **args)
        own = self.args
        G = cfg.group_size
        self.pool = float(own.get("pool", 3.0))
        self.pilot_frac = float(own.get("pilot_frac", 0.25))
        self.n_pilot = int(own.get("n_pilot", max(1, min(G, round(G * self.pilot_frac)))))
        self.n_commit = G - self.n_pilot
        self.lo = float(own.get("min_pass_rate", 0.125))
        self.hi = float(own.get("max_pass_rate", 0.75))
        self.evict = float(own.get("evict_pass_rate", 1.0))
        self.max_rounds = int(own.get("max_rounds", 10))
        if not (self.pool >= 1 and 0 < self.pilot_frac <= 1 and 1 <= self.n_pilot <= G
                and 0 <= self.lo <= self.hi <= self.evict <= 1 and self.max_rounds >= 1):  # fmt: skip
            raise ConfigError(
                "pilot-commit: need pool >= 1, 0 < pilot_frac <= 1, 1 <= n_pilot <= G, "
                "0 <= min_pass_rate <= max_pass_rate <= evict_pass_rate <= 1 and max_rounds >= 1"
            )
        self.want = cfg.prompts_per_step
        self.per_round = math.ceil(self.want * self.pool)
        self._first = 0
        self._n_prompts = 1
        self._evicted: set[int] = set()
        self._positions: list[int] = []

    # ------------------------------------------------------------------ the stream of candidates

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        self.window = self.use_window(info)
        self.want = len(info.prompts)
        self.per_round = math.ceil(self.want * self.pool)
        self._first, self._n_prompts = info.first_prompt, info.n_prompts
        # evicted as of the step's start: records of earlier steps only, so a restarted controller,
        # whose history may hold this step's records too, draws the same candidates
        self._evicted = {
            p for p, recs in info.history.items()
            if (old := [r for r in recs if r.step < info.step]) and old[-1].pass_rate >= self.evict
        }  # fmt: skip
        self._positions = []
        return [GroupSpec(self.prompt_at(j), self.n_pilot, final=False) for j in range(self.per_round)]

    def position(self, j: int) -> int:
        """The stream position of the step's ``j``-th candidate: evicted prompts are passed over."""
        pos = self._positions[-1] + 1 if self._positions else self._first
        while len(self._positions) <= j:
            for _ in range(self._n_prompts):
                if pos % self._n_prompts not in self._evicted:
                    break
                pos += 1
            else:
                raise PolicyError("pilot-commit: every prompt of the dataset is evicted (solved)")
            self._positions.append(pos)
            pos += 1
        return self._positions[j]

    def prompt_at(self, j: int) -> int:
        return self.position(j) % self._n_prompts

    def next_prompt(self, view: StepView) -> int:
        return self.position(len(view.groups))

    # ------------------------------------------------------------------ verdicts

    def verdict(self, g: GroupView) -> str:
        rate = pass_rate(g)
        if rate >= self.evict:
            return "evict"
        return "commit" if self.lo <= rate <= self.hi else "defer"

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]:
        out: list[Decision] = []
        kept = undecided = 0  # earlier candidates committed, and earlier ones whose pilot is not in
        for g in in_order(view):
            if g.status == "skipped":
                continue
            if g.status != "open":
                kept += 1
            elif kept >= self.want:  # in flight or not sent yet: aborted, or never sent
                out.append(Skip(g.group_id, f"surplus: {self.want} earlier candidates committed"))
            elif g.completed < g.target:
                undecided += 1
            elif (v := self.verdict(g)) != "commit":
                why = "solved: evicted" if v == "evict" else "deferred to a later epoch"
                out.append(Skip(g.group_id, f"pilot pass rate {pass_rate(g):.2f}: {why}"))
            elif kept + undecided < self.want:
                out.append(self.commit(g))
                kept += 1
            else:
                undecided += 1  # commits only if an earlier undecided candidate does not
        rounds = math.ceil(len(view.groups) / self.per_round)
        if kept + undecided < self.want and rounds < self.max_rounds:
            out += [AddGroup(self.n_pilot, final=False, prompt_index=self.prompt_at(len(view.groups) + i),
                             reason=f"pool {rounds + 1}: {kept} of {self.want} committed")
                    for i in range(self.per_round)]  # fmt: skip
        return out

    def commit(self, g: GroupView) -> Decision:
        why = f"pilot pass rate {pass_rate(g):.2f} in [{self.lo}, {self.hi}]: commit"
        if self.n_commit > 0:
            return Extend(g.group_id, self.n_commit, final=True, reason=why)
        return Finalize(g.group_id, why)
