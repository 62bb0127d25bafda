"""A rollout pool shared by several runs: the pure scheduling policies, and whole runs of real
processes (two runs, each with its own controller, aggregator and trainer, on one pool of workers
that the scheduler moves between them) checked for exactly-once, per-run versions and fence
isolation."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import DeadLetter, Group, Lease, StepPlan
from rolloutpipe.broker.keys import DATA, Keys, pool_keys
from rolloutpipe.config import Config
from rolloutpipe.launch.pool import run_pool
from rolloutpipe.scheduling.leases import RunView, WorkerView, assign, greedy, lookahead, shares
from tests.support.cluster import assert_exactly_once, groups_on_stream
from tests.support.config import EMULATED_FAST, make_config
from tests.support.helpers import version

# ------------------------------------------------------------------------------------ the policies


def test_shares_follow_demand_give_every_demanding_run_one_and_never_exceed_its_requests() -> None:
    assert shares({"a": 30, "b": 10}, 4) == {"a": 3, "b": 1}
    assert shares({"a": 30, "b": 0}, 4) == {"a": 4, "b": 0}
    assert shares({"a": 1000, "b": 1}, 4) == {"a": 3, "b": 1}  # b still gets one
    assert shares({"a": 2, "b": 1}, 8) == {"a": 2, "b": 1}  # no more workers than requests
    assert shares({"a": 5, "b": 5, "c": 5}, 2) == {"a": 1, "b": 1, "c": 0}  # workers run out
    assert shares({"a": 0}, 3) == {"a": 0}
    for d in ({"a": 7, "b": 3, "c": 11}, {"a": 1, "b": 1}, {"a": 100, "b": 50, "c": 25, "d": 1}):
        for n in range(1, 9):
            s = shares(d, n)
            assert sum(s.values()) <= n and all(s[r] <= d[r] for r in d), (d, n, s)
            assert sum(s.values()) == min(n, sum(d.values())), (d, n, s)


def test_assign_keeps_workers_on_their_run_when_it_can() -> None:
    ws = [WorkerView("w0", "a", 8), WorkerView("w1", "a", 8), WorkerView("w2", "b", 8)]
    assert assign({"a": 1, "b": 2}, ws) == {"w0": "a", "w1": "b", "w2": "b"}
    assert assign({"a": 2, "b": 1}, ws) == {"w0": "a", "w1": "a", "w2": "b"}  # nothing moves


def _view(run: str, phase: str, out: int = 0, el: float = 0.0, train: float | None = None) -> RunView:
    return RunView(run, phase, out, 64, el, last_train_s=train, last_rollout_s=5.0)  # type: ignore[arg-type]


def test_a_training_run_lends_its_workers_and_lookahead_takes_them_back_early() -> None:
    ws = [WorkerView(f"w{i}", "a" if i < 2 else "b", 8) for i in range(4)]
    # a trains (its last training took 3 s; it has trained 1 s), b rolls out
    runs = [_view("a", "training", el=1.0, train=3.0), _view("b", "rollout", out=40)]
    assert set(greedy(runs, ws, switch_s=0.5).values()) == {"b"}  # all four to b
    assert set(lookahead(runs, ws, switch_s=0.5).values()) == {"b"}  # a's end is 2 s away: lend
    # 0.3 s of training left, under the 0.5 s switch: lookahead gives a its share back now
    runs = [_view("a", "training", el=2.7, train=3.0), _view("b", "rollout", out=40)]
    assert set(greedy(runs, ws, switch_s=0.5).values()) == {"b"}
    la = Counter(lookahead(runs, ws, switch_s=0.5).values())
    assert la["a"] >= 1 and la["b"] >= 1


def test_lookahead_does_not_lend_what_must_come_back_before_it_is_useful() -> None:
    ws = [WorkerView(f"w{i}", "a" if i < 2 else "b", 8) for i in range(4)]
    # a starts a training that took 0.8 s last time: under 2 switches of 0.5 s, so it keeps its two
    runs = [_view("a", "training", el=0.0, train=0.8), _view("b", "rollout", out=40)]
    assert set(greedy(runs, ws, switch_s=0.5).values()) == {"b"}
    assert Counter(lookahead(runs, ws, switch_s=0.5).values()) == {"a": 2, "b": 2}
    # with no measurement yet it lends them, as greedy does
    runs = [_view("a", "training", el=0.0), _view("b", "rollout", out=40)]
    assert set(lookahead(runs, ws, switch_s=0.5).values()) == {"b"}


def test_lookahead_leaves_a_rollout_about_to_end_its_workers() -> None:
    ws = [WorkerView(f"w{i}", "a" if i < 2 else "b", 8) for i in range(4)]
    # a: 2 requests left of a rollout that took 5 s last time and has run 4.8 s; b wants many
    runs = [_view("a", "rollout", out=2, el=4.8), _view("b", "rollout", out=60)]
    g, la = Counter(greedy(runs, ws, 0.5).values()), Counter(lookahead(runs, ws, 0.5).values())
    assert g == {"b": 3, "a": 1} and la == {"a": 2, "b": 2}


def test_done_runs_get_nothing() -> None:
    ws = [WorkerView("w0", "a", 8), WorkerView("w1", "b", 8)]
    runs = [_view("a", "done"), _view("b", "rollout", out=10)]
    for pol in (greedy, lookahead):
        assert set(pol(runs, ws, 0.5).values()) == {"b"}


# ------------------------------------------------------------------ whole runs with real processes

RUN_OVERRIDES = (
    *EMULATED_FAST,
    # a rollout lasts ~0.5-1 s, then the run trains for ~0.5 s with its rollout engines idle (sync):
    # the time a shared pool lends them to the other run
    "rollout.emulated.time_scale=0.15",
    "rollout.emulated.switch_s=0.5",
    "controller.mode=sync",
    "controller.steps=4",
    "redis.trim=false",
    "rollout.claim_idle_s=2",
)


def _cfgs(tmp_path: Path, run_name: str, n: int, pool: str, *extra: str) -> list[Config]:
    """``n`` runs; run i trains (i + 1) times longer than run 0, so their phases drift apart (two
    identical runs started together stay in step, and train at the same moments)."""
    runs = [f"{run_name}{chr(97 + i)}" for i in range(n)]
    pool_over = [f"rollout.pool.name={pool}", f"rollout.pool.runs={runs!r}".replace("'", '"')]
    slower = [f"trainer.emulated.time_scale={1.0 * (i + 1)}" for i in range(n)]
    return [
        make_config(tmp_path / r, r, *RUN_OVERRIDES, *pool_over, slower[i], *extra)
        for i, r in enumerate(runs)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lookahead", "greedy"])
def test_two_runs_share_a_pool_each_trained_exactly_once_on_its_own_versions(
    policy: str, tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Catches: a group of run A reaching run B's trainer, a sample of one run in the other's group,
    versions mixed between runs, a request lost or generated twice when its worker moves to the
    other run mid-request (handed back), a pool that never moves a worker (the test shows nothing)."""
    pool = f"{run_name}p"
    cfgs = _cfgs(tmp_path, run_name, 2, pool, f"rollout.pool.policy={policy}")
    res = run_pool(cfgs, redis_url, tmp_path / "out", pool, workers=2, timeout_s=240)
    for cfg in cfgs:
        run = cfg.run
        assert_exactly_once(sr, cfg, res.metrics[run])
        assert version(sr, run) == cfg.controller.steps  # each run's versions are its own
        for g in groups_on_stream(sr, run):
            assert g.run == run and all(s.run == run for s in g.samples), g.group_id
            assert all(s.policy_version == g.step == g.policy_version for s in g.samples)
            # every sample was generated by a worker of the pool
            assert all(s.worker.startswith(f"{pool}-w") for s in g.samples)
    # the pool moved workers between the runs, and each run was served by both workers
    moves = [x for x in res.leases if x.from_run]
    assert moves, "no worker ever changed runs"
    assert all(isinstance(x, Lease) and x.run == f"pool:{pool}" for x in res.leases)
    served = {cfg.run: {s.worker for g in groups_on_stream(sr, cfg.run) for s in g.samples} for cfg in cfgs}
    print("leases:", [(x.worker, x.from_run, x.to_run) for x in res.leases], "served:", served)
    both = set.intersection(*served.values())
    assert both, f"no worker generated samples for both runs: {served}"
    assert sr.hget(pool_keys(pool).stats, "lease_changes")


