"""The broker suite's ceiling: what one Redis server and one aggregator can take, with no run around them.

``rolloutpipe bench --suite broker`` (``bench/broker.py``) compares each row's end-to-end rate with
these: one redis-py client pipelining XADDs of a real encoded sample, ``redis-benchmark`` doing the
same with a payload of that size, and one in-process aggregator draining complete groups.  Here
too: a sample's payload and where its bytes go.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
import uuid

import numpy as np
import redis

from rolloutpipe.bench.harness import CONFIGS
from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import AllocationRecord, FrontierStatus, Group, Sample
from rolloutpipe.broker.keys import Groups
from rolloutpipe.config import load_config

# ------------------------------------------------------------------------------------ payloads


def sample_payload(tokens: int, prompt_tokens: int, run: str = "broker-ceiling") -> bytes:
    """One encoded ``Sample`` as the emulated engine's workers publish it (ids + logprobs packed)."""
    rng = np.random.default_rng(0)
    s = Sample(
        run=run, step=0, policy_version=0, sample_id="0-0:0:0", request_id="0-0:0:0", group_id="0:0",
        prompt_index=0, sample_index=0, worker=f"{run}-w0",
        prompt_ids=np.zeros(prompt_tokens, np.int32),
        response_ids=rng.integers(3, 18, size=tokens, dtype=np.int32),
        logprobs=np.log(rng.uniform(0.2, 1.0, size=tokens)).astype(np.float32),
        reward=1.0, admitted_at=time.time(), finished_at=time.time(),
    )  # fmt: skip
    return DEFAULT_CODEC.encode(s)


