"""A policy written outside the package: mixed group sizes, an extension, an early close, a skip, a refill.

Only ``rolloutpipe.scheduling.base`` is imported: this file is all it takes to add a policy.
Groups of a step, in plan order:

* 0, 1, 2: 4, 8 and 12 samples, final at plan time;
* 3: 4 samples, then extended by 4 once its first four are complete (8 in all);
* 4: 4 samples, then extended by 8, then closed at its first 4 at the next news of any group
  (its requests still in flight are aborted, samples already generated are discarded);
* 5: 4 samples, then skipped, and a new group (6) of 4 samples is added in its place.

Every decision is read off the view, with no state of its own, so a restarted controller (a new
instance of this class) takes the same decisions.
"""

from __future__ import annotations

from rolloutpipe.scheduling.base import (
    AddGroup,
    BasePolicy,
    Close,
    Decision,
    Extend,
    GroupSpec,
    GroupView,
    Skip,
    StepInfo,
    StepView,
)

PLAN = [(4, True), (8, True), (12, True), (4, False), (4, False), (4, False)]


class MixedPolicy(BasePolicy):
    engine_queue = False
    changes_groups = True  # it skips and adds groups: the trainer waits for the step's seal
    history = 2  # the last two finished groups of each prompt (tests read them from Redis)

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        assert len(info.prompts) == len(PLAN)
        return [GroupSpec(p, n, final) for p, (n, final) in zip(info.prompts, PLAN, strict=True)]

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]:
        out: list[Decision] = []
        closing = next(
            (g for g in view.groups.values() if g.order == 4 and g.status == "open" and g.target > 4), None
        )
        if closing is not None:  # extended and not closed yet: close it at the first news
            out.append(Close(closing.group_id, keep=4, reason="closed early by the test policy"))
        if not group.waiting or group is closing:
            return out
        if group.order == 3:
            out.append(Extend(group.group_id, 4, final=True, reason="extended mid-rollout"))
        elif group.order == 4:
            out.append(Extend(group.group_id, 8, final=False, reason="extended, to be closed"))
        elif group.order == 5:
            out += [Skip(group.group_id, "skipped by the test policy"), AddGroup(4, reason="refill")]
        return out