@pytest.mark.slow
def test_a_worker_lent_to_a_run_mid_rollout_gets_its_waiting_requests(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Issue 30: a worker lent to a run while that run still has requests no engine has started
    must get some of them.  Catches: the run's own workers had each taken their share of the step
    into their engine queues (``engine_queue: share``), so the lent worker found nothing to read
    and idled until the run's next step (only migration could feed it).  No hand-backs and no
    migration here, so the stream is the lent worker's only source of work."""
    pool = f"{run_name}p"
    cap = 4
    cfgs = _cfgs(tmp_path, run_name, 2, pool, "rollout.pool.policy=greedy", "rollout.pool.handback=false",
                 "rollout.migration.enabled=false", "rollout.engine_queue=share",
                 f"rollout.emulated.max_num_seqs={cap}")  # fmt: skip
    res = run_pool(cfgs, redis_url, tmp_path / "out", pool, workers=3, timeout_s=240)
    samples = {cfg.run: [s for g in groups_on_stream(sr, cfg.run) for s in g.samples] for cfg in cfgs}
    holder: dict[str, str] = {}  # worker -> run, replayed from the lease log
    checked = []
    for x in sorted(res.leases, key=lambda x: x.created_at):
        t, run = x.created_at, x.to_run
        others = [w for w, r in holder.items() if r == run and w != x.worker]
        holder[x.worker] = run
        if not x.from_run or not run:
            continue
        # the run's step under way at the lease: released before it, not all finished
        live = [s for s in samples[run] if s.released_at <= t < s.finished_at]
        if not live:
            continue
        step = min(s.step for s in live)
        same = [s for s in live if s.step == step]
        if len(same) < cap * (len(others) + 3):  # 3 engines' worth beyond the others' slots wait
            continue
        mine = [s for s in same if s.worker == x.worker]
        checked.append((x.worker, run, len(same), len(others), len(mine)))
    print("lent mid-rollout (worker, run, unfinished, other workers, taken):", checked)
    assert checked, "no worker was lent to a run with requests waiting: the test shows nothing"
    assert all(taken > 0 for *_, taken in checked), checked


# Big groups (64 prompts x 8 samples of ~2.5k tokens: ~10 MB of groups pending in the trainer at a
# step's end), as in the multiplex suite: the trainer's sweep of its own pending entries then takes
# long enough for a commit to land while its reply is in flight.
STATIC_BIG_GROUPS = (
    "controller.mode=cgp-fgd",
    "controller.steps=6",
    "controller.prompts_per_step=64",
    "controller.group_size=8",
    "controller.minibatches=4",
    "task.num_prompts=64",
    "rollout.emulated.length_median=2500",
    "rollout.emulated.max_response_tokens=8192",
    "rollout.emulated.max_num_seqs=128",
    "rollout.emulated.time_scale=0.002",
    "redis.trim=false",
    "rollout.pool.policy=static",
)


@pytest.mark.slow
def test_a_static_pool_run_has_no_fence_rejections(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Issue 31: no worker moves in a static split and every request is generated on its step's
    version, so nothing may be refused as stale.  Catches: the trainer's pending sweep, whose reply
    was in flight while a step committed, queueing that step's acknowledged groups again for the
    next step, where the fence dead-lettered all of them (64 a run here, 128 in the suite)."""
    pool = f"{run_name}p"
    runs = [f"{run_name}{x}" for x in "ab"]
    pool_over = [f"rollout.pool.name={pool}", f"rollout.pool.runs={runs!r}".replace("'", '"')]
    cfgs = [make_config(tmp_path / r, r, *EMULATED_FAST, *STATIC_BIG_GROUPS, *pool_over) for r in runs]
    res = run_pool(cfgs, redis_url, tmp_path / "out", pool, workers=4, timeout_s=240)
    assert not [x for x in res.leases if x.from_run], "a worker moved in the static split"
    for cfg in cfgs:
        k = Keys(cfg.run)
        dlq = [DEFAULT_CODEC.decode_as(f[DATA], DeadLetter) for _e, f in sr.xrange(k.dlq)]
        reasons = Counter(d.reason.split(":")[0] for d in dlq)
        fence = int(sr.hget(k.stats, "fence_rejections") or 0)
        assert fence == 0 and not reasons, f"{cfg.run}: {fence} fence rejections; dlq reasons {dict(reasons)}"
        assert [m.fence_rejections for m in res.metrics[cfg.run]] == [0] * cfg.controller.steps
        # nor read twice: a trained group that came back would be a duplicate now, not a rejection
        assert int(sr.hget(k.stats, "duplicate_groups") or 0) == 0
        assert_exactly_once(sr, cfg, res.metrics[cfg.run])


def test_a_group_of_another_run_is_dead_lettered_not_trained(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    """Fence isolation at the trainer's door: run B's trainer, handed a group of run A on its own
    ``groups`` stream, dead-letters it (``event of run ...``) and trains nothing of it."""
    from rolloutpipe.launch.cluster import Cluster
    from tests.support.cluster import Driver, stop_cluster
    from tests.support.events import tiny_group

    a, b = f"{run_name}a", f"{run_name}b"
    cfg = make_config(tmp_path, b, *EMULATED_FAST)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.dump_yaml(out / "config.yaml")
    foreign = tiny_group().model_copy(update={"run": a, "step": 0, "policy_version": 0})
    plan = StepPlan(run=b, step=0, policy_version=0, policy="fifo", groups=[], minibatches=1,
                    groups_per_minibatch=1, created_at=0.0)  # fmt: skip
    sr.set(Keys(b).plan(0), DEFAULT_CODEC.encode(plan))
    sr.xadd(Keys(b).groups, {DATA: DEFAULT_CODEC.encode(foreign)})
    cluster = Cluster(cfg, redis_url, out)
    try:
        cluster.spawn("trainer", "trainer", ["--out", str(out)])
        d = Driver(cluster, sr)
        d.until(lambda: sr.xlen(Keys(b).dlq) >= 1, 60, "the foreign group dead-lettered")
        (_eid, f), *_ = sr.xrange(Keys(b).dlq)
        dl = DEFAULT_CODEC.decode(f[DATA])
        assert f"event of run {a!r} on run {b!r}" in dl.reason  # type: ignore[attr-defined]
        assert not sr.exists(Keys(b).consumed(0)) and sr.xpending(Keys(b).groups, "trainer")["pending"] == 0
        assert not isinstance(DEFAULT_CODEC.decode(f[DATA]), Group)
    finally:
        stop_cluster(cluster, sr)


# ------------------------------------------------------------------------------- status and tail


def test_status_shows_each_runs_share_and_tail_shows_leases_and_migrations(
    sr: redis.Redis, run_name: str
) -> None:
    import io
    import json
    import time

    import numpy as np

    from rolloutpipe.broker.events import RolloutRequest
    from rolloutpipe.tools import status
    from rolloutpipe.tools import tail as stream_tail

    pool, a, b = f"{run_name}p", f"{run_name}a", f"{run_name}b"
    pk = pool_keys(pool)
    now = time.time()
    for i, run in enumerate((a, a, b)):
        wid = f"{pool}-w{i}"
        hb = {"id": wid, "capacity": 8, "inflight": 3, "run": run, "t": now, "pid": 1, "host": "h"}
        sr.zadd(pk.workers, {wid: now + 30})
        sr.set(pk.heartbeat(wid), json.dumps(hb), ex=30)
        sr.hset(pk.lease, wid, run)
        if run == a:  # the worker's RolloutWorker heartbeats in its run's registry too
            sr.zadd(Keys(a).workers, {wid: now + 30})
            sr.set(Keys(a).heartbeat(wid), json.dumps({**hb, "pool": pool, "migrations": 2}), ex=30)
    st = status.collect_status(sr, f"pool:{pool}")
    assert st["pool"]["shares"] == {a: 2, b: 1} and st["pool"]["members"] == 3
    assert f"shares {a} 2, {b} 1" in status.render_status(st)
    st = status.collect_status(sr, a)
    assert (st["pool"]["serving"], st["pool"]["members"]) == (2, 3)
    assert f"2 of the 3 live workers of pool {pool} serve this run" in status.render_status(st)
    assert [w["migrations"] for w in st["workers"]] == [2, 2]

    ev = Lease(run=f"pool:{pool}", step=-1, policy_version=-1, worker=f"{pool}-w2", from_run=a, to_run=b,
               policy="lookahead", shares={a: 2, b: 1}, created_at=now)  # fmt: skip
    sr.xadd(pk.leases, {DATA: DEFAULT_CODEC.encode(ev)})
    out = io.StringIO()
    assert stream_tail.tail(sr, f"pool:{pool}", "leases", out, pretty=False) == 1
    assert json.loads(out.getvalue())["to_run"] == b
    cont = RolloutRequest(
        run=a, step=0, policy_version=0, request_id="0:1:2", group_id="0:1", prompt_index=1, sample_index=2,
        prompt="p", answer="1", seed=1, max_new_tokens=99, released_at=now, prefix_ids=np.arange(7),
        prefix_logprobs=np.zeros(7), segment=1, origin="5-0",
    )  # fmt: skip
    sr.xadd(Keys(a).requests, {DATA: DEFAULT_CODEC.encode(cont)})
    out = io.StringIO()
    stream_tail.tail(sr, a, "requests", out, pretty=True)
    assert "MIGRATED: segment 1, resumes after 7 tok of 5-0" in out.getvalue()


def test_the_static_split_never_moves_a_worker_whatever_order_they_join_in() -> None:
    from rolloutpipe.roles.pool import static_leases

    w = [WorkerView(f"w{i}", "", 8) for i in range(4)]
    first = static_leases(["a", "b"], [w[3]])  # the last worker happens to start first
    assert first == {"w3": "a"}
    now = [WorkerView("w3", "a", 8), *w[:3]]
    second = static_leases(["a", "b"], now)
    assert second["w3"] == "a" and Counter(second.values()) == {"a": 2, "b": 2}
    again = static_leases(["a", "b"], [WorkerView(k, v, 8) for k, v in second.items()])
    assert again == second
