"""FIFO and FGD decide from scripted capacity and completion events: no Redis, no asyncio.

Each test builds a ``StepView`` by hand, as the controller would after the events it names, and
checks the policy's releases against an order worked out by hand from FGD's rule (groups under way
first, then mini-batch order or, with history, the length-aware order; no new group beyond
``lookahead`` mini-batches past the complete ones while the window is on).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.scheduling import make_policy
from rolloutpipe.scheduling.base import GroupView, PrevStep, PromptRecord, Release, StepInfo, StepView
from rolloutpipe.scheduling.fgd import FrontierPolicy
from rolloutpipe.scheduling.fifo import FifoPolicy


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


def test_fgd_window_is_on_when_the_last_free_step_was_training_bound() -> None:
    """On iff training > makespan - first group, all measured in the last step without the window;
    the lookahead is 1 + ceil(makespan / training)."""
    p = FrontierPolicy(cfg())
    p.plan(info(step=1, prev=None))
    assert not p.window  # nothing measured yet
    p.plan(info(step=2, prev=PrevStep(1, train_busy_s=7.0, rollout_makespan_s=10.0, first_group_s=2.0)))
    assert not p.window  # 7 < 10 - 2: rollout-bound
    p.plan(info(step=3, prev=PrevStep(2, train_busy_s=9.0, rollout_makespan_s=10.0, first_group_s=2.0)))
    assert p.window and p.lookahead == 1 + math.ceil(10 / 9)  # 9 > 8: training-bound
    # Step 3 ran with the window: its stretched makespan is not the reference, step 2's is.
    p.plan(info(step=4, prev=PrevStep(3, train_busy_s=9.0, rollout_makespan_s=30.0, first_group_s=1.0)))
    assert p.window and p.lookahead == 3
    p.plan(info(step=5, prev=PrevStep(4, train_busy_s=7.5, rollout_makespan_s=30.0, first_group_s=1.0)))
    assert not p.window  # 7.5 < 10 - 2
    # a training-heavier step: 25 > 10 - 2, lookahead 1 + ceil(10 / 25) = 2
    p.plan(info(step=6, prev=PrevStep(5, train_busy_s=25.0, rollout_makespan_s=10.0, first_group_s=2.0)))
    assert p.window and p.lookahead == 2
    off = FrontierPolicy(cfg(fgd_window="off"))
    off.plan(info(step=1, prev=PrevStep(0, train_busy_s=100.0, rollout_makespan_s=1.0)))
    assert not off.window
    fixed = FrontierPolicy(cfg(fgd_window="on", fgd_lookahead=4))
    fixed.plan(info(step=1))
    assert fixed.window and fixed.lookahead == 4


def training_bound() -> PrevStep:
    return PrevStep(0, train_busy_s=10.0, rollout_makespan_s=10.0, first_group_s=1.0)


def test_fgd_window_holds_new_groups_until_groups_complete() -> None:
    p = FrontierPolicy(cfg(fgd_lookahead=1))
    inf = info(prev=training_bound())
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


def with_history(
    view: StepView, lengths: dict[int, float], truncated: dict[int, float] | None = None
) -> None:
    """History records for some of the view's prompts: group i's prompt had mean length lengths[i]."""
    hist: dict[int, list[PromptRecord]] = {}
    for i, n in lengths.items():
        g = view.groups[f"{view.step}:{i}"]
        tr = (truncated or {}).get(i, 0.0)
        hist[g.prompt_index] = [PromptRecord(view.step - 1, 4, 0.5, 0.5, 0.5, n, tr)]
    view.history = hist


def test_fgd_with_its_critical_rule_starts_critical_groups_longest_first_then_the_rest_shortest_first() -> (
    None
):
    """``fgd_critical: true``.  8 groups of 4 on 8 slots, every prompt seen before.  Work per slot =
    sum(mean x 4) / 8 = (100+900+300+200+800+400+150+250) / 2 = 1,550: no group is critical yet, so
    shortest first."""
    p = FrontierPolicy(cfg(fgd_window="off", fgd_critical=True))
    view = view_for(p, info())
    view.capacity = 8
    with_history(view, {0: 100, 1: 900, 2: 300, 3: 200, 4: 800, 5: 400, 6: 150, 7: 250})
    rel = p.admit(view, free=8)
    assert rel == [Release("1:0", 4), Release("1:6", 4)]
    apply(view, rel)
    # A smaller pool: 2 slots.  Work left = (300+200+800+400+250+900) x 4 + 0.5 x (100+150) x 4 = 11,900;
    # per slot 5,950 > every mean: still nothing critical.  Shrink the work instead: groups 1 and 4
    # alone left, 2 slots: (900 + 800) x 4 / 2 = 3,400 > both.  With 8 slots: 850: group 1 (900) is
    # critical and goes first, then 4 (800 < 850) as the shortest of the rest.
    for gid in ("1:2", "1:3", "1:5", "1:7"):
        view.groups[gid].released = view.groups[gid].completed = 4
    view.groups["1:0"].completed = view.groups["1:6"].completed = 4
    assert [r.group_id for r in p.admit(view, free=8)] == ["1:1", "1:4"]
    # the default (the rule off) goes shortest first on the same view
    assert [r.group_id for r in FrontierPolicy(cfg(fgd_window="off")).admit(view, free=8)] == ["1:4", "1:1"]


@pytest.mark.parametrize(
    ("kv_tokens", "first"), [(0, ["1:0", "1:6"]), (6800, ["1:0", "1:6"]), (6799, ["1:0", "1:1"])]
)
def test_length_aware_fgd_keeps_the_plan_order_where_its_tail_would_overflow_the_kv_cache(
    kv_tokens: int, first: list[str]
) -> None:
    """Shortest first leaves the 8 (= capacity) longest predicted requests to run together: groups
    1 and 4, 4 x 900 + 4 x 800 = 6,800 tokens.  A cache that holds them (or none reported) keeps the
    length order (shortest first: 100, 150); one a token smaller takes the plan's order."""
    p = FrontierPolicy(cfg(fgd_window="off"))
    view = view_for(p, info())
    view.capacity, view.kv_tokens = 8, kv_tokens
    with_history(view, {0: 100, 1: 900, 2: 300, 3: 200, 4: 800, 5: 400, 6: 150, 7: 250})
    rel = p.admit(view, free=8)
    assert [r.group_id for r in rel] == first
    # decided once a step, on the first cache reported: a later report does not flip the order
    apply(view, rel)
    if kv_tokens:
        view.kv_tokens = 10**9 if kv_tokens == 6799 else 1
    nxt = [r.group_id for r in p.admit(view, free=8)]
    assert nxt == (["1:2", "1:3"] if kv_tokens == 6799 else ["1:3", "1:7"])
    # the next step decides again
    view = view_for(p, info(step=2))
    view.capacity, view.kv_tokens = 8, 1
    with_history(view, {0: 100, 1: 900, 2: 300, 3: 200, 4: 800, 5: 400, 6: 150, 7: 250})
    assert [r.group_id for r in p.admit(view, free=8)] == ["2:0", "2:1"]


