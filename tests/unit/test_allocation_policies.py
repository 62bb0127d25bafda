"""VIGOR, Pilot-Commit and dynamic sampling decide from scripted rewards: no Redis, no asyncio.

``Sim`` plays the controller's part as the seam defines it (``scheduling/base.py``): it completes
every outstanding sample of a group at once, with rewards from a script, reports the group to
``on_stats``, and applies the decisions to the view.  Groups complete in a shuffled order, so no
test depends on which group reports first.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import pytest

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import PolicyError
from rolloutpipe.scheduling import make_policy
from rolloutpipe.scheduling.base import (
    AddGroup,
    Close,
    Decision,
    Extend,
    Finalize,
    GroupView,
    Policy,
    Skip,
    StepInfo,
    StepView,
)
from rolloutpipe.scheduling.vigor import reward_variance

Rewards = Callable[[int, int], float]  # (prompt index, sample index) -> reward


class Sim:
    def __init__(self, policy: Policy, b: int, g: int, mb: int, rewards: Rewards, seed: int = 0) -> None:
        self.p, self.rewards, self.rng = policy, rewards, random.Random(seed)
        info = StepInfo(step=0, prompts=list(range(b)), group_size=g, minibatches=mb, n_prompts=1000,
                        prev=None, history={})  # fmt: skip
        specs = policy.plan(info)
        gpm = b // mb
        self.view = StepView(0, mb, gpm, {})
        for s in specs:
            self.add(s.prompt_index, s.n, s.final)
        self.log: list[Decision] = []
        # each round of extensions: (variances of the groups extended, of the open groups left out)
        self.rounds: list[tuple[list[float], list[float]]] = []

    def add(self, prompt: int, n: int, final: bool, added: bool = False) -> GroupView:
        i = len(self.view.groups)
        g = GroupView(f"0:{i}", prompt, i, i // self.view.groups_per_minibatch, n, n, final,
                      "final" if final else "open", counts=[n], added=added)  # fmt: skip
        self.view.groups[g.group_id] = g
        return g

    def run(self, max_events: int = 10_000) -> StepView:
        for _ in range(max_events):
            todo = [
                g
                for g in self.view.groups.values()
                if g.status in ("open", "final") and g.completed < g.target
            ]
            if not todo:
                break
            g = self.rng.choice(todo)
            g.completed = g.target
            g.rewards = np.asarray([self.rewards(g.prompt_index, i) for i in range(g.target)], np.float32)
            decisions = self.p.on_stats(self.view, g)
            ext = {d.group_id for d in decisions if isinstance(d, Extend)}
            if ext:  # the round's ranking: the extended groups against every open group left out
                room, cap = getattr(self.p, "round", 1), getattr(self.p, "cap", 1 << 30)
                peers = [x for x in self.view.groups.values() if x.status == "open"]
                self.rounds.append(
                    ([reward_variance(x) for x in peers if x.group_id in ext],
                     [reward_variance(x) for x in peers if x.group_id not in ext and x.target + room <= cap])
                )  # fmt: skip
            for d in decisions:
                self.apply(d)
        stuck = [g.group_id for g in self.view.groups.values() if g.status == "open"]
        assert not stuck, f"groups left open: {stuck}"
        return self.view

    def apply(self, d: Decision) -> None:
        self.log.append(d)
        if isinstance(d, AddGroup):
            prompt = 1000 + len(self.view.groups) if d.prompt_index is None else d.prompt_index
            self.add(prompt, d.n, d.final, added=True)
            return
        g = self.view.groups[d.group_id]
        assert g.status == "open", (d, g.status)
        if isinstance(d, Extend):
            assert g.completed == g.target, "extended before its round was complete"
            g.target += d.n
            g.counts.append(g.target)
            g.final, g.status = d.final, "final" if d.final else "open"
        elif isinstance(d, Finalize):
            g.final, g.status = True, "final"
        elif isinstance(d, Skip):
            g.status = "skipped"
        elif isinstance(d, Close):
            g.target, g.status = d.keep, "closed"


def cfg(policy: str, b: int = 8, g: int = 8, mb: int = 1, **args: object) -> ControllerConfig:
    return ControllerConfig(policy=policy, policy_args=args, prompts_per_step=b, group_size=g, minibatches=mb)


def bernoulli(rates: dict[int, float], seed: int = 0) -> Rewards:
    """Prompt p passes sample i with probability rates[p] (fixed per (p, i): a script, not a draw)."""

    def r(p: int, i: int) -> float:
        return float(random.Random(f"{seed}:{p}:{i}").random() < rates.get(p, 0.5))

    return r


# ------------------------------------------------------------------------------------------ VIGOR


def test_vigor_first_extras_go_to_the_highest_variance_groups() -> None:
    # prompts 0-3 never pass, 4-7 pass half the time: only those have variance
    rates = {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 0.5, 5: 0.5, 6: 0.5, 7: 0.5}
    pol = make_policy(cfg("vigor", n0=2, round=2, top_frac=0.5))
    sim = Sim(pol, 8, 8, 1, bernoulli(rates, seed=3), seed=1)
    assert {g.target for g in sim.view.groups.values()} == {2}
    view = sim.run()
    first = next(i for i, d in enumerate(sim.log) if isinstance(d, Extend))
    round1 = [d for d in sim.log[first:] if isinstance(d, Extend)][:4]
    extended = {d.group_id for d in round1}
    # after round 0 every group had 2 samples: the flat ones (0-3) can never be chosen
    assert not extended & {f"0:{i}" for i in range(4)}
    assert sum(g.target for g in view.groups.values()) <= 8 * 8
    assert all(g.status == "final" for g in view.groups.values())
    assert all(g.target == 2 for g in view.groups.values() if g.order < 4)  # no variance, no extras


@pytest.mark.parametrize("seed", range(40))
def test_vigor_never_exceeds_the_steps_budget_or_its_cap_and_ranks_by_variance(seed: int) -> None:
    rng = random.Random(seed)
    b, g, mb = rng.choice([(8, 8, 1), (8, 8, 2), (16, 16, 4), (6, 4, 3)])
    budget = rng.choice([g, g * 0.75, g * 1.5])
    n0 = rng.choice([2, max(2, g // 4)])
    rnd = rng.choice([1, 2, n0])
    cap = rng.choice([n0 + rnd, 2 * g, 4 * g])
    pol = make_policy(cfg("vigor", b, g, mb, n0=n0, budget=budget, round=rnd, cap=cap,
                          top_frac=rng.choice([0.25, 0.5, 1.0])))  # fmt: skip
    rates = {p: rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]) for p in range(b)}
    sim = Sim(pol, b, g, mb, bernoulli(rates, seed), seed)
    view = sim.run()
    # the budget is the whole step's, not a mini-batch's
    assert sum(x.target for x in view.groups.values()) <= max(b * n0, int(b * budget))
    assert all(x.target <= max(n0, cap) for x in view.groups.values())
    # every round's extras went to groups whose variance, when chosen, was at least that of every
    # open group of the step left out of that round (below its cap), never to a group without variance
    for chosen, left_out in sim.rounds:
        assert min(chosen) > 0 and min(chosen) >= max(left_out, default=0.0), (chosen, left_out)
    assert all(x.status == "final" for x in view.groups.values())


def test_vigor_moves_a_flat_minibatchs_budget_to_the_rest_of_the_step() -> None:
    """Mini-batch 1 never passes: its budget goes to mini-batch 0's groups (the whole step's pool)."""
    rates = {0: 0.5, 1: 0.5, 2: 0.0, 3: 0.0}
    pol = make_policy(cfg("vigor", 4, 8, 2, n0=2, round=2, top_frac=1.0, cap=32))
    view = Sim(pol, 4, 8, 2, bernoulli(rates, seed=1)).run()
    flat = [view.groups["0:2"], view.groups["0:3"]]
    assert [g.target for g in flat] == [2, 2]
    total = sum(g.target for g in view.groups.values())
    varied = [view.groups["0:0"], view.groups["0:1"]]
    if all(reward_variance(g) > 0 for g in varied):  # both kept their variance to the end
        assert total == 4 * 8  # the step's whole budget was spent, 28 of it on mini-batch 0
    assert sum(g.target for g in varied) > 2 * 8  # more than mini-batch 0's own share


def test_vigor_a_final_group_goes_at_once_and_a_round_waits_for_the_step() -> None:
    """A group without variance is final on its own report, before any other group reports; a round's
    extras wait until every open group of the step has its round complete."""
    pol = make_policy(cfg("vigor", 4, 8, 2, n0=2, round=2))
    sim = Sim(pol, 4, 8, 2, bernoulli({0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, seed=1))

    def report(g: GroupView, rewards: list[float]) -> list[Decision]:
        g.completed, g.rewards = g.target, np.asarray(rewards, np.float32)
        out = pol.on_stats(sim.view, g)
        for d in out:
            sim.apply(d)
        return out

    gs = [sim.view.groups[f"0:{i}"] for i in range(4)]
    assert [type(d) for d in report(gs[3], [1.0, 1.0])] == [Finalize]  # flat: final at once
    assert gs[3].status == "final" and all(g.completed == 0 for g in gs[:3])
    assert report(gs[0], [1.0, 0.0]) == [] and report(gs[1], [0.0, 1.0]) == []  # gs[2] still out
    last = report(gs[2], [1.0, 0.0])
    assert {d.group_id for d in last if isinstance(d, Extend)} == {"0:0", "0:1"}  # top half of three


# ------------------------------------------------------------------------------------ Pilot-Commit


def pc(b: int = 8, g: int = 16, mb: int = 2, **args: object) -> Policy:
    return make_policy(cfg("pilot-commit", b, g, mb, **args))


def test_pilot_commit_defaults_are_the_published_code_s() -> None:
    pol = pc(16, 16, 4)
    plan = pol.plan(StepInfo(step=0, prompts=list(range(16)), group_size=16, minibatches=4, n_prompts=1000,
                             prev=None, history={}))  # fmt: skip
    assert len(plan) == 48 and {(s.n, s.final) for s in plan} == {(4, False)}  # 3 x B pilots of G/4
    assert [s.prompt_index for s in plan] == list(range(48))  # drawn in order from the stream
    assert (pol.lo, pol.hi, pol.evict, pol.max_rounds) == (0.125, 0.75, 1.0, 10)


def test_pilot_commit_window_defers_below_evicts_solved_commits_between() -> None:
    # pilots of 4: pass rate 0 defers, 0.25-0.75 commits, 1.0 evicts
    scripted = {0: [0, 0, 0, 0], 1: [1, 0, 0, 0], 2: [1, 1, 0, 0], 3: [1, 1, 1, 0], 4: [1, 1, 1, 1]}
    pol = pc(5, 16, 1, pool=1, max_rounds=1)
    view = Sim(pol, 5, 16, 1, lambda p, i: float(scripted[p][i]) if i < 4 else 1.0).run()
    status = {g.prompt_index: (g.status, g.counts) for g in view.groups.values()}
    assert status == {0: ("skipped", [4]), 1: ("final", [4, 16]), 2: ("final", [4, 16]),
                      3: ("final", [4, 16]), 4: ("skipped", [4])}  # fmt: skip
    reasons = {d.group_id: d.reason for d in sim_log(pol, 5, scripted) if isinstance(d, Skip)}
    assert "deferred" in reasons["0:0"] and "evicted" in reasons["0:4"]


def sim_log(pol: Policy, b: int, scripted: dict[int, list[int]]) -> list[Decision]:
    sim = Sim(pol, b, 16, 1, lambda p, i: float(scripted[p][i]) if i < 4 else 1.0)
    sim.run()
    return sim.log


@pytest.mark.parametrize("seed", range(30))
def test_pilot_commit_fills_the_batch_with_the_first_commits_in_plan_order(seed: int) -> None:
    """Whatever order pilots complete in, the step trains the first B in-window candidates in plan
    order, refilling pools until it has B or reaches the cap; nothing past the B-th commit trains."""
    rng = random.Random(seed)
    b, pool, rounds = rng.choice([(8, 1.0, 10), (8, 2.0, 2), (4, 1.5, 3), (8, 1.0, 1)])
    rates = {p: rng.choice([0.0, 0.0, 0.1, 0.5, 1.0]) for p in range(2000)}
    rewards = bernoulli(rates, seed)
    pol = pc(b, 16, 2, pool=pool, max_rounds=rounds)
    view = Sim(pol, b, 16, 2, rewards, seed=seed).run()
    groups = sorted(view.groups.values(), key=lambda g: g.order)
    per_round = math.ceil(b * pool)
    assert len(groups) % per_round == 0 and len(groups) // per_round <= rounds
    pilot_rate = {g.group_id: np.mean([rewards(g.prompt_index, i) > 0 for i in range(4)]) for g in groups}
    in_window = [g.group_id for g in groups if 0.125 <= pilot_rate[g.group_id] <= 0.75]
    committed = [g.group_id for g in groups if g.status == "final"]
    assert committed == in_window[:b]
    assert all(g.counts == [4, 16] for g in groups if g.status == "final")
    assert all(g.status == "skipped" for g in groups if g.group_id not in committed)
    if len(committed) < b:  # short only when every round of the cap was drawn
        assert len(groups) == per_round * rounds
    else:  # no pool drawn beyond the one that filled the batch
        assert len(groups) // per_round == math.ceil(
            (groups.index(view.groups[committed[-1]]) + 1) / per_round
        )
    assert [g.prompt_index for g in groups] == list(range(len(groups)))  # the stream, in order
    assert pol.next_prompt(view) == len(groups)


def test_pilot_commit_evicted_prompts_are_passed_over_by_the_stream() -> None:
    from rolloutpipe.scheduling.base import PromptRecord

    solved = PromptRecord(step=0, n=4, reward_mean=1, reward_std=0, pass_rate=1.0, mean_length=3,
                          truncated_frac=0, trained=False)  # fmt: skip
    later = PromptRecord(step=1, n=4, reward_mean=1, reward_std=0, pass_rate=1.0, mean_length=3,
                         truncated_frac=0, trained=False)  # fmt: skip
    history = {2: [solved], 5: [solved], 7: [later]}  # 7's record is of the step being planned
    pol = pc(4, 16, 1, pool=1)
    info = StepInfo(step=1, prompts=[0, 1, 2, 3], group_size=16, minibatches=1, n_prompts=10, prev=None,
                    history=history, first_prompt=0)  # fmt: skip
    assert [s.prompt_index for s in pol.plan(info)] == [0, 1, 3, 4]
    view = StepView(1, 1, 4, {}, first_prompt=0)
    for i, p in enumerate([0, 1, 3, 4]):
        view.groups[f"1:{i}"] = GroupView(f"1:{i}", p, i, 0, 4, 4, False)
    assert pol.next_prompt(view) == 6 and pol.prompt_at(4) == 6 and pol.prompt_at(5) == 7
    # the stream wraps: 10 prompts, 2 and 5 evicted
    assert [pol.prompt_at(j) for j in range(6, 11)] == [8, 9, 0, 1, 3]
    every = {p: [solved] for p in range(10)}
    with pytest.raises(PolicyError, match="evicted"):
        pc(4, 16, 1).plan(StepInfo(step=1, prompts=[0, 1, 2, 3], group_size=16, minibatches=1, n_prompts=10,
                                   prev=None, history=every))  # fmt: skip


def test_pilot_commit_a_candidate_never_waits_on_a_later_ones_pilot() -> None:
    """Mini-batch 0's candidates are decided while later pilots have not reported at all."""
    pol = pc(8, 8, 2, n_pilot=4, pool=1.5)
    sim = Sim(pol, 8, 8, 2, bernoulli({p: 0.5 for p in range(12)}, seed=3))
    first = [sim.view.groups[f"0:{i}"] for i in range(4)]
    for g, r in zip(first, ([1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]), strict=True):
        g.completed, g.rewards = g.target, np.asarray(r, np.float32)
        for d in pol.on_stats(sim.view, g):
            sim.apply(d)
    assert [g.status for g in first] == ["final", "skipped", "final", "skipped"]
    assert all(sim.view.groups[f"0:{i}"].completed == 0 for i in range(4, 8))
    # two of twelve lost: the ten left could still fill it, so no pool is drawn yet...
    assert len(sim.view.groups) == 12
    for i, r in zip(range(4, 7), ([0, 0, 0, 0],) * 3, strict=True):  # ...until they cannot
        g = sim.view.groups[f"0:{i}"]
        g.completed, g.rewards = g.target, np.asarray(r, np.float32)
        for d in pol.on_stats(sim.view, g):
            sim.apply(d)
    assert len(sim.view.groups) == 24 and all(g.added for g in list(sim.view.groups.values())[12:])


