"""VIGOR, Pilot-Commit and dynamic sampling decide from scripted rewards: no Redis, no asyncio.

``Sim`` plays the controller's part as the seam defines it (``scheduling/base.py``): it completes
every outstanding sample of a group at once, with rewards from a script, reports the group to
``on_stats``, and applies the decisions to the view.  Groups complete in a shuffled order, so no
test depends on which group reports first.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from rolloutpipe.config import ControllerConfig
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
            if ext:
                mb = self.view.groups[next(iter(ext))].minibatch
                peers = [x for x in self.view.groups.values() if x.minibatch == mb and x.status == "open"]
                self.rounds.append(
                    ([reward_variance(x) for x in peers if x.group_id in ext],
                     [reward_variance(x) for x in peers if x.group_id not in ext])
                )  # fmt: skip
            for d in decisions:
                self.apply(d)
        stuck = [g.group_id for g in self.view.groups.values() if g.status == "open"]
        assert not stuck, f"groups left open: {stuck}"
        return self.view

    def apply(self, d: Decision) -> None:
        self.log.append(d)
        if isinstance(d, AddGroup):
            assert d.prompt_index is None
            self.add(1000 + len(self.view.groups), d.n, d.final, added=True)
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
def test_vigor_never_exceeds_its_budget_and_ranks_by_variance(seed: int) -> None:
    rng = random.Random(seed)
    b, g, mb = rng.choice([(8, 8, 1), (8, 8, 2), (16, 16, 4), (6, 4, 3)])
    budget = rng.choice([g, g * 0.75, g * 1.5])
    n0 = rng.choice([2, max(2, g // 4)])
    pol = make_policy(cfg("vigor", b, g, mb, n0=n0, budget=budget, round=rng.choice([1, 2, n0]),
                          top_frac=rng.choice([0.25, 0.5, 1.0])))  # fmt: skip
    rates = {p: rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]) for p in range(b)}
    sim = Sim(pol, b, g, mb, bernoulli(rates, seed), seed)
    view = sim.run()
    gpm = b // mb
    for j in range(mb):
        members = [x for x in view.groups.values() if x.minibatch == j]
        assert sum(x.target for x in members) <= max(gpm * n0, int(gpm * budget)), (
            j,
            [x.target for x in members],
        )
    # every round's extras went to groups whose variance, when chosen, was at least that of every
    # open group of the mini-batch left out of that round, and never to a group without variance
    for chosen, left_out in sim.rounds:
        assert min(chosen) > 0 and min(chosen) >= max(left_out, default=0.0), (chosen, left_out)
    assert all(x.status == "final" for x in view.groups.values())


def test_vigor_groups_of_one_minibatch_never_wait_for_a_later_one() -> None:
    """Rounds are per mini-batch: mini-batch 0 becomes final while mini-batch 1 has not reported."""
    pol = make_policy(cfg("vigor", 4, 8, 2, n0=2, round=2))
    sim = Sim(pol, 4, 8, 2, bernoulli({0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, seed=1))
    g0, g1 = sim.view.groups["0:0"], sim.view.groups["0:1"]
    rounds = 0
    while any(g.status == "open" for g in (g0, g1)) and rounds < 50:  # only mini-batch 0 reports
        for g in (g0, g1):
            if g.status == "open" and g.completed < g.target:
                g.completed = g.target
                g.rewards = np.asarray([sim.rewards(g.prompt_index, i) for i in range(g.target)], np.float32)
                for d in pol.on_stats(sim.view, g):
                    sim.apply(d)
        rounds += 1
    assert g0.status == g1.status == "final"
    assert sim.view.groups["0:2"].completed == 0  # mini-batch 1 never reported


# ------------------------------------------------------------------------------------ Pilot-Commit


def test_pilot_commit_skips_exactly_the_pilots_without_signal() -> None:
    rates = {0: 0.0, 1: 1.0, 2: 0.5, 3: 0.5, 4: 0.0, 5: 0.5, 6: 1.0, 7: 0.5}
    rewards = bernoulli(rates, seed=7)
    pol = make_policy(cfg("pilot-commit", n_pilot=4))
    view = Sim(pol, 8, 8, 1, rewards).run()
    for g in view.groups.values():
        pilot = [rewards(g.prompt_index, i) for i in range(4)]
        flat = min(pilot) == max(pilot)
        if flat:
            assert g.status == "skipped" and g.target == 4, g
        else:
            assert g.status == "final" and g.target == 8 and g.counts == [4, 8], g
    assert any(g.status == "skipped" for g in view.groups.values())
    assert any(g.status == "final" for g in view.groups.values())


@pytest.mark.parametrize("commit_frac", [1.0, 0.5])
def test_pilot_commit_groups_of_one_minibatch_never_wait_for_a_later_ones_pilot(commit_frac: float) -> None:
    """Mini-batch 0's groups are decided (committed or skipped) while mini-batch 1's pilots have not
    reported at all: a frontier group never waits on a pilot of a later group."""
    rates = {0: 0.5, 1: 0.0, 2: 0.5, 3: 1.0}
    pol = make_policy(cfg("pilot-commit", 8, 8, 2, n_pilot=4, commit_frac=commit_frac))
    sim = Sim(pol, 8, 8, 2, bernoulli(rates, seed=3))
    first = [sim.view.groups[f"0:{i}"] for i in range(4)]
    for g in first:  # only mini-batch 0 reports its pilots
        g.completed = g.target
        g.rewards = np.asarray([sim.rewards(g.prompt_index, i) for i in range(g.target)], np.float32)
        for d in pol.on_stats(sim.view, g):
            sim.apply(d)
    assert all(g.status in ("final", "skipped") for g in first), [g.status for g in first]
    assert any(g.status == "final" for g in first) and any(g.status == "skipped" for g in first)
    assert all(sim.view.groups[f"0:{i}"].completed == 0 for i in range(4, 8))


@pytest.mark.parametrize("policy", ["pilot-commit", "vigor"])
def test_extra_rollouts_of_frontier_groups_are_admitted_before_later_pilots(policy: str) -> None:
    """Once a frontier group is extended, free slots go to its extras before any pilot of a group of
    a later mini-batch, whatever the plan order of the released groups."""
    pol = make_policy(cfg(policy, 8, 8, 2, **({"n_pilot": 4} if policy == "pilot-commit" else {"n0": 4})))
    sim = Sim(pol, 8, 8, 2, bernoulli({p: 0.5 for p in range(8)}, seed=11))
    first = pol.admit(sim.view, 16)
    assert {r.group_id for r in first} == {"0:0", "0:1", "0:2", "0:3"}  # the frontier's pilots first
    for r in first:
        sim.view.groups[r.group_id].released += r.n
    for g in [sim.view.groups[f"0:{i}"] for i in range(4)]:
        g.completed = g.target
        g.rewards = np.asarray([1.0, 0.0, 1.0, 0.0], np.float32)  # signal everywhere
        for d in pol.on_stats(sim.view, g):
            sim.apply(d)
    extended = [g for g in sim.view.groups.values() if g.minibatch == 0 and g.unreleased > 0]
    assert extended, "no frontier group was extended"
    out = pol.admit(sim.view, 4)
    assert out and all(sim.view.groups[r.group_id].minibatch == 0 for r in out), out
    assert sum(r.n for r in out) == 4


def test_pilot_commit_pass_rate_band_and_commit_share() -> None:
    rates = {p: 0.5 for p in range(8)}
    rewards = bernoulli(rates, seed=11)
    # a band that excludes every pilot: everything skipped
    pol = make_policy(cfg("pilot-commit", n_pilot=4, min_pass_rate=0.9))
    assert all(g.status == "skipped" for g in Sim(pol, 8, 8, 1, rewards).run().groups.values())
    # only half the mini-batch may commit: the highest pilot variances, the rest skipped
    pol = make_policy(cfg("pilot-commit", 8, 8, 2, n_pilot=4, commit_frac=0.5))
    view = Sim(pol, 8, 8, 2, rewards).run()
    for j in range(2):
        members = [g for g in view.groups.values() if g.minibatch == j]
        committed = [g for g in members if g.status == "final"]
        assert len(committed) <= 2
        pilots = {g.group_id: np.var([rewards(g.prompt_index, i) for i in range(4)], ddof=1) for g in members}
        for g in members:
            if g.status == "skipped":
                assert all(pilots[g.group_id] <= pilots[c.group_id] for c in committed)


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
