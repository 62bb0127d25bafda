"""Several runs on one shared rollout pool, as real processes: what ``bench --suite multiplex`` and
the pool's tests start.

Each run gets its own controller, aggregator and trainer (its own config, keys, versions and
fence); the pool gets its scheduler (``rolloutpipe pool``) and its workers (``rolloutpipe rollout
--pool NAME``).  :func:`run_pool` follows every run's ``control`` stream until each has trained
``controller.steps`` steps, reads the pool's heartbeats (engine busy time) and lease log, and
stops everything.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.connect import connect_sync
from rolloutpipe.broker.events import Lease, StepMetrics
from rolloutpipe.broker.keys import DATA, Keys, pool_keys
from rolloutpipe.config import Config
from rolloutpipe.errors import CodecError, RoleError
from rolloutpipe.launch.cluster import Cluster, tail
from rolloutpipe.launch.follow import ControlFollower

log = logging.getLogger("rolloutpipe.run")


@dataclass
class PoolRun:
    """What one multiplexed run of several runs produced."""

    metrics: dict[str, list[StepMetrics]]  # run -> its steps' metrics, in order
    leases: list[Lease]  # the pool's lease log
    busy_s: dict[str, float]  # pool worker -> seconds its engine had a sequence running
    switch_s: dict[str, float]  # pool worker -> seconds it spent loading another run's weights
    started: float  # unix time the processes were started
    ended: float  # unix time the last run's last step ended
    stats: dict[str, dict[str, int]] = field(default_factory=dict)  # run -> its stats counters


def start_pool(
    cfgs: list[Config], url: str, out: Path, pool: str, workers: int, *, launcher: list[str] | None = None
) -> tuple[list[Cluster], Cluster]:
    """Every run's roles but rollout (each in its ``cfg.out``; one aggregator a samples shard), then
    the pool's scheduler and ``workers`` pool workers (logs in ``out/pool-NAME``)."""
    clusters = []
    for cfg in cfgs:
        o = Path(cfg.out)  # the run's own: its trainer's metrics.jsonl and weights
        o.mkdir(parents=True, exist_ok=True)
        c = Cluster(cfg, url, o)
        cfg.dump_yaml(o / "config.yaml")
        c.spawn("trainer", "trainer", ["--out", str(o)])
        shards = cfg.redis.sample_shards
        if shards == 1:
            c.spawn("aggregator", "aggregator")
        for i in range(shards if shards > 1 else 0):  # one aggregator a samples shard, as ``Cluster``
            c.spawn("aggregator", f"aggregator-s{i}", ["--shard", str(i)])
        c.spawn("controller", "controller")
        clusters.append(c)
    po = out / f"pool-{pool}"
    po.mkdir(parents=True, exist_ok=True)
    pc = Cluster(cfgs[0], url, po)
    cfgs[0].dump_yaml(po / "config.yaml")
    runs = ",".join(c.run for c in cfgs)
    pc.spawn("pool", "pool", ["--pool", pool, "--runs", runs])
    for i in range(workers):
        pc.spawn(
            "rollout", f"rollout-{i}", ["--pool", pool, "--worker-id", f"{pool}-w{i}"], launcher=launcher
        )
    return clusters, pc


def stop_pool(clusters: list[Cluster], pc: Cluster, url: str) -> None:
    r = connect_sync(url)
    try:
        for c in clusters:
            r.set(Keys(c.cfg.run).done, b"1")
    finally:
        r.close()
    pc.stop()
    for c in clusters:
        c.stop()


def run_pool(
    cfgs: list[Config], url: str, out: Path, pool: str, workers: int, timeout_s: float = 1800.0
) -> PoolRun:
    """Run ``cfgs`` (their ``rollout.pool`` settings included) on one pool of ``workers`` workers."""
    r = connect_sync(url)
    started = time.time()
    clusters, pc = start_pool(cfgs, url, out, pool, workers)
    metrics: dict[str, list[StepMetrics]] = {c.run: [] for c in cfgs}
    follower = ControlFollower(r, [c.run for c in cfgs])
    pk = pool_keys(pool)
    busy: dict[str, float] = {}
    switch: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while any(len(metrics[c.run]) < c.controller.steps for c in cfgs):
            for cl in [*clusters, pc]:
                bad = cl.failed()
                if bad is not None:
                    raise RoleError(
                        f"role {bad.name} exited with {bad.proc.returncode}:\n{tail(bad.log_path)}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the runs on pool {pool} did not finish in {timeout_s:.0f}s")
            try:
                for run, ev in follower.poll(block_ms=100):
                    metrics[run].append(ev)
            except CodecError as e:  # its controller dead-letters a bad control entry; read on
                log.warning("%s (skipped)", e)
            for wid, hb in _heartbeats(r, pk):  # the latest engine busy time of each pool worker
                busy[wid] = float(hb.get("busy_s", 0.0))
                switch[wid] = float(hb.get("switch_s", 0.0))
        ended = max(m.train_end for ms in metrics.values() for m in ms)
        entries: Any = r.xrange(pk.leases)
        leases = [DEFAULT_CODEC.decode_as(f[DATA], Lease) for _e, f in entries]
        stats = {}
        for c in cfgs:
            counters: Any = r.hgetall(Keys(c.run).stats)
            stats[c.run] = {k.decode(): int(v) for k, v in counters.items()}
    finally:
        stop_pool(clusters, pc, url)
        r.close()
    return PoolRun(metrics, leases, busy, switch, started, ended, stats)


def _heartbeats(r: Any, pk: Keys) -> list[tuple[str, dict[str, Any]]]:
    from rolloutpipe.broker.state import live_heartbeats_sync

    out = []
    for wid, raw, _ttl in live_heartbeats_sync(r, pk):
        try:
            out.append((wid, json.loads(raw)))
        except ValueError:
            continue
    return out
