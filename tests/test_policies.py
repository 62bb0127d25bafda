"""FIFO and FGD decide from scripted capacity and completion events: no Redis, no asyncio.

Each test builds a ``StepView`` by hand, as the controller would after the events it names, and
checks the policy's releases against an order worked out by hand from FGD's rule (groups under way
first, then mini-batch order; no new group beyond ``lookahead`` mini-batches past the complete ones
while the window is on).
"""

from __future__ import annotations

from typing import Any

import pytest

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.workers.policies import make_policy
from rolloutpipe.workers.policies.base import GroupView, PrevStep, Release, StepInfo, StepView
from rolloutpipe.workers.policies.fgd import FrontierPolicy
from rolloutpipe.workers.policies.fifo import FifoPolicy


def info(step: int = 1, prev: PrevStep | None = None, b: int = 8, g: int = 4, mb: int = 4) -> StepInfo:
    return StepInfo(step=step, prompts=list(range(step * b, step * b + b)), group_size=g, minibatches=mb,
                    n_prompts=1000, prev=prev, history={})  # fmt: skip


def view_for(policy: FifoPolicy, inf: StepInfo) -> StepView:
    """The controller's view right after the plan: nothing released, nothing complete."""
    specs = policy.plan(inf)
    gpm = len(specs) // inf.minibatches
    groups = {
        f"{inf.step}:{i}": GroupView(
            f"{inf.step}:{i}",
            s.prompt_index,
            i,
            i // gpm,
            s.n,
            s.n,
            s.final,
            "final" if s.final else "open",
            counts=[s.n],
        )
        for i, s in enumerate(specs)
    }
    return StepView(inf.step, inf.minibatches, gpm, groups)


def apply(view: StepView, releases: list[Release]) -> None:
    for r in releases:
        view.groups[r.group_id].released += r.n


def cfg(**kw: object) -> ControllerConfig:
    return ControllerConfig(prompts_per_step=8, group_size=4, minibatches=4, **kw)  # type: ignore[arg-type]


def test_fifo_plans_g_each_and_releases_everything_in_dataset_order() -> None:
    p = FifoPolicy(cfg())
    inf = info()
    specs = p.plan(inf)
    assert [(s.prompt_index, s.n, s.final) for s in specs] == [(8 + i, 4, True) for i in range(8)]
    view = view_for(p, inf)
    rel = p.admit(view, free=0)  # FIFO ignores capacity: the engines queue
    assert rel == [Release(f"1:{i}", 4) for i in range(8)]
    apply(view, rel)
    assert p.admit(view, free=100) == []  # nothing left
    assert p.engine_queue and not p.changes_groups


def test_fgd_fills_free_slots_frontier_first_without_a_window() -> None:
    p = FrontierPolicy(cfg(fgd_slack=0))
    view = view_for(p, info(prev=None))  # no previous step: the window is off
    assert not p.window
    rel = p.admit(view, free=6)
    assert rel == [Release("1:0", 4), Release("1:1", 2)]  # group 0 whole, then group 1 started
    apply(view, rel)
    # Capacity frees by 3: the group under way (1:1) is finished first, then the next in order.
    rel = p.admit(view, free=3)
    assert rel == [Release("1:1", 2), Release("1:2", 1)]
    apply(view, rel)
    assert p.admit(view, free=0) == [] and not p.engine_queue


def test_fgd_slack_admits_beyond_free_capacity() -> None:
    p = FrontierPolicy(cfg(fgd_slack=2))
    view = view_for(p, info())
    assert p.admit(view, free=0) == [Release("1:0", 2)]
    assert p.admit(view, free=-2) == []


def test_fgd_started_groups_go_before_earlier_unstarted_ones() -> None:
    """A restart can leave a later group half released: it is finished before a new one starts."""
    p = FrontierPolicy(cfg())
    view = view_for(p, info())
    view.groups["1:5"].released = 3
    assert p.admit(view, free=2) == [Release("1:5", 1), Release("1:0", 1)]