@pytest.mark.parametrize("policy", ["pilot-commit", "vigor"])
def test_extra_rollouts_of_frontier_groups_are_admitted_before_later_pilots(policy: str) -> None:
    """Once a frontier group is extended, free slots go to its extras before any pilot of a group of
    a later mini-batch, whatever the plan order of the released groups."""
    own = {"n_pilot": 4, "pool": 1} if policy == "pilot-commit" else {"n0": 4, "top_frac": 1.0}
    pol = make_policy(cfg(policy, 8, 8, 2, **own))
    sim = Sim(pol, 8, 8, 2, bernoulli({p: 0.5 for p in range(8)}, seed=11))
    first = pol.admit(sim.view, 16)
    assert {r.group_id for r in first} == {"0:0", "0:1", "0:2", "0:3"}  # the frontier's pilots first
    for r in first:
        sim.view.groups[r.group_id].released += r.n
    if policy == "vigor":  # a round is the whole step's: every pilot reports before any extra
        later = pol.admit(sim.view, 16)
        for r in later:
            sim.view.groups[r.group_id].released += r.n
        first += later
    for g in [sim.view.groups[r.group_id] for r in first]:
        g.completed = g.target
        g.rewards = np.asarray([1.0, 0.0, 1.0, 0.0], np.float32)  # signal everywhere
        for d in pol.on_stats(sim.view, g):
            sim.apply(d)
    extended = [g for g in sim.view.groups.values() if g.minibatch == 0 and g.unreleased > 0]
    assert extended, "no frontier group was extended"
    out = pol.admit(sim.view, 4)
    assert out and all(sim.view.groups[r.group_id].minibatch == 0 for r in out), out
    assert sum(r.n for r in out) == 4


