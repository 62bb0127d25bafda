"""FGD (frontier-group dispatch): admit as capacity frees, frontier groups first.

The frontier is the groups the trainer needs next.  Groups already under way come first (finish
them), then groups that have not started, in an order that this file decides with two mechanisms,
each a switch of its own and each decided from live signals, not from constants fitted to a
benchmark:

**Length-aware order** (``fgd_length_aware``).  A group completes with its slowest sample, and in
reasoning RL a prompt's response lengths recur from one epoch to the next.  With a history record
for a prompt (its last group's mean response length and truncated share, from the feedback path),
a group's predicted length is that mean (a truncated sample counts at the cap), with the truncated
share to break ties.  Groups not started go shortest first, so that groups complete early and
steadily for the trainer.

``fgd_critical: true`` adds a rule in front, off by default because it measured behind plain
shortest first (docs/benchmark.md, "FGD's critical rule, on and off"): *critical* groups start
first, longest first: a group whose predicted length is at least the work still to do per slot
(the predicted tokens of every unreleased request, plus half those of every request in flight,
divided by the engines' slots) would, started any later, run past the end of the rollout, so it is
started now (longest-processing-time first, the makespan rule).  The paper bench's mode
``fgd-critical`` measures it against the default.

Groups without history (the first epoch) keep the plan's order, after those with history.  While
the window is on, nothing is critical: the pool is held back on purpose and the window is filled
shortest first.

*Where the KV cache would overflow, the plan's order instead.*  Shortest first leaves the longest
requests for last, and they then run together: the engines hold at once the ``capacity`` longest
requests of the step.  Where the engines report a KV cache (``StepView.kv_tokens``) smaller than
those requests' predicted responses, that tail cannot fit: a KV-limited engine preempts and
recomputes it over and over, and the step ends later than in the plan's order, which mixes lengths
(measured on the KV-limited emulated engine, docs/benchmark.md).  So for such a step the length
order is off and the plan's order stands (the frontier still comes first, by priority); it is
decided per step from the history and the engines' reported cache, with no constant.  An engine
that reports no cache (0: unlimited or unknown) leaves the length order on.  ``fgd_kv_guard: false``
turns the guard off (the ablation ``fgd-no-kvguard`` of the paper bench).

**The window** (``fgd_window``).  While on, only groups of the next ``lookahead`` mini-batches
beyond those complete may start: fewer sequences per engine make each decode step shorter, so the
frontier completes sooner, at the price of engine throughput.  ``auto`` decides per step from the
last step run *without* the window (the window stretches the makespan it would be judged by):
CGP ends at about ``max(makespan, first group + training)``, so shrinking the time to the first
groups pays only when the step is training-bound: training T > makespan M - first group F.  The
lookahead is ``1 + ceil(M / T)``: the trainer takes T/K per mini-batch and the pool, at full
throughput, makes one every M/K, so ceil(M/T) mini-batches must be under way beyond the one the
trainer waits for.  ``fgd_lookahead`` fixes it instead.

Allocation policies built on this class (VIGOR, Pilot-Commit, dynamic sampling) decide per plan
mini-batch, so they keep the plan's order: for them ``length_aware`` is off and may not be set.

Every started group's requests carry its frontier rank (started order // groups per mini-batch) as
``priority``: an engine that queues or preempts serves lower ranks first.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.scheduling.base import (
    BasePolicy,
    GroupSpec,
    GroupView,
    PromptRecord,
    Release,
    StepInfo,
    StepView,
)

log = logging.getLogger("rolloutpipe.controller")


def predicted_length(recs: Any) -> tuple[float, float] | None:
    """A prompt's predicted group length from its history, as a sort key: (mean response length,
    truncated share) of its last group; None without history.  A truncated sample counts at the
    cap in the mean; the truncated share breaks ties (such a group's slowest sample hits the cap)."""
    if not recs:
        return None
    last: PromptRecord = recs[-1]
    return (last.mean_length, last.truncated_frac)


class FrontierPolicy(BasePolicy):
    engine_queue = False  # engines admit only into free slots: a queue would undo the order
    history = 1  # the last group of each prompt: its lengths predict the next one's

    OWN: tuple[str, ...] = ()  # a subclass's own policy_args, handed to it in ``self.args``
    # May the order cross the plan's mini-batches?  Not for a policy that decides per plan
    # mini-batch (it would wait on groups a window never starts).
    REORDERS = True
    ARGS = ("lookahead", "slack", "window", "length_aware", "kv_guard", "critical")

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        super().__init__(cfg)
        unknown = set(args) - {*self.ARGS, *self.OWN}
        if unknown:
            raise ConfigError(f"{type(self).__name__}: unknown policy_args {sorted(unknown)}")
        self.args = {k: v for k, v in args.items() if k in self.OWN}
        fixed = args.get("lookahead", cfg.fgd_lookahead)
        self.fixed_lookahead = None if fixed is None else int(fixed)
        self.slack = int(args.get("slack", cfg.fgd_slack))
        mode = args.get("window", cfg.fgd_window)
        self.window_mode = {False: "off", True: "on"}.get(mode, mode) if isinstance(mode, bool) else str(mode)
        if self.window_mode not in ("auto", "on", "off"):
            raise ConfigError(f"fgd window must be auto, on or off, not {self.window_mode!r}")
        if "length_aware" in args and args["length_aware"] and not self.REORDERS:
            raise ConfigError(
                f"{type(self).__name__} decides per plan mini-batch: length_aware must stay off"
            )
        self.length_aware = bool(args.get("length_aware", cfg.fgd_length_aware)) and self.REORDERS
        self.kv_guard = bool(args.get("kv_guard", cfg.fgd_kv_guard))
        self.critical = bool(args.get("critical", cfg.fgd_critical))
        self.window = False
        self.lookahead = self.fixed_lookahead or 0
        self.window_on: dict[int, bool] = {}
        self.free: tuple[float, float, float] | None = None  # (T, M, F) of the last window-free step
        self._ranked_for: tuple[int, int, int] = (-1, -1, -1)
        self._ranked: list[str] = []
        self._pred: dict[str, tuple[float, float]] = {}
        self._kv_bound: dict[int, bool] = {}  # step -> the length order's tail overflows the cache

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        self.window = self.use_window(info)
        return super().plan(info)

    def use_window(self, info: StepInfo) -> bool:
        prev = info.prev
        if self.window_mode == "off" or self.fixed_lookahead == 0:
            return False
        if prev is not None and not self.window_on.get(info.step - 1, False) and prev.rollout_makespan_s > 0:
            self.free = (prev.train_busy_s, prev.rollout_makespan_s, prev.first_group_s)
        if self.window_mode == "on":
            on = True
            self.lookahead = self.fixed_lookahead or 1
        elif self.free is None or prev is None:
            return False
        else:
            _, makespan, first = self.free
            train = prev.train_busy_s  # the trainer's work does not depend on the window
            on = train > makespan - first
            self.lookahead = self.fixed_lookahead or 1 + math.ceil(makespan / max(train, 1e-9))
            log.info("step %d: training %.3g s vs makespan %.3g s - first group %.3g s -> window %s",
                     info.step, train, makespan, first,
                     f"on, {self.lookahead} mini-batches" if on else "off")  # fmt: skip
        self.window_on = {s: v for s, v in self.window_on.items() if s >= info.step - 2}
        self.window_on[info.step] = on
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
        rank = sum(1 for g in view.groups.values() if g.started)
        out: list[Release] = []
        for g in self.order(view):
            if not g.started and started >= limit:
                break  # the window is closed until more groups complete
            n = min(free, g.unreleased)
            if not g.started:
                g.priority = rank // gpm
                rank += 1
                started += 1
            out.append(Release(g.group_id, n))
            free -= n
            if free <= 0:
                break
        return out

    def ranked(self, view: StepView) -> tuple[list[str], dict[str, tuple[float, float]]]:
        """The step's groups with history, shortest predicted first, and their predictions.

        Computed once a step (and again when the policy adds a group): the history of this step's
        prompts comes from earlier steps, so it does not change while the step runs, and ``admit``
        is called whenever a slot frees."""
        if self._ranked_for != (id(view), view.step, len(view.groups)):
            pred = {
                g.group_id: predicted_length(view.history.get(g.prompt_index)) for g in view.groups.values()
            }
            self._pred = {gid: p for gid, p in pred.items() if p is not None}
            order = {g.group_id: g.order for g in view.groups.values()}
            self._ranked = sorted(self._pred, key=lambda gid: (self._pred[gid], order[gid]))
            self._ranked_for = (id(view), view.step, len(view.groups))
        return self._ranked, self._pred

    def tail_overflows(self, view: StepView, pred: dict[str, tuple[float, float]]) -> bool:
        """Would the step's ``capacity`` longest predicted requests, run together at the end of a
        shortest-first order, overflow the engines' KV cache?  Decided once a step, with the first
        cache the engines report (the prompts' tokens are left out: the test errs toward the length
        order)."""
        if view.step not in self._kv_bound:
            if not view.kv_tokens or not pred:
                return False  # no cache reported yet, or nothing to order by: decide later
            known = [g for g in view.groups.values() if g.group_id in pred]
            per_request = sorted((pred[g.group_id][0] for g in known for _ in range(g.target)), reverse=True)
            tail = sum(per_request[: max(1, view.capacity)])
            bound = tail > view.kv_tokens
            self._kv_bound = {k: v for k, v in self._kv_bound.items() if k >= view.step - 2}
            self._kv_bound[view.step] = bound
            if bound:
                log.info(
                    "step %d: the %d longest predicted requests hold %.0f tokens > the cache %d: plan order",
                    view.step, view.capacity, tail, view.kv_tokens,
                )  # fmt: skip
        return self._kv_bound[view.step]

    def order(self, view: StepView) -> list[GroupView]:
        """Groups with requests to release: those under way first, then those not started."""
        todo = [g for g in view.groups.values() if g.unreleased]
        under_way = sorted((g for g in todo if g.started), key=lambda g: (g.minibatch, g.order))
        fresh = sorted((g for g in todo if not g.started), key=lambda g: (g.minibatch, g.order))
        if not self.length_aware:
            return under_way + fresh
        ranked, pred = self.ranked(view)
        if self.kv_guard and self.tail_overflows(view, pred):
            return under_way + fresh
        known = [
            view.groups[gid] for gid in ranked if not view.groups[gid].started and view.groups[gid].unreleased
        ]
        if not known:
            return under_way + fresh
        mean = sum(p[0] for p in pred.values()) / len(pred)

        def tokens(g: GroupView) -> float:  # predicted tokens of one of its requests
            p = pred.get(g.group_id)
            return mean if p is None else p[0]

        work = sum(tokens(g) * g.unreleased for g in todo)
        work += sum(0.5 * tokens(g) * max(0, g.released - g.completed) for g in view.groups.values())
        per_slot = work / max(1, view.capacity)
        # critical: a suffix of the ascending ``known``; under the window the step is training-bound
        # and the pool is held back on purpose, so the makespan rule does not apply
        cut = len(known)
        if self.critical and not self.window:
            while cut > 0 and pred[known[cut - 1].group_id][0] >= per_slot:
                cut -= 1
        unknown = [g for g in fresh if g.group_id not in pred]
        return under_way + known[cut:][::-1] + known[:cut] + unknown