def test_fgd_window_follows_the_training_to_rollout_ratio_of_the_last_free_step() -> None:
    p = FrontierPolicy(cfg(fgd_lookahead=1, fgd_window_min_train_ratio=0.75))
    p.plan(info(step=1, prev=PrevStep(0, train_busy_s=5.0, rollout_makespan_s=10.0)))
    assert not p.window  # 0.5 < 0.75
    p.plan(info(step=2, prev=PrevStep(1, train_busy_s=8.0, rollout_makespan_s=10.0)))
    assert p.window  # 0.8 >= 0.75
    # Step 2 ran with the window, so its makespan (stretched by the window) is not the reference:
    # 8 / 10 (step 1's free makespan) is still >= 0.75, although 8 / 20 would not be.
    p.plan(info(step=3, prev=PrevStep(2, train_busy_s=8.0, rollout_makespan_s=20.0)))
    assert p.window
    p.plan(info(step=4, prev=PrevStep(3, train_busy_s=7.0, rollout_makespan_s=20.0)))
    assert not p.window  # 7 / 10 < 0.75
    off = FrontierPolicy(cfg(fgd_lookahead=0))
    off.plan(info(step=1, prev=PrevStep(0, train_busy_s=100.0, rollout_makespan_s=1.0)))
    assert not off.window  # lookahead 0: never a window


def test_fgd_window_holds_new_groups_until_groups_complete() -> None:
    p = FrontierPolicy(cfg(fgd_lookahead=1))
    inf = info(prev=PrevStep(0, train_busy_s=10.0, rollout_makespan_s=10.0))
    view = view_for(p, inf)  # 8 groups, 4 mini-batches of 2
    assert p.window
    rel = p.admit(view, free=100)
    # nothing complete: only mini-batch 0's two groups may start
    assert rel == [Release("1:0", 4), Release("1:1", 4)]
    apply(view, rel)
    assert p.admit(view, free=100) == []  # the window is closed
    view.emitted = 1  # one group complete: still inside mini-batch 0
    assert p.admit(view, free=100) == []
    view.emitted = 2  # mini-batch 0 complete: mini-batch 1 may start
    assert p.admit(view, free=100) == [Release("1:2", 4), Release("1:3", 4)]


def test_make_policy_by_name_by_path_and_bad_names() -> None:
    assert isinstance(make_policy(cfg(policy="fifo")), FifoPolicy)
    assert isinstance(make_policy(cfg(policy="fgd", policy_args={"lookahead": 2})), FrontierPolicy)
    assert isinstance(
        make_policy(cfg(policy="rolloutpipe.workers.policies.fgd:FrontierPolicy")), FrontierPolicy
    )
    with pytest.raises(ConfigError, match="not one of"):
        make_policy(cfg(policy="no.such:Policy"))
    with pytest.raises(ConfigError, match="unknown policy_args"):
        make_policy(cfg(policy="fgd", policy_args={"lookahaed": 2}))
    with pytest.raises(ConfigError, match="takes no policy_args"):
        make_policy(cfg(policy="fifo", policy_args={"x": 1}))


def test_a_policy_that_leaves_a_complete_group_open_is_an_error_not_a_hang() -> None:
    from types import SimpleNamespace

    from rolloutpipe.errors import PolicyError
    from rolloutpipe.workers.controller import Controller

    p = FifoPolicy(cfg())
    view = view_for(p, info())
    ctl: Any = SimpleNamespace(cc=SimpleNamespace(policy="mine"))
    g = view.groups["1:0"]
    g.final, g.status, g.completed = False, "open", g.target  # complete, not final: a decision is due
    for other in list(view.groups.values())[1:]:
        other.emitted = True
    view.groups["1:1"].emitted = False  # still to report: news may come, so not stuck yet
    Controller.check_not_stuck(ctl, view)
    view.groups["1:1"].emitted = True
    with pytest.raises(PolicyError, match=r"\['1:0'\].*must extend, finalize, close or skip"):
        Controller.check_not_stuck(ctl, view)


def test_fgd_window_does_not_count_skipped_groups_as_under_way() -> None:
    """A skipped group never reaches the trainer: counted as under way, it would hold the window
    shut for good (a refill could never start)."""
    p = FrontierPolicy(cfg(fgd_lookahead=1))
    view = view_for(p, info(prev=PrevStep(0, train_busy_s=10.0, rollout_makespan_s=10.0)))
    apply(view, p.admit(view, free=100))  # mini-batch 0's two groups
    for gid in ("1:0", "1:1"):
        view.groups[gid].status = "skipped"  # both skipped; nothing emitted
    assert p.admit(view, free=100) == [Release("1:2", 4), Release("1:3", 4)]


def test_fifo_late_releases_like_fifo_but_without_engine_queues() -> None:
    from rolloutpipe.workers.policies.fifo import LateFifoPolicy

    late, fifo = make_policy(cfg(policy="fifo-late")), FifoPolicy(cfg())
    assert isinstance(late, LateFifoPolicy)
    assert late.admit(view_for(late, info()), free=0) == fifo.admit(view_for(fifo, info()), free=0)
    assert fifo.engine_queue and not late.engine_queue  # requests carry queue_share_of 0: slots only