# -------------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_refills_up_to_its_limit_and_no_further() -> None:
    rates = {p: (0.0 if p < 4 else 0.5) for p in range(8)}  # half the plan is flat
    rewards = bernoulli(rates, seed=2)  # refills (prompts >= 1000) pass half the time
    view = Sim(make_policy(cfg("dynamic-sampling", max_refills=2)), 8, 8, 1, rewards).run()
    added = [g for g in view.groups.values() if g.added]
    assert len(added) == 2  # four flat groups, but only two refills allowed
    assert sorted(g.group_id for g in view.groups.values() if g.status == "skipped") == [
        f"0:{i}" for i in range(4)
    ] + [g.group_id for g in added if g.status == "skipped"]
    kept = [g for g in view.groups.values() if g.status == "final"]
    assert all(reward_variance(g) > 0 for g in kept)
    assert len(kept) == 4 + sum(1 for g in added if g.status == "final")


def test_dynamic_sampling_refills_until_the_batch_is_full() -> None:
    rates = {p: (1.0 if p % 2 else 0.5) for p in range(8)}
    rewards = bernoulli({**rates, **{p: 0.5 for p in range(1000, 1100)}}, seed=5)
    view = Sim(make_policy(cfg("dynamic-sampling")), 8, 8, 1, rewards).run()
    kept = [g for g in view.groups.values() if g.status == "final"]
    assert len(kept) == 8 and all(reward_variance(g) > 0 for g in kept)


