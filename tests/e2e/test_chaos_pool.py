"""Chaos across a shared pool: two runs on one pool of workers, with long-tail migration and two
samples shards, while a seeded RNG SIGKILLs every kind of process, and Redis itself once.

Killed at random moments and restarted at once (the same command line: a pool worker under its old
id, an aggregator on its shard, a trainer from its checkpoint): pool workers (one of them mid-hand-
back, i.e. while a lease change is handing its running requests back to the run it leaves:
``tests/support/handback_faults.py``), the pool scheduler, each run's controller, trainer and two
aggregators (one a shard), and redis-server (AOF on, ``appendfsync always``; started again from its
AOF on the same port after a pause, as ``test_durability`` does).

The audit, for each run, reads its trainer's committed-group log (``OUT/groups.msgpack``) and its
streams and keys (``redis.trim=false``: nothing is trimmed): every planned group trained exactly
once, whole and of its own run's step's version; no sample in two groups; every step finished once;
nothing pending in any consumer group; no dead letter, fence rejection or duplicate.

Seeds: ``RP_CHAOS_SEED=N`` replays one; ``RP_CHAOS_SEEDS=a,b,c`` runs those; by default the three
of ``DEFAULT_SEEDS`` (about 50 s each on an idle 2-core machine, so under 5 minutes in CI).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.connect import connect_sync
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.broker.keys import Groups, Keys, pool_keys
from rolloutpipe.config import Config
from rolloutpipe.launch.cluster import Cluster, RoleProc, tail
from rolloutpipe.launch.follow import ControlFollower
from rolloutpipe.launch.pool import start_pool, stop_pool
from tests.support.cluster import groups_on_stream
from tests.support.config import EMULATED_FAST, ROOT, make_config
from tests.support.helpers import audit_group_log, version

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6
WORKERS = 3
SHARDS = 2
EXTRA_KILLS = 4
KILLS_S = 300  # the kills' phase takes ~40 s on an idle 2-core machine
DEFAULT_SEEDS = (1, 2, 3)
OVERRIDES = (
    *EMULATED_FAST,
    # a rollout lasts ~0.5-1 s, then the run trains with its engines idle (sync): the pool lends them
    "rollout.emulated.time_scale=0.1",
    "rollout.emulated.switch_s=0.5",
    "rollout.emulated.length_sigma=1.2",  # a long tail: the idle workers take it over (migration)
    "rollout.emulated.length_prompt_share=0",
    "rollout.migration.enabled=true",
    "rollout.migration.check_s=0.05",
    "rollout.migration.min_run_s=0.05",
    "rollout.claim_idle_s=1.5",
    "controller.mode=sync",
    f"controller.steps={STEPS}",
    f"redis.sample_shards={SHARDS}",
    "redis.trim=false",
    "trainer.record_groups=true",
)


def _seeds() -> list[int]:
    if one := os.environ.get("RP_CHAOS_SEED"):
        return [int(one)]
    if many := os.environ.get("RP_CHAOS_SEEDS"):
        return [int(s) for s in many.split(",") if s.strip()]
    return list(DEFAULT_SEEDS)


@dataclass
class Kill:
    """One planned kill: ``what`` (``rollout``, ``handback``, ``pool``, ``redis``, or a run's
    ``controller``, ``trainer``, ``aggregator-sI``) once ``run``'s version (every run's, for the
    pool's kills) reaches ``target``, ``delay`` seconds later; ``pick`` chooses the pool worker."""

    what: str
    run: str  # "" for the pool's processes and Redis
    target: int
    delay: float
    pick: int

    @property
    def name(self) -> str:
        return f"{self.run}/{self.what}" if self.run else self.what


def plan_kills(rng: random.Random, runs: list[str]) -> list[Kill]:
    """Every kind of process at least once (each run's roles, each shard), plus ``EXTRA_KILLS``."""
    per_run = ["controller", "trainer", *(f"aggregator-s{i}" for i in range(SHARDS))]
    want = [("rollout", ""), ("handback", ""), ("pool", ""), ("redis", "")]
    want += [(w, run) for run in runs for w in per_run]
    for _ in range(EXTRA_KILLS):
        what = rng.choice(["rollout", "pool", *per_run])
        want.append((what, "" if what in ("rollout", "pool") else rng.choice(runs)))
    rng.shuffle(want)
    kills = []
    for what, run in want:
        # never in the last step (a kill there may land after the run ended); the hand-back kill early,
        # so that a lease change with requests running follows it
        top = STEPS // 2 if what == "handback" else STEPS - 1
        kills.append(Kill(what, run, rng.randrange(0, top), rng.uniform(0.0, 0.8), rng.randrange(WORKERS)))
    return kills


