"""FGD (frontier-group dispatch): admit as capacity frees, frontier groups first.

The frontier is the groups the trainer needs next.  Groups already under way come first (finish
them), then groups in mini-batch order.  While the window is on, only groups of the next
``fgd_lookahead`` mini-batches beyond those complete may start: generating far ahead of the trainer
only enlarges every engine's decode batch and slows the groups the trainer waits for.

The window is on only while training is long next to the rollout: the previous step's training
time >= ``fgd_window_min_train_ratio`` x the rollout makespan of the last step run *without* the
window (the window itself stretches the makespan, so measuring under it would switch it off
again).  With no such step yet it is off, and FGD fills all free capacity in frontier order.
"""

from __future__ import annotations

import logging
from typing import Any

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.workers.policies.base import BasePolicy, GroupSpec, Release, StepInfo, StepView

log = logging.getLogger("rolloutpipe.controller")


class FrontierPolicy(BasePolicy):
    engine_queue = False  # engines admit only into free slots: a queue would undo the order

    OWN: tuple[str, ...] = ()  # a subclass's own policy_args, handed to it in ``self.args``

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        super().__init__(cfg)
        unknown = set(args) - {"lookahead", "slack", "window_min_train_ratio", *self.OWN}
        if unknown:
            raise ConfigError(f"{type(self).__name__}: unknown policy_args {sorted(unknown)}")
        self.args = {k: v for k, v in args.items() if k in self.OWN}
        self.lookahead = int(args.get("lookahead", cfg.fgd_lookahead))
        self.slack = int(args.get("slack", cfg.fgd_slack))
        self.min_ratio = float(args.get("window_min_train_ratio", cfg.fgd_window_min_train_ratio))
        self.window = False
        self.window_on: dict[int, bool] = {}
        self.free_makespan: float | None = None  # makespan of the last step without the window

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        self.window = self.use_window(info)
        return super().plan(info)

    def use_window(self, info: StepInfo) -> bool:
        prev = info.prev
        if self.lookahead <= 0 or prev is None:
            return False
        if not self.window_on.get(info.step - 1, False) and prev.rollout_makespan_s > 0:
            self.free_makespan = prev.rollout_makespan_s
        if self.free_makespan is None:
            return False
        ratio = prev.train_busy_s / self.free_makespan
        on = ratio >= self.min_ratio
        self.window_on = {s: v for s, v in self.window_on.items() if s >= info.step - 2}
        self.window_on[info.step] = on
        log.info("step %d: training/rollout %.2f last step -> frontier window %s",
                 info.step, ratio, "on" if on else "off")  # fmt: skip
        return on

    def admit(self, view: StepView, free: int) -> list[Release]:
        free += self.slack
        if free <= 0:
            return []
        gpm = view.groups_per_minibatch
        limit = len(view.groups)  # groups that may be under way
        if self.window:
            limit = (view.emitted // gpm + self.lookahead) * gpm
        # groups under way: started and still to reach the trainer (a skipped group never will)
        started = sum(1 for g in view.groups.values() if g.started and g.status != "skipped")
        todo = [g for g in view.groups.values() if g.unreleased]
        out: list[Release] = []
        for g in sorted(todo, key=lambda g: (not g.started, g.minibatch, g.order)):
            if not g.started and started >= limit:
                break  # the window is closed until more groups complete
            n = min(free, g.unreleased)
            out.append(Release(g.group_id, n))
            started += 0 if g.started else 1
            free -= n
            if free <= 0:
                break
        return out