def test_dynamic_sampling_fills_the_batch_past_one_generation_batch_by_default() -> None:
    """verl's cap is 10 generation batches of 3 x B: a step whose first 40 refills are flat (more
    than one generation batch's 2 x B = 16) still fills, and the default stops at 29 x B refills."""
    rates = {p: 0.0 for p in range(8)} | {p: 0.0 for p in range(1000, 1048)}  # refills are 1008 on
    view = Sim(make_policy(cfg("dynamic-sampling")), 8, 8, 1, bernoulli(rates, seed=3)).run()
    kept = [g for g in view.groups.values() if g.status == "final"]
    assert len(kept) == 8 and all(reward_variance(g) > 0 for g in kept)
    assert sum(1 for g in view.groups.values() if g.added) > 40
    never = Sim(make_policy(cfg("dynamic-sampling")), 8, 8, 1, lambda p, i: 0.0).run()
    assert sum(1 for g in never.groups.values() if g.added) == 29 * 8  # every prompt flat: the cap
    assert not [g for g in never.groups.values() if g.status == "final"]


def test_dynamic_sampling_oversample_keeps_the_first_groups_with_signal_in_plan_order() -> None:
    rates = {p: 0.5 for p in range(12)}
    rates[1] = 0.0  # flat: skipped, so groups 0, 2..8 are the first eight with signal
    rewards = bernoulli(rates, seed=4)
    pol = make_policy(cfg("dynamic-sampling", oversample=1.5, max_refills=0))
    for seed in range(5):  # whatever order the groups complete in
        view = Sim(pol, 8, 8, 1, rewards, seed=seed).run()
        kept = sorted(g.order for g in view.groups.values() if g.status == "final")
        want = (
            [i for i in range(12) if reward_variance(view.groups[f"0:{i}"]) > 0][:8]
            if len(view.groups)
            else []
        )
        assert kept == want, (seed, kept)
        assert len(view.groups) == 12


