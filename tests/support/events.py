"""Event factories the tests share: one valid event of each kind, and small groups and samples.

Each set is pinned by the tests that use it: ``make_*`` (every field set, odd values: the codec's
round trips), ``step_sample`` (fixed arrays: the aggregator and dead-letter tests), the lost-replies
set (``sample``/``group``… of a run, at a step, with a group id: the per-write cases of
``writes.py``), ``tiny_sample``/``tiny_group`` (the wire doc's bytes), and ``engine_request`` (one
request a bare engine decodes: the KV-cache tests).
"""

from __future__ import annotations

import time

import numpy as np

from rolloutpipe.broker.events import (
    Allocation,
    AllocationRecord,
    DeadLetter,
    FrontierStatus,
    Group,
    GroupPlan,
    GroupStats,
    PolicyVersion,
    RolloutRequest,
    Sample,
    StepMetrics,
    StepPlan,
    StepSeal,
)

# ------------------------------------------------------------------- one of each kind, every field set

RUN = "codec-run"


def make_request() -> RolloutRequest:
    return RolloutRequest(
        run=RUN, step=3, policy_version=3, request_id="3:1:2", group_id="3:1", prompt_index=17,
        sample_index=2, prompt="7+5=", answer="2", seed=12345, max_new_tokens=8,
        temperature=0.7, minibatch_hint=1, queue_share_of=32, released_at=1700000000.25,
    )  # fmt: skip


def make_sample(i: int = 0, n_resp: int = 5) -> Sample:
    rng = np.random.default_rng(i)
    return Sample(
        run=RUN, step=3, policy_version=3, sample_id=f"3:1:{i}", request_id=f"3:1:{i}", group_id="3:1",
        prompt_index=17, sample_index=i, worker="w0",
        prompt_ids=np.array([1, 2, 3, 2**31 - 1, -(2**31)], dtype=np.int32),
        response_ids=rng.integers(0, 50_000, size=n_resp, dtype=np.int32),
        logprobs=rng.normal(size=n_resp).astype(np.float32) - 3.0,
        reward=float(i % 2), finish_reason="length", admitted_at=10.5, finished_at=11.75,
    )  # fmt: skip


def make_group() -> Group:
    samples = [make_sample(i, n_resp=3 + i) for i in range(4)]
    return Group(
        run=RUN, step=3, policy_version=3, group_id="3:1", prompt_index=17, samples=samples,
        advantages=np.array([-1.0, 1.0, -1.0, 1.0], dtype=np.float32),
        frontier=FrontierStatus(minibatch=0, position=1, minibatch_size=4, needed=2, total_groups=8),
        allocation=AllocationRecord(initial=6, counts=[6, 4], status="closed", reason="enough signal"),
        completed_at=12.0,
    )  # fmt: skip


def make_plan() -> StepPlan:
    return StepPlan(
        run=RUN, step=3, policy_version=3, policy="fgd",
        groups=[GroupPlan(group_id=f"3:{g}", prompt_index=24 + g, n=4, final=g % 2 == 0) for g in range(8)],
        minibatches=2, groups_per_minibatch=4, sealed=False, created_at=9.0,
    )  # fmt: skip


def make_allocation() -> Allocation:
    return Allocation(
        run=RUN, step=3, policy_version=3, group_id="3:1", prompt_index=25, n=8, final=False,
        status="open", reason="extend: mixed rewards", initial=4, counts=[4, 8], revision=1, minibatch_hint=1,
        created_at=9.5,
    )  # fmt: skip


def make_seal() -> StepSeal:
    return StepSeal(run=RUN, step=3, policy_version=3, n_groups=7, skipped=["3:5"], created_at=10.0)


def make_group_stats() -> GroupStats:
    return GroupStats(
        run=RUN, step=3, policy_version=3, group_id="3:1", prompt_index=25, n=4,
        rewards=np.array([0.0, 1.0, 1.0, 0.0], dtype=np.float32),
        lengths=np.array([3, 9, 2**31 - 1, 0], dtype=np.int32),
        truncated=1, emitted=False, created_at=11.0,
    )  # fmt: skip


def make_version() -> PolicyVersion:
    return PolicyVersion(
        run=RUN, step=4, policy_version=4, path="/tmp/weights/v000004",
        sha256={"model.safetensors": "ab" * 32, "config.json": "cd" * 32}, published_at=13.0,
    )  # fmt: skip


def make_metrics() -> StepMetrics:
    return StepMetrics(
        run=RUN, step=3, policy_version=3, mode="cgp", rollout_to_train_end_s=1.5, trainer_wait_ratio=0.25,
        first_group_s=0.125, reward_mean=0.5, groups=8, samples=32, tokens=640, fence_rejections=1,
        dead_letters=2, train_busy_s=1.0, rollout_makespan_s=1.25, last_minibatch_train_s=0.5,
        last_group_train_s=0.1, dispatch_latency_p50_s=0.01, dispatch_latency_p99_s=0.05,
        minibatches=[["3:0", "3:1"], ["3:2", "3:3"]], step_start=100.0, train_end=101.5,
    )  # fmt: skip


def make_dead_letter() -> DeadLetter:
    return DeadLetter(
        run=RUN, step=-1, policy_version=-1, source_stream="rp:{x}:samples", entry_id="1-0",
        role="aggregator", reason="decode: not msgpack", payload=b"\x00\xffgarbage\xc1", created_at=14.0,
    )  # fmt: skip


# ------------------------------------------------------------------ a sample of a step, fixed arrays