def test_fgd_without_its_kv_guard_keeps_the_length_order_where_the_tail_overflows() -> None:
    """The ablation ``fgd_kv_guard: false`` (and ``policy_args: {kv_guard: false}``): the same step
    as above with a cache far too small still goes shortest first."""
    for p in (
        FrontierPolicy(cfg(fgd_window="off", fgd_kv_guard=False)),
        FrontierPolicy(cfg(fgd_window="off"), kv_guard=False),
    ):
        view = view_for(p, info())
        view.capacity, view.kv_tokens = 8, 1
        with_history(view, {0: 100, 1: 900, 2: 300, 3: 200, 4: 800, 5: 400, 6: 150, 7: 250})
        assert [r.group_id for r in p.admit(view, free=8)] == ["1:0", "1:6"]


def test_fgd_with_its_critical_rule_puts_long_groups_first_when_the_pool_is_small() -> None:
    """``fgd_critical: true``.  1 slot: the work per slot exceeds no group's length only when little
    is left; with 8 groups of mean 100..800 on 64 slots, work per slot = 4 x 3,600 / 64 = 225:
    groups of 300+ are critical (longest first), then 100 and 200 shortest first."""
    p = FrontierPolicy(cfg(fgd_window="off", fgd_critical=True))
    view = view_for(p, info())
    view.capacity = 64
    with_history(view, {i: 100.0 * (i + 1) for i in range(8)})
    order = [r.group_id for r in p.admit(view, free=64)]
    assert order == ["1:7", "1:6", "1:5", "1:4", "1:3", "1:2", "1:0", "1:1"]


def test_fgd_without_its_critical_rule_goes_plain_shortest_first() -> None:
    """The default (``fgd_critical: false``; ``policy_args: {critical: false}`` over a config that
    turns it on): the step above, where groups of 300+ are critical, starts shortest first
    throughout."""
    for p in (FrontierPolicy(cfg(fgd_window="off")),
              FrontierPolicy(cfg(fgd_window="off", fgd_critical=False)),
              FrontierPolicy(cfg(fgd_window="off", fgd_critical=True), critical=False)):  # fmt: skip
        view = view_for(p, info())
        view.capacity = 64
        with_history(view, {i: 100.0 * (i + 1) for i in range(8)})
        order = [r.group_id for r in p.admit(view, free=64)]
        assert order == [f"1:{i}" for i in range(8)]