def test_vigor_never_turns_the_window_on_a_round_waits_for_the_whole_step() -> None:
    """With FGD's window on, groups past the lookahead never start, and a whole-step round would
    wait for them forever (found in the allocation suite: a run stuck at step 39)."""
    from rolloutpipe.errors import ConfigError
    from rolloutpipe.scheduling.base import PrevStep

    pol = make_policy(cfg("vigor", 16, 16, 4))  # the window's default: auto
    prev = PrevStep(0, train_busy_s=10.0, rollout_makespan_s=1.0, first_group_s=0.1)  # training-bound
    for step in (1, 2):
        info = StepInfo(step=step, prompts=list(range(16)), group_size=16, minibatches=4, n_prompts=1000,
                        prev=prev, history={})  # fmt: skip
        pol.plan(info)
        assert pol.window is False
    fgd = make_policy(cfg("fgd", 16, 16, 4))
    fgd.plan(StepInfo(step=1, prompts=list(range(16)), group_size=16, minibatches=4, n_prompts=1000,
                      prev=prev, history={}))  # fmt: skip
    fgd.plan(StepInfo(step=2, prompts=list(range(16)), group_size=16, minibatches=4, n_prompts=1000,
                      prev=prev, history={}))  # fmt: skip
    assert fgd.window is True  # the same timings turn FGD's window on: the test can tell
    with pytest.raises(ConfigError, match="window"):
        make_policy(cfg("vigor", 16, 16, 4, window="on"))
