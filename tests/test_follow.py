"""The control-stream follower (``launch/follow.py``): the StepMetrics of one or several runs, in
order, and a corrupt entry raises CodecError with its stream and id instead of being passed over."""

from __future__ import annotations

import re
import time

import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import GroupPlan, PolicyVersion, StepMetrics, StepPlan
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.errors import CodecError
from rolloutpipe.launch.follow import ControlFollower

GARBAGE = b"\xc1\xc1 not msgpack at all"


def _metrics(run: str, step: int) -> StepMetrics:
    return StepMetrics(run=run, step=step, policy_version=step, mode="cgp", rollout_to_train_end_s=1.0,
                       trainer_wait_ratio=0.5, first_group_s=0.1, reward_mean=step / 10, groups=1, samples=2,
                       tokens=6, fence_rejections=0, dead_letters=0, train_busy_s=0.5,
                       rollout_makespan_s=0.5, last_minibatch_train_s=0.1, dispatch_latency_p50_s=0.1,
                       dispatch_latency_p99_s=0.2, admission_latency_p50_s=0.0)  # fmt: skip


def _plan(run: str, step: int) -> StepPlan:
    return StepPlan(run=run, step=step, policy_version=step, policy="fgd",
                    groups=[GroupPlan(group_id=f"{step}:0", prompt_index=0, n=2)],
                    minibatches=1, groups_per_minibatch=1, created_at=time.time())  # fmt: skip


def _version(run: str, v: int) -> PolicyVersion:
    return PolicyVersion(run=run, step=v, policy_version=v, path="", sha256={}, published_at=time.time())


def _add(sr: redis.Redis, run: str, payload: bytes) -> str:
    eid: bytes = sr.xadd(Keys(run).control, {DATA: payload})  # type: ignore[assignment]
    return eid.decode()


def test_the_follower_yields_each_runs_step_metrics_in_order(sr: redis.Redis, run_name: str) -> None:
    other = run_name + "b"
    ids = []
    for step in range(3):  # the plans and versions between them are passed over
        _add(sr, run_name, DEFAULT_CODEC.encode(_plan(run_name, step)))
        ids.append(_add(sr, run_name, DEFAULT_CODEC.encode(_metrics(run_name, step))))
        _add(sr, run_name, DEFAULT_CODEC.encode(_version(run_name, step + 1)))
        _add(sr, other, DEFAULT_CODEC.encode(_metrics(other, 10 + step)))
    follower = ControlFollower(sr, [run_name])
    got = list(follower.drain())
    assert [(run, m.step, m.reward_mean) for run, m in got] == [(run_name, s, s / 10) for s in range(3)]
    assert all(isinstance(m, StepMetrics) for _run, m in got)
    assert follower.poll(block_ms=None) == [] and follower.poll(block_ms=20) == []  # nothing new
    _add(sr, run_name, DEFAULT_CODEC.encode(_metrics(run_name, 3)))
    assert [m.step for _run, m in follower.poll(block_ms=None)] == [3]  # it goes on from its cursor
    assert follower.poll(block_ms=None) == []

    both = ControlFollower(sr, [run_name, other])  # one XREAD, each metrics with its own run
    steps: dict[str, list[int]] = {run_name: [], other: []}
    for run, m in both.drain():
        assert m.run == run
        steps[run].append(m.step)
    assert steps == {run_name: [0, 1, 2, 3], other: [10, 11, 12]}
    assert [m.step for _run, m in ControlFollower(sr, [run_name]).poll(None, count=2)] == [0]  # plan 0 too
    assert [m.step for _run, m in ControlFollower(sr, [run_name], after=ids[1]).drain()] == [2, 3]


def test_a_corrupt_control_entry_raises_with_its_stream_and_id(sr: redis.Redis, run_name: str) -> None:
    key = Keys(run_name).control
    _add(sr, run_name, DEFAULT_CODEC.encode(_metrics(run_name, 0)))
    bad = _add(sr, run_name, GARBAGE)
    _add(sr, run_name, DEFAULT_CODEC.encode(_metrics(run_name, 1)))
    no_field = sr.xadd(key, {b"x": b"y"}).decode()  # type: ignore[union-attr]
    _add(sr, run_name, DEFAULT_CODEC.encode(_metrics(run_name, 2)))

    follower = ControlFollower(sr, [run_name])
    assert [m.step for _run, m in follower.poll(block_ms=None)] == [0]  # what came before the bad one
    with pytest.raises(CodecError, match=re.escape(f"{key} entry {bad}: not msgpack")):
        follower.poll(block_ms=None)
    assert [m.step for _run, m in follower.poll(block_ms=None)] == [1]  # read on past it, if one will
    with pytest.raises(CodecError, match=re.escape(f"{key} entry {no_field}: no 'd' field")):
        follower.poll(block_ms=None)
    assert [m.step for _run, m in follower.poll(block_ms=None)] == [2]

    with pytest.raises(CodecError, match=re.escape(f"{key} entry {bad}")):  # drain does not skip it
        list(ControlFollower(sr, [run_name]).drain())