def step_sample(
    run: str,
    step: int,
    gid: str,
    i: int,
    *,
    sample_id: str | None = None,
    prompt_index: int = 0,
    worker: str = "w0",
    n_resp: int = 8,
    reward: float = 1.0,
) -> Sample:
    """Sample ``i`` of group ``gid`` at ``step`` (policy version ``step``): prompt ``arange(5)``,
    ``n_resp`` response tokens at logprob -0.5, admitted at 1.0 and finished at 2.0; its sample and
    request id are ``sample_id`` or ``gid:i``."""
    sid = sample_id or f"{gid}:{i}"
    return Sample(
        run=run, step=step, policy_version=step, sample_id=sid, request_id=sid, group_id=gid,
        prompt_index=prompt_index, sample_index=i, worker=worker, prompt_ids=np.arange(5, dtype=np.int32),
        response_ids=np.arange(n_resp, dtype=np.int32), logprobs=np.full(n_resp, -0.5, dtype=np.float32),
        reward=reward, admitted_at=1.0, finished_at=2.0,
    )  # fmt: skip


# ------------------------------------------------------------------ a run's events, lost-replies set


def now() -> float:
    return time.time()


def request(run: str, step: int = 0, gid: str = "0:0", s: int = 0) -> RolloutRequest:
    return RolloutRequest(run=run, step=step, policy_version=step, request_id=f"{gid}:{s}", group_id=gid,
                          prompt_index=0, sample_index=s, prompt="1+1=", answer="2", seed=s,
                          max_new_tokens=4, released_at=now())  # fmt: skip


def sample(run: str, step: int = 0, gid: str = "0:0", s: int = 0) -> Sample:
    return Sample(
        run=run, step=step, policy_version=step, sample_id=f"{gid}:{s}", request_id=f"{gid}:{s}",
        group_id=gid, prompt_index=0, sample_index=s, worker="w", prompt_ids=np.zeros(2, np.int32),
        response_ids=np.arange(3, dtype=np.int32), logprobs=np.full(3, -0.5, np.float32),
        reward=float(s % 2), admitted_at=now(), finished_at=now(),
    )  # fmt: skip


def plan(run: str, step: int = 0) -> StepPlan:
    return StepPlan(run=run, step=step, policy_version=step, policy="fifo",
                    groups=[GroupPlan(group_id=f"{step}:0", prompt_index=0, n=2)], minibatches=1,
                    groups_per_minibatch=1, created_at=now())  # fmt: skip


def version(run: str, v: int) -> PolicyVersion:
    return PolicyVersion(run=run, step=v, policy_version=v, path="", sha256={}, published_at=now())


def step_metrics(run: str, step: int) -> StepMetrics:
    return StepMetrics(run=run, step=step, policy_version=step, mode="cgp", rollout_to_train_end_s=1.0,
                       trainer_wait_ratio=0.5, first_group_s=0.1, reward_mean=0.5, groups=1, samples=2,
                       tokens=6, fence_rejections=0, dead_letters=0, train_busy_s=0.5,
                       rollout_makespan_s=0.5, last_minibatch_train_s=0.1, dispatch_latency_p50_s=0.1,
                       dispatch_latency_p99_s=0.2, admission_latency_p50_s=0.0)  # fmt: skip


def stats(run: str, step: int = 0, gid: str = "0:0", emitted: bool = False) -> GroupStats:
    return GroupStats(run=run, step=step, policy_version=step, group_id=gid, prompt_index=0, n=2,
                      rewards=np.zeros(2, np.float32), lengths=np.full(2, 3, np.int32), truncated=0,
                      emitted=emitted, created_at=now())  # fmt: skip


def group(run: str, step: int = 0, gid: str = "0:0") -> Group:
    return Group(run=run, step=step, policy_version=step, group_id=gid, prompt_index=0,
                 samples=[sample(run, step, gid, s) for s in range(2)],
                 advantages=np.zeros(2, np.float32),
                 frontier=FrontierStatus(minibatch=0, position=0, minibatch_size=1, needed=0,
                                         total_groups=1),
                 allocation=AllocationRecord(initial=2, counts=[2]), completed_at=now())  # fmt: skip


# ---------------------------------------------------------------- what the wire doc shows


def tiny_sample() -> Sample:
    """The sample ``docs/architecture.md`` shows on the wire (a token id above 65535, a negative one)."""
    return Sample(
        run="r", step=1, policy_version=1, sample_id="1:0:0", request_id="1:0:0", group_id="1:0",
        prompt_index=0, sample_index=0, worker="w", prompt_ids=np.asarray([1, 2, 70000]),
        response_ids=np.asarray([-1, 5]), logprobs=np.asarray([-0.5, -1.25]), reward=1.0,
        admitted_at=1.0, finished_at=2.0,
    )  # fmt: skip


def tiny_group() -> Group:
    """A group of that one sample."""
    return Group(
        run="r", step=1, policy_version=1, group_id="1:0", prompt_index=0, samples=[tiny_sample()],
        advantages=np.asarray([0.75]), completed_at=3.0,
        frontier=FrontierStatus(minibatch=0, position=0, minibatch_size=1, needed=0, total_groups=1),
        allocation=AllocationRecord(initial=1, counts=[1]),
    )  # fmt: skip


# ------------------------------------------------------------------- a request for a bare engine


def engine_request(i: int, priority: int = 0) -> RolloutRequest:
    """Request ``i`` of group ``0:i`` at step 0 (its trajectory is a function of its id)."""
    return RolloutRequest(run="t", step=0, policy_version=0, request_id=f"0:{i}:0", group_id=f"0:{i}",
                          prompt_index=i, sample_index=0, prompt="1+1=", answer="2", seed=i,
                          max_new_tokens=64, priority=priority, released_at=time.time())  # fmt: skip