def bytes_breakdown(tokens: int, prompt_tokens: int, group_size: int) -> dict[str, int]:
    """Where a sample's bytes go: its arrays, its envelope, and its share of the group that re-embeds it."""
    raw = sample_payload(tokens, prompt_tokens)
    s = DEFAULT_CODEC.decode(raw)
    assert isinstance(s, Sample)
    g = Group(
        run=s.run, step=0, policy_version=0, group_id="0:0", prompt_index=0,
        samples=[s] * group_size, advantages=np.zeros(group_size, np.float32),
        frontier=FrontierStatus(minibatch=0, position=0, minibatch_size=1, needed=0, total_groups=1),
        allocation=AllocationRecord(initial=group_size), completed_at=time.time(),
    )  # fmt: skip
    group_bytes = len(DEFAULT_CODEC.encode(g))
    return {
        "sample_bytes": len(raw),
        "response_ids_bytes": 4 * tokens,
        "logprobs_bytes": 4 * tokens,
        "prompt_ids_bytes": 4 * prompt_tokens,
        "envelope_bytes": len(raw) - 8 * tokens - 4 * prompt_tokens,
        "group_bytes_per_sample": group_bytes // group_size,
        # into Redis: the sample's XADD and the group's; out: the aggregator's and the trainer's reads
        "wire_bytes_per_sample": 2 * len(raw) + 2 * (group_bytes // group_size),
    }


# ------------------------------------------------------------------------------------ the ceiling


def ceiling_redis_py(url: str, payload: bytes, seconds: float, pipeline: int) -> float:
    """Samples/s of one redis-py client pipelining ``XADD … MAXLEN ~ 1000 * d payload``."""
    r = redis.Redis.from_url(url)
    key = f"rp:{{broker-ceiling-{uuid.uuid4().hex[:8]}}}:samples"  # a scratch stream of its own
    try:
        r.delete(key)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            p = r.pipeline(transaction=False)
            for _ in range(pipeline):
                p.xadd(key, {b"d": payload}, maxlen=1000, approximate=True)
            p.execute()
            n += pipeline
        return n / (time.perf_counter() - t0)
    finally:
        r.delete(key)
        r.close()


def ceiling_redis_benchmark(url: str, size: int, seconds: float, pipeline: int) -> float | None:
    """``redis-benchmark`` (one client, ``-P pipeline``) XADDing a ``size``-byte field; None if absent."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    kw = redis.Redis.from_url(url).connection_pool.connection_kwargs
    host, port = str(kw.get("host", "127.0.0.1")), int(kw.get("port", 6379))
    auth = ["--user", str(kw["username"])] if kw.get("username") else []
    auth += ["-a", str(kw["password"]), "--no-auth-warning"] if kw.get("password") else []
    key = f"rp:{{broker-rb-{uuid.uuid4().hex[:8]}}}:samples"
    # a first short run sizes the real one to about ``seconds``
    rate = 0.0
    for n in (max(pipeline, 200), 0):
        if n == 0:
            n = max(pipeline, int(rate * seconds))
        cmd = [exe, "-h", host, "-p", str(port), *auth, "-c", "1", "-P", str(pipeline), "-n", str(n),
               "--csv", "XADD", key, "MAXLEN", "~", "1000", "*", "d", "x" * size]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if res.returncode != 0:
            return None
        try:
            rate = float(res.stdout.strip().splitlines()[-1].split('","')[1].strip('"'))
        except (IndexError, ValueError):
            return None
    with contextlib.suppress(redis.RedisError):
        redis.Redis.from_url(url).delete(key)
    return rate


# ------------------------------------------------------------------------------------ one aggregator


def aggregator_capacity(
    url: str, tokens: int, prompt_tokens: int, group_size: int, groups: int
) -> dict[str, float]:
    """What one aggregator process can take: ``groups`` complete groups of real samples are put on
    ``samples`` first, then an in-process ``Aggregator`` drains them (reads, decodes, emits groups
    with the emit script) as fast as it can.  Samples per second of its wall clock and per second
    of its CPU: the second is the one to size from (one aggregator on a core of its own)."""
    return asyncio.run(_drain(url, tokens, prompt_tokens, group_size, groups))


async def _drain(url: str, tokens: int, prompt_tokens: int, group_size: int, groups: int) -> dict[str, float]:
    from rolloutpipe.broker.connect import connect
    from rolloutpipe.broker.events import GroupPlan, PolicyVersion, StepPlan
    from rolloutpipe.broker.keys import DATA
    from rolloutpipe.broker.streams import Broker
    from rolloutpipe.roles.aggregator import Aggregator

    run = f"broker-drain-{uuid.uuid4().hex[:8]}"
    r = connect(url)
    try:
        b = Broker(r, run, "aggregator", maxlen=10 * groups * group_size)
        k = b.keys
        gps = [GroupPlan(group_id=f"0:{g}", prompt_index=g, n=group_size) for g in range(groups)]
        plan = StepPlan(run=run, step=0, policy_version=0, policy="fifo", groups=gps, minibatches=1,
                        groups_per_minibatch=groups, created_at=time.time())  # fmt: skip
        await b.write_plan(plan)
        pv = PolicyVersion(run=run, step=0, policy_version=0, path="", sha256={}, published_at=time.time())
        await b.publish_version(pv, None)
        await b.ensure_group(k.samples, Groups.AGGREGATOR)
        rng = np.random.default_rng(0)
        for i in range(group_size):  # interleaved across groups, as many workers publish them
            pipe = r.pipeline(transaction=False)
            for g in range(groups):
                s = Sample(
                    run=run, step=0, policy_version=0, sample_id=f"{g}:{i}", request_id=f"{g}:{i}",
                    group_id=f"0:{g}", prompt_index=g, sample_index=i, worker="w0",
                    prompt_ids=np.zeros(prompt_tokens, np.int32),
                    response_ids=rng.integers(3, 18, size=tokens, dtype=np.int32),
                    logprobs=np.log(rng.uniform(0.2, 1.0, size=tokens)).astype(np.float32),
                    reward=float(rng.random() < 0.5), admitted_at=1.0, finished_at=2.0,
                )  # fmt: skip
                pipe.xadd(k.samples, {DATA: DEFAULT_CODEC.encode(s)})
            await pipe.execute()
        cfg = load_config(CONFIGS / "bench-quick.yaml", [f"run={run}", "out=/nonexistent"], environ={})
        agg = Aggregator(cfg, b, "drain-0")
        t0, c0 = time.perf_counter(), time.process_time()
        while agg.groups_emitted < groups:
            await agg.on_batch(await b.read(k.samples, Groups.AGGREGATOR, "drain-0", count=256, block_ms=10))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = groups * group_size
        return {"aggregator_samples_per_s": n / wall, "aggregator_samples_per_cpu_s": n / max(cpu, 1e-9)}
    finally:
        keys = [x async for x in r.scan_iter(match=f"rp:{{{run}}}:*", count=1000)]
        if keys:
            await r.unlink(*keys)
        await r.aclose()