def test_length_aware_fgd_keeps_plan_order_without_history_and_breaks_ties_by_truncation() -> None:
    p = FrontierPolicy(cfg(fgd_window="off"))
    view = view_for(p, info())
    view.capacity = 1000
    assert [r.group_id for r in p.admit(view, free=8)] == ["1:0", "1:1"]  # no history: plan order
    view = view_for(p, info())
    view.capacity = 1  # work per slot far above 50: nothing is critical
    with_history(view, {3: 50, 5: 50}, truncated={3: 0.25})
    # groups with history first (5 before 3: same mean, 3 was truncated), then the rest in plan order
    assert [r.group_id for r in p.admit(view, free=16)] == ["1:5", "1:3", "1:0", "1:1"]
    off = FrontierPolicy(cfg(fgd_window="off", fgd_length_aware=False))
    view = view_for(off, info())
    with_history(view, {3: 50, 5: 50})
    assert [r.group_id for r in off.admit(view, free=8)] == ["1:0", "1:1"]


def test_fgd_stamps_each_started_group_with_its_frontier_rank() -> None:
    """The k-th group started gets priority k // groups-per-mini-batch, whatever its plan position."""
    p = FrontierPolicy(cfg(fgd_window="off"))
    view = view_for(p, info())
    view.capacity = 1  # nothing critical: shortest first
    with_history(view, {7: 10, 6: 20, 5: 30})
    apply(view, p.admit(view, free=12))  # 1:7, 1:6, 1:5
    assert [view.groups[f"1:{i}"].priority for i in (7, 6, 5)] == [0, 0, 1]
    apply(view, p.admit(view, free=8))  # then 1:0, 1:1 in plan order
    assert view.groups["1:0"].priority == 1 and view.groups["1:1"].priority == 2


def test_make_policy_by_name_by_path_and_bad_names() -> None:
    assert isinstance(make_policy(cfg(policy="fifo")), FifoPolicy)
    assert isinstance(make_policy(cfg(policy="fgd", policy_args={"lookahead": 2})), FrontierPolicy)
    with pytest.raises(ConfigError, match="auto, on or off"):
        make_policy(cfg(policy="fgd", policy_args={"window": "sometimes"}))
    assert isinstance(make_policy(cfg(policy="rolloutpipe.scheduling.fgd:FrontierPolicy")), FrontierPolicy)
    with pytest.raises(ConfigError, match="not one of"):
        make_policy(cfg(policy="no.such:Policy"))
    with pytest.raises(ConfigError, match="unknown policy_args"):
        make_policy(cfg(policy="fgd", policy_args={"lookahaed": 2}))
    with pytest.raises(ConfigError, match="takes no policy_args"):
        make_policy(cfg(policy="fifo", policy_args={"x": 1}))


def test_a_policy_that_leaves_a_complete_group_open_is_an_error_not_a_hang() -> None:
    from types import SimpleNamespace

    from rolloutpipe.errors import PolicyError
    from rolloutpipe.roles.controller import Controller

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
    view = view_for(p, info(prev=training_bound()))
    apply(view, p.admit(view, free=100))  # mini-batch 0's two groups
    for gid in ("1:0", "1:1"):
        view.groups[gid].status = "skipped"  # both skipped; nothing emitted
    assert p.admit(view, free=100) == [Release("1:2", 4), Release("1:3", 4)]


def test_fifo_late_releases_like_fifo_but_without_engine_queues() -> None:
    from rolloutpipe.scheduling.fifo import LateFifoPolicy

    late, fifo = make_policy(cfg(policy="fifo-late")), FifoPolicy(cfg())
    assert isinstance(late, LateFifoPolicy)
    assert late.admit(view_for(late, info()), free=0) == fifo.admit(view_for(fifo, info()), free=0)
    assert fifo.engine_queue and not late.engine_queue  # requests carry queue_share_of 0: slots only


def test_under_the_window_length_aware_fgd_fills_shortest_first() -> None:
    """With the window on, the pool is held back on purpose: no group is critical, and the window's
    groups are the shortest predicted ones, even with the critical rule on (the same history on 64
    slots without the window would then start the long groups first, see the test above)."""
    p = FrontierPolicy(cfg(fgd_window="on", fgd_lookahead=1, fgd_critical=True))
    view = view_for(p, info())
    view.capacity = 64
    with_history(view, {i: 100.0 * (8 - i) for i in range(8)})  # group 7 shortest
    assert p.window
    assert [r.group_id for r in p.admit(view, free=64)] == ["1:7", "1:6"]  # one mini-batch of 2


def test_allocation_policies_keep_the_plan_order_and_refuse_length_aware() -> None:
    """VIGOR, Pilot-Commit and dynamic sampling decide per plan mini-batch: a length-aware order
    across mini-batches could leave a window full of groups whose mini-batches never complete."""
    for name in ("vigor", "pilot-commit", "dynamic-sampling"):
        p: Any = make_policy(cfg(policy=name))
        assert not p.length_aware
        with pytest.raises(ConfigError, match="length_aware must stay off"):
            make_policy(cfg(policy=name, policy_args={"length_aware": True}))
    assert make_policy(cfg(policy="fgd")).length_aware  # type: ignore[attr-defined]
