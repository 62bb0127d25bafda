"""The cluster driver: start a run's roles as real processes, follow it, kill and respawn roles.

``Driver`` follows a run like ``run_cluster`` does but lets a test act in between;
``assert_exactly_once`` checks a finished run's streams and metrics (every group once, nothing lost).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import Group, StepMetrics
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.config import Config
from rolloutpipe.launch.cluster import Cluster, RoleProc, tail
from tests.support.helpers import version


class Driver:
    """Follows a run like ``run_cluster`` does, but lets a test kill and respawn roles in between."""

    def __init__(self, cluster: Cluster, sr: redis.Redis) -> None:
        self.cluster = cluster
        self.sr = sr
        self.keys = Keys(cluster.cfg.run)
        self.killed: set[int] = set()  # pids this test killed on purpose
        self.metrics: list[StepMetrics] = []
        self._last = "0-0"

    def check_alive(self) -> None:
        for rp in self.cluster.procs:
            code = rp.proc.poll()
            if code not in (None, 0) and rp.proc.pid not in self.killed:
                raise AssertionError(f"role {rp.name} exited with {code}:\n{tail(rp.log_path, 40)}")

    def pump(self, block_ms: int = 20) -> None:
        self.check_alive()
        resp: Any = self.sr.xread({self.keys.control: self._last}, count=100, block=block_ms)
        for _stream, items in resp or []:
            for eid, fields in items:
                self._last = eid.decode()
                ev = DEFAULT_CODEC.decode(fields[DATA])
                if isinstance(ev, StepMetrics):
                    self.metrics.append(ev)

    def until(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; {self.logs()}")
            self.pump()

    def kill(self, rp: RoleProc) -> None:
        self.killed.add(rp.proc.pid)
        os.kill(rp.proc.pid, signal.SIGKILL)
        rp.proc.wait(10)
        time.sleep(0.2)  # let Redis execute whatever the dead process had already sent

    def finish(self, timeout: float) -> None:
        steps = self.cluster.cfg.controller.steps
        self.until(lambda: len(self.metrics) >= steps, timeout, f"{steps} steps of metrics")

    def logs(self) -> str:
        return "\n".join(f"--- {rp.name}:\n{tail(rp.log_path, 15)}" for rp in self.cluster.procs)


def start_cluster(cfg: Config, url: str) -> Cluster:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(cfg, url, out)
    cluster.start()
    return cluster


def stop_cluster(cluster: Cluster, sr: redis.Redis) -> None:
    sr.set(Keys(cluster.cfg.run).done, b"1")
    cluster.stop()


def groups_on_stream(sr: redis.Redis, run: str) -> list[Group]:
    return [DEFAULT_CODEC.decode_as(f[DATA], Group) for _eid, f in sr.xrange(Keys(run).groups)]


def step_groups_emitted(sr: redis.Redis, run: str, step: int) -> int:
    return int(sr.scard(Keys(run).emitted(step)))


def pending_count(sr: redis.Redis, stream: str, group: str, consumer: str | None = None) -> int:
    if consumer is None:
        return int(sr.xpending(stream, group)["pending"])
    return len(sr.xpending_range(stream, group, min="-", max="+", count=10_000, consumername=consumer))


def assert_exactly_once(sr: redis.Redis, cfg: Config, metrics: list[StepMetrics]) -> list[Group]:
    """Every step complete, every group once on the stream and once in the trainer, nothing in dlq."""
    run, cc = cfg.run, cfg.controller
    keys = Keys(run)
    B, G = cc.prompts_per_step, cc.group_size

    # the trainer's view: one StepMetrics per step, each with every group and every sample once
    assert [m.step for m in metrics] == list(range(cc.steps))
    for m in metrics:
        assert (m.groups, m.samples) == (B, B * G), f"step {m.step}: {m.groups} groups / {m.samples} samples"
        trained = [gid for mb in m.minibatches for gid in mb]
        assert sorted(trained) == sorted(f"{m.step}:{g}" for g in range(B)), f"step {m.step}: {m.minibatches}"
        assert m.dead_letters == 0 and m.fence_rejections == 0
    on_disk = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [(d["step"], d["minibatches"]) for d in on_disk] == [(m.step, m.minibatches) for m in metrics]

    # the aggregator's output: each (step, group id) exactly once over the whole groups stream
    groups = groups_on_stream(sr, run)
    counts = Counter((g.step, g.group_id) for g in groups)
    dup = {k: n for k, n in counts.items() if n > 1}
    assert not dup, f"groups emitted more than once: {dup}"
    expected = {(s, f"{s}:{g}") for s in range(cc.steps) for g in range(B)}
    assert set(counts) == expected, f"missing {expected - set(counts)}, unexpected {set(counts) - expected}"
    for g in groups:
        assert sorted(s.sample_index for s in g.samples) == list(range(G)), g.group_id
        assert sorted(s.sample_id for s in g.samples) == sorted(f"{g.group_id}:{i}" for i in range(G))
        assert all(s.group_id == g.group_id and s.step == g.step for s in g.samples)
        assert (g.allocation.initial, g.allocation.status) == (G, "final"), g.allocation
    # per step, frontier positions 0..B-1 each once (a re-emitted or lost group would break this).
    # Exact with one samples shard only: with several, each shard's aggregator numbers its own
    # emissions and ``frontier.position`` is approximate (docs/architecture.md, "One step"); what holds
    # there is the exactly-once of groups, asserted above for every shard count.
    if cfg.redis.sample_shards == 1:
        for s in range(cc.steps):
            assert sorted(g.frontier.position for g in groups if g.step == s) == list(range(B))

    assert sr.xlen(keys.dlq) == 0, [DEFAULT_CODEC.decode(f[DATA]) for _e, f in sr.xrange(keys.dlq)]
    assert int(sr.hget(keys.stats, "dead_letters") or 0) == 0
    assert int(sr.hget(keys.stats, "duplicate_groups") or 0) == 0
    # no request was generated twice (a live worker's request stolen, or a sample re-read as new)
    assert int(sr.hget(keys.stats, "duplicate_samples") or 0) == 0
    return groups


# ------------------------------------------------------------------------ kills at random moments

ROLES = ("controller", "aggregator", "rollout", "trainer")


def reached(sr: redis.Redis, run: str, v: int) -> bool:
    return version(sr, run) >= v


def passed(t: float) -> bool:
    return time.monotonic() >= t


def respawn(d: Driver, rp: RoleProc, n: int) -> RoleProc:
    cluster, cfg = d.cluster, d.cluster.cfg
    role = rp.name.split("-")[0]
    if role == "trainer":
        return cluster.spawn("trainer", f"trainer-r{n}", ["--out", str(cluster.out)])
    if role == "rollout":
        i = rp.name.split("-")[1]
        return cluster.spawn("rollout", f"rollout-{i}-r{n}", ["--worker-id", f"{cfg.run}-w{i}"])
    if role == "aggregator" and (shard := [*rp.name.split("-"), ""][1]).startswith("s"):  # aggregator-s1
        return cluster.spawn(role, f"aggregator-{shard}-r{n}", ["--shard", shard[1:]])
    return cluster.spawn(role, f"{role}-r{n}")