def _cfgs(tmp_path: Path, run_name: str, pool: str) -> list[Config]:
    """Two runs; the second trains 1.5 times longer, so their phases drift apart and the pool moves
    workers between them (two identical runs stay in step)."""
    runs = [f"{run_name}a", f"{run_name}b"]
    pool_over = [f"rollout.pool.name={pool}", f"rollout.pool.runs={json.dumps(runs)}"]
    return [
        make_config(tmp_path / r, r, *OVERRIDES, *pool_over, f"trainer.emulated.time_scale={1.0 + 0.5 * i}")
        for i, r in enumerate(runs)
    ]


class Chaos:
    """The processes of the pooled runs, the kills and respawns, and the runs' control streams."""

    def __init__(self, er: EmbeddedRedis, sr: redis.Redis, cfgs: list[Config], faults: Path) -> None:
        self.er, self.sr, self.cfgs, self.faults = er, sr, cfgs, faults
        self.runs = [c.run for c in cfgs]
        self.clusters: list[Cluster] = []
        self.pc: Cluster | None = None
        self.killed: set[int] = set()
        self.kills: Counter[str] = Counter()
        self.metrics: dict[str, list[StepMetrics]] = {run: [] for run in self.runs}
        self.follower = ControlFollower(sr, self.runs)
        self.t0 = time.monotonic()
        self.handback_fired = ""

    def start(self, out: Path, pool: str) -> None:
        launcher = [str(ROOT / "tests" / "support" / "handback_faults.py"), str(self.faults)]
        self.clusters, self.pc = start_pool(self.cfgs, self.er.url, out, pool, WORKERS, launcher=launcher)

    def procs(self) -> list[RoleProc]:
        return [rp for c in self.clusters for rp in c.procs] + (self.pc.procs if self.pc else [])

    def proc(self, run: str, name: str) -> RoleProc:
        if not run:
            assert self.pc is not None
            return next(rp for rp in self.pc.procs if rp.name == name)
        c = next(c for c in self.clusters if c.cfg.run == run)
        return next(rp for rp in c.procs if rp.name == name)

    def cluster_of(self, rp: RoleProc) -> Cluster:
        return next(c for c in [*self.clusters, self.pc] if c is not None and rp in c.procs)

    def versions(self) -> dict[str, int]:
        return {run: version(self.sr, run) for run in self.runs}

    def pump(self) -> None:
        """Fail on a process that died unplanned (the hand-back fault's victim is counted and
        respawned) or on a dead letter; read new StepMetrics."""
        for rp in self.procs():
            code = rp.proc.poll()
            if code in (None, 0) or rp.proc.pid in self.killed:
                continue
            fired = self.faults / "fired"
            planted = code == -signal.SIGKILL and rp.name.startswith("rollout") and fired.exists()
            if planted and not self.handback_fired:  # the planted kill, mid-hand-back
                self.handback_fired = fired.read_text()
                self.killed.add(rp.proc.pid)
                self.kills["rollout mid-hand-back"] += 1
                self.log(f"{rp.name} (pid {rp.proc.pid}) killed itself mid-hand-back: {self.handback_fired}")
                self.cluster_of(rp).respawn(rp)
                continue
            raise AssertionError(f"{rp.name} exited with {code}:\n{tail(rp.log_path, 40)}")
        for run in self.runs:  # a dead letter stalls its step; the audit forbids one: fail now, with it
            if dlq := self.sr.xrange(Keys(run).dlq, count=3):
                letters = [DEFAULT_CODEC.decode(f[b"d"]) for _e, f in dlq]
                raise AssertionError(f"{run} dead-lettered: {letters}")
        for run, m in self.follower.poll(block_ms=20):
            self.metrics[run].append(m)

    def until(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {rp.name}:\n{tail(rp.log_path, 12)}" for rp in self.procs())
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; {logs}")
            self.pump()

    def log(self, msg: str) -> None:
        print(f"t={time.monotonic() - self.t0:6.1f}s {self.versions()}: {msg}")

    def kill(self, k: Kill) -> None:
        if k.what == "redis":
            assert self.er.proc is not None
            self.er.proc.kill()  # SIGKILL: ``appendfsync always`` has every acknowledged write on disk
            self.er.proc.wait()
            down = 0.3 + k.delay
            time.sleep(down)  # the roles' clients retry meanwhile
            self.er.restart()  # same port, same AOF directory
            self.kills["redis"] += 1
            print(f"redis-server killed and restarted from its AOF after {down:.1f}s")
            return
        if k.what == "handback":  # armed: the next pool worker to hand requests back dies doing it
            (self.faults / "armed").touch()
            self.log("hand-back fault armed")
            return
        rp = self.proc("", f"rollout-{k.pick}") if k.what == "rollout" else self.proc(k.run, k.what)
        if rp.proc.poll() is not None:  # exited already (a role that finished its run)
            self.log(f"{k.name}: already exited with {rp.proc.returncode}; not killed")
            return
        self.killed.add(rp.proc.pid)
        os.kill(rp.proc.pid, signal.SIGKILL)
        rp.proc.wait(10)
        self.kills[k.name if k.what != "rollout" else "rollout"] += 1
        self.log(f"killed {k.name} (pid {rp.proc.pid})")
        time.sleep(0.1)  # let Redis execute whatever the dead process had already sent
        self.cluster_of(rp).respawn(rp)


def audit(sr: redis.Redis, cfg: Config, metrics: list[StepMetrics]) -> dict[str, int]:
    """One run's figures; asserts exactly-once, on-policy and on its own run, nothing left pending."""
    run, cc = cfg.run, cfg.controller
    B, G = cc.prompts_per_step, cc.group_size
    keys, out = Keys(run), Path(cfg.out)
    trained, result = audit_group_log(out, STEPS, B, G)  # once each, whole, policy_version == step
    for g in trained:
        assert g.run == run and all(s.run == run for s in g.samples), g.group_id
    # every step finished once: its version, one StepMetrics on control and in metrics.jsonl, and its
    # mini-batches are exactly the groups the log holds for it
    assert version(sr, run) == STEPS
    assert [m.step for m in metrics] == list(range(STEPS)), [m.step for m in metrics]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for m, row in zip(metrics, rows, strict=True):
        assert row["minibatches"] == m.minibatches and (m.groups, m.samples) == (B, B * G)
        assert sorted(gid for mb in m.minibatches for gid in mb) == sorted(
            g.group_id for g in trained if g.step == m.step
        )
    # the groups stream (never trimmed here): every planned group once, no sample in two groups, every
    # sample of this run, generated by a pool worker
    planned = {(s, f"{s}:{g}") for s in range(STEPS) for g in range(B)}
    on_stream = groups_on_stream(sr, run)
    counts = Counter((g.step, g.group_id) for g in on_stream)
    assert set(counts) == planned and max(counts.values()) == 1, {k: n for k, n in counts.items() if n > 1}
    samples = Counter(s.sample_id for g in on_stream for s in g.samples)
    assert len(samples) == STEPS * B * G and max(samples.values()) == 1
    pool = cfg.rollout.pool.name
    assert all(s.run == run and s.worker.startswith(f"{pool}-w") for g in on_stream for s in g.samples)
    for s in range(STEPS):
        assert int(sr.scard(keys.emitted(s))) == B
        assert {m.decode() for m in sr.smembers(keys.consumed(s))} == {f"{s}:{g}" for g in range(B)}
        assert int(sr.get(keys.released(s)) or 0) == B * G
        assert int(sr.get(keys.finished(s)) or 0) == B * G
    # nothing left pending in any consumer group
    pending = {keys.requests: Groups.ROLLOUT, keys.groups: Groups.TRAINER}
    pending.update({st: Groups.AGGREGATOR for st in keys.sample_streams(SHARDS)})
    for stream, group in pending.items():
        assert int(sr.xpending(stream, group)["pending"]) == 0, (stream, group)
    stats: Any = sr.hgetall(keys.stats)
    st = {k.decode(): int(v) for k, v in stats.items()}
    result |= {
        "dead_letters": sr.xlen(keys.dlq),
        "fence_rejections": st.get("fence_rejections", 0),
        "duplicate_groups": st.get("duplicate_groups", 0),
        "duplicate_samples": st.get("duplicate_samples", 0),
        "migrations": st.get("migrations", 0),
        "reclaimed_requests": st.get("reclaimed_requests", 0),
        "steps_finished": len(metrics),
    }
    dlq = [DEFAULT_CODEC.decode(f[b"d"]) for _e, f in sr.xrange(keys.dlq)]
    assert result["dead_letters"] == 0, dlq
    assert result["fence_rejections"] == result["duplicate_groups"] == result["duplicate_samples"] == 0, st
    return result


def _pending(sr: redis.Redis, cfgs: list[Config]) -> int:
    n = 0
    for cfg in cfgs:
        k = Keys(cfg.run)
        n += int(sr.xpending(k.requests, Groups.ROLLOUT)["pending"])
        n += int(sr.xpending(k.groups, Groups.TRAINER)["pending"])
        n += sum(int(sr.xpending(s, Groups.AGGREGATOR)["pending"]) for s in k.sample_streams(SHARDS))
    return n


@pytest.mark.parametrize("seed", _seeds())
def test_sigkill_pool_workers_scheduler_runs_roles_and_redis_at_random_moments(
    seed: int, tmp_path: Path, run_name: str
) -> None:
    """Catches: a request lost or generated twice when its pool worker dies mid-hand-back or mid-
    migration, a group of one run trained by the other, a shard's partial groups lost with its
    aggregator, a step trained twice or on the wrong version, a write lost with Redis, an entry left
    pending forever."""
    print(f"chaos-pool seed {seed} (replay: RP_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    pool = f"{run_name}p"
    cfgs = _cfgs(tmp_path, run_name, pool)
    runs = [c.run for c in cfgs]
    kills = plan_kills(rng, runs)
    faults = tmp_path / "faults"
    faults.mkdir()
    er = EmbeddedRedis(appendonly=True, appendfsync="always", dir=str(tmp_path / "redis")).start()
    sr = connect_sync(er.url)  # retries through the Redis restart, as the roles' clients do
    ch = Chaos(er, sr, cfgs, faults)
    try:
        ch.start(tmp_path / "out", pool)
        todo = list(kills)
        due: dict[int, float] = {}  # index in todo -> when its clock reached its target
        deadline = time.monotonic() + KILLS_S
        while todo:
            if time.monotonic() > deadline:  # a stalled run: fail with every role's log, not a timeout
                ch.until(lambda: False, 0, f"the kills {[k.name for k in todo]} (versions {ch.versions()})")
            ch.pump()
            vs = ch.versions()
            if min(vs.values()) >= STEPS:
                break
            now = time.monotonic()
            for k in todo:
                clock = vs[k.run] if k.run else min(vs.values())
                if clock >= k.target:
                    due.setdefault(id(k), now)
            ready = [k for k in todo if id(k) in due and now - due[id(k)] >= k.delay]
            if ready:
                k = ready[0]
                todo.remove(k)
                ch.kill(k)
        assert not todo, f"the runs finished before these kills: {[k.name for k in todo]}"
        ch.until(lambda: bool(ch.handback_fired), 60, "a pool worker killed mid-hand-back")
        ch.until(lambda: all(len(ch.metrics[r]) >= STEPS for r in runs), 180, f"{STEPS} steps of each run")
        ch.until(lambda: _pending(sr, cfgs) == 0, 30, "every consumer group's pending entries acknowledged")
        time.sleep(0.3)  # room for a (wrong) extra group or metrics event to show up
        ch.pump()
        figures = {cfg.run: audit(sr, cfg, ch.metrics[cfg.run]) for cfg in cfgs}
        leases = int(sr.hget(pool_keys(pool).stats, "lease_changes") or 0)
    finally:
        if ch.pc is not None:
            stop_pool(ch.clusters, ch.pc, er.url)
        sr.close()
        er.stop()
    wall = time.monotonic() - ch.t0
    print(f"chaos-pool seed {seed}: kills {dict(sorted(ch.kills.items()))}")
    print(f"chaos-pool seed {seed}: the hand-back kill: {ch.handback_fired}")
    print(f"chaos-pool seed {seed}: audit {json.dumps(figures)}; lease changes {leases}; {wall:.1f}s")
    killed = {k.split("/")[-1] for k in ch.kills}
    assert {"rollout", "rollout mid-hand-back", "pool", "redis", "controller", "trainer"} <= killed, ch.kills
    for run in runs:  # each run's controller, trainer and every shard's aggregator
        for what in ["controller", "trainer", *(f"aggregator-s{i}" for i in range(SHARDS))]:
            assert ch.kills[f"{run}/{what}"] >= 1, (run, what, ch.kills)
    assert sum(f["migrations"] for f in figures.values()) >= 1, "nothing migrated: the test shows nothing"
    assert leases >= 1, "no worker ever changed runs"
