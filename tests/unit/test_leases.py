"""The pool scheduler's defects (issue 30), each pinned without Redis: the look-ahead's horizon,
an overdue rollout that hoarded its workers, a rollout timed unlike its elapsed time, a loaded
worker lent by id, a lent worker with nothing to read (late binding), and a leaving worker that
finished its whole engine queue before it switched."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rolloutpipe.broker.events import RolloutRequest
from rolloutpipe.broker.keys import Keys
from rolloutpipe.engines.emulated import EmulatedEngine
from rolloutpipe.roles import pool
from rolloutpipe.roles.rollout import RolloutWorker
from rolloutpipe.scheduling.leases import RunView, WorkerView, assign, greedy, lookahead, stagger
from tests.support.config import make_config

# the multiplex suite's control plane: a 0.5 emulated-second switch at time_scale 0.02 (10 ms of
# wall time), looked at every 50 ms
SUITE = ("rollout.engine=emulated", "rollout.emulated.switch_s=0.5", "rollout.emulated.time_scale=0.02",
         "rollout.pool.tick_s=0.05")  # fmt: skip


def _view(run: str, phase: str, out: int = 0, el: float = 0.0, *, train: float | None = None,
          rollout: float | None = 5.0) -> RunView:  # fmt: skip
    return RunView(run, phase, out, 64, el, last_train_s=train, last_rollout_s=rollout)  # type: ignore[arg-type]


def test_the_look_ahead_sees_past_the_next_tick(tmp_path: Path) -> None:
    """Catches: a horizon of ``switch_s x time_scale`` (10 ms) under the 50 ms tick, so a run whose
    training ends before the next tick got nothing back in time: ``lookahead`` was ``greedy``."""
    cfg = make_config(tmp_path, "r", *SUITE)
    h = pool.decision_horizon(cfg)
    tick = cfg.rollout.pool.tick_s
    assert h == pytest.approx(pool.switch_horizon(cfg) + tick) and h > tick
    ws = [WorkerView(f"w{i}", "a" if i < 2 else "b", 64) for i in range(4)]
    # a's training took 1.00 s last time and has run 0.96 s: it ends before the next tick
    runs = [_view("a", "training", el=0.96, train=1.0), _view("b", "rollout", out=400)]
    assert set(greedy(runs, ws, h).values()) == {"b"}
    assert set(lookahead(runs, ws, pool.switch_horizon(cfg)).values()) == {"b"}  # the old horizon
    assert Counter(lookahead(runs, ws, h).values())["a"] >= 1  # moves now, useful when a needs it


def test_an_overdue_rollout_keeps_only_the_workers_its_requests_fill() -> None:
    """Catches: ``_ends_within`` true for any rollout past its prediction (a negative time left is
    under every horizon), so a long tail kept every worker it held."""
    ws = [WorkerView(f"w{i}", "a" if i < 2 else "b", 8) for i in range(4)]
    # a: 2 requests left of a rollout that took 5 s last time and has run 7 s; b wants many
    runs = [_view("a", "rollout", out=2, el=7.0), _view("b", "rollout", out=60)]
    la, g = Counter(lookahead(runs, ws, 0.5).values()), Counter(greedy(runs, ws, 0.5).values())
    assert la == g == {"a": 1, "b": 3}
    # about to end (0.2 s left of its prediction): it keeps both, as before
    runs = [_view("a", "rollout", out=2, el=4.8), _view("b", "rollout", out=60)]
    assert Counter(lookahead(runs, ws, 0.5).values()) == {"a": 2, "b": 2}


def test_a_rollout_is_timed_over_the_span_its_elapsed_time_counts() -> None:
    """Catches: the last rollout timed from the wait for its plan on, the current one from its
    requests on, so a rollout looked 'ending soon' by the length of that wait."""
    t = pool._Track(since=0.0)
    t.advance("waiting", 0, 0.0)
    t.advance("rollout", 0, 2.0)  # the plan is read 2 s after the version
    t.advance("training", 0, 10.0)
    assert t.last_rollout_s == pytest.approx(8.0)
    t.advance("waiting", 1, 13.0)
    assert t.last_train_s == pytest.approx(3.0)
    t.advance("rollout", 1, 13.5)
    t.advance("rollout", 2, 20.0)  # step 1 ended and step 2 began between two ticks: not measured
    assert t.last_rollout_s == pytest.approx(8.0) and (t.step, t.since) == (2, 20.0)


def test_a_run_lends_its_least_loaded_worker_and_keeps_its_busiest() -> None:
    """Catches: the worker kept chosen by id, so the pool lent one full of requests (each handed
    back) and kept an idle one."""
    ws = [WorkerView("w0", "a", 256, inflight=3), WorkerView("w1", "a", 256, inflight=250)]
    ws.append(WorkerView("w2", "b", 256))
    assert assign({"a": 1, "b": 2}, ws) == {"w0": "b", "w1": "a", "w2": "b"}
    # an idle worker (no run) is lent before a loaded one
    ws = [WorkerView("w0", "a", 8, inflight=8), WorkerView("w1", "", 8), WorkerView("w2", "b", 8, inflight=8)]
    assert assign({"a": 1, "b": 2}, ws) == {"w0": "a", "w1": "b", "w2": "b"}


class _StubBroker:
    """What a ``RolloutWorker`` calls in admission and hand-backs, recorded (no Redis)."""

    def __init__(self, run: str, n_live: int = 2) -> None:
        self.run, self.keys, self.n_live = run, Keys(run), n_live
        self.migrated: list[str] = []
        self.published: list[str] = []
        self.beats = self.touches = 0
        self.enough = asyncio.Event()

    async def live_workers(self) -> list[dict[str, Any]]:
        return [{"id": f"w{i}"} for i in range(self.n_live)]

    async def migrate(self, entry_id: str, cont: RolloutRequest) -> str:
        self.migrated.append(cont.request_id)
        return f"{entry_id}-again"

    async def publish_sample(self, sample: Any, entry_id: str, origin: str = "") -> None:
        self.published.append(sample.request_id)

    async def incr(self, *_: Any, **__: Any) -> None:
        return None

    async def heartbeat(self, worker: str, info: dict[str, Any], ttl_s: int) -> None:
        self.beats += 1
        if self.beats >= 5:
            self.enough.set()

    async def touch(self, *_: Any) -> None:
        self.touches += 1

    async def drop_heartbeat(self, worker: str) -> None:
        return None

    async def decode_or_dlq(self, entry: Any, *_: Any) -> RolloutRequest:
        return _request(self.run, int(entry.id[1:]))

    async def closed_groups(self, step: int) -> set[str]:
        return set()


def _request(run: str, i: int, share: int = 0) -> RolloutRequest:
    return RolloutRequest(
        run=run, step=0, policy_version=0, request_id=f"0:{i}:0", group_id=f"0:{i}", prompt_index=i,
        sample_index=0, prompt="2+2=", answer="4", seed=i, max_new_tokens=64, queue_share_of=share,
        released_at=0.0,
    )  # fmt: skip


def test_a_pool_worker_pulls_only_into_free_slots(tmp_path: Path) -> None:
    """Catches: under ``engine_queue: share`` a pool's worker took its share of the whole step into
    its engine's queue, so a worker lent to the run mid-rollout found nothing to read."""
    over = (*SUITE, "rollout.emulated.max_num_seqs=8", "rollout.engine_queue=share")
    for pooled, want in ((False, 512), (True, 8)):
        extra = ("rollout.pool.name=p", "rollout.pool.runs=[r]") if pooled else ()
        cfg = make_config(tmp_path, "r", *over, *extra)
        w = RolloutWorker(cfg, _StubBroker("r"), EmulatedEngine(cfg.rollout.emulated), "w0")  # type: ignore[arg-type]
        w.queue_share_of = 1024  # the step's size, from its last request: two live workers
        assert asyncio.run(w.admission_limit()) == want, pooled


def test_the_first_worker_up_takes_only_its_share_of_a_step(tmp_path: Path) -> None:
    """Catches the startup race: alone in the registry before its peers' first heartbeat, the
    first worker up took the whole step (1,024) into its engine's queue.  It takes its share of the
    run's configured workers, or of the live ones when more are up."""
    over = (*SUITE, "rollout.emulated.max_num_seqs=8", "rollout.engine_queue=share", "rollout.workers=4")
    cfg = make_config(tmp_path, "r", *over)
    for live, want in ((1, 256), (4, 256), (8, 128)):
        w = RolloutWorker(cfg, _StubBroker("r", n_live=live), EmulatedEngine(cfg.rollout.emulated), "w0")  # type: ignore[arg-type]
        w.queue_share_of = 1024
        assert asyncio.run(w.admission_limit()) == want, live


@pytest.mark.parametrize("handback", [False, True])
def test_a_leaving_worker_hands_back_its_engine_queue_and_finishes_only_what_runs(
    tmp_path: Path, handback: bool
) -> None:
    """Catches: with ``pool.handback: false`` the leaving worker finished every request it held,
    its engine's whole queue included (up to its share of a step), before it could switch; and a
    request read as it left was started there all the same.  With ``handback`` every one goes."""
    cfg = make_config(
        tmp_path,
        "r",
        "rollout.engine=emulated",
        "rollout.emulated.max_num_seqs=2",
        "rollout.emulated.time_scale=0.05",
        "rollout.emulated.length_median=5000",
        "rollout.emulated.length_sigma=0",
    )  # fmt: skip  (each request: 3 s of wall time)

    async def scenario() -> _StubBroker:
        b = _StubBroker("r")
        engine = EmulatedEngine(cfg.rollout.emulated)
        w = RolloutWorker(cfg, b, engine, "w0")  # type: ignore[arg-type]
        w.version = 0
        entries: list[Any] = [type("E", (), {"id": f"e{i}", "stream": "requests"})() for i in range(6)]
        for i, entry in enumerate(entries[:5]):
            w.inflight_reqs[entry.id] = (entry, _request("r", i))
            w.inflight[entry.id] = asyncio.create_task(w.handle(entry, _request("r", i)))
        for _ in range(10_000):  # until all five are in the engine: two running, three queued
            if len(engine.running) == 2 and len(engine.waiting) == 3:
                break
            await asyncio.sleep(0)
        assert len(engine.running) == 2 and len(engine.waiting) == 3
        await w.leave(handback)
        await w.admit(entries[5], asyncio.Event())  # read just as it left
        await asyncio.wait_for(asyncio.gather(*list(w.inflight.values())), 60)
        await engine.close()
        w.scorer.close()
        return b

    b = asyncio.run(scenario())
    every = {f"0:{i}:0" for i in range(6)}
    assert set(b.migrated) | set(b.published) == every and not set(b.migrated) & set(b.published)
    if handback:
        assert sorted(b.migrated) == sorted(every), (b.migrated, b.published)
    else:  # the two running finish here; the three queued and the one read late go back
        assert len(b.migrated) == 4 and len(b.published) == 2, (b.migrated, b.published)
        assert "0:5:0" in b.migrated


def test_with_migration_on_a_worker_publishes_its_load_as_often_as_its_peers_look(tmp_path: Path) -> None:
    """Catches: loads published only every ``heartbeat_s`` (1 s of wall time, 50 emulated seconds at
    the suite's scale), while a worker that moved decides again only on loads newer than its move.
    The idle-time reset of its requests stays at ``heartbeat_s``."""
    cfg = make_config(tmp_path, "r", *SUITE, "rollout.heartbeat_s=30", "rollout.migration.enabled=true",
                      "rollout.migration.check_s=0.01")  # fmt: skip

    async def scenario() -> _StubBroker:
        b = _StubBroker("r")
        w = RolloutWorker(cfg, b, EmulatedEngine(cfg.rollout.emulated), "w0")  # type: ignore[arg-type]
        stop = asyncio.Event()
        task = asyncio.create_task(w.heartbeat(stop))
        await asyncio.wait_for(b.enough.wait(), 60)  # five loads published
        stop.set()
        await task
        w.scorer.close()
        return b

    b = asyncio.run(scenario())
    assert b.beats >= 5 and b.touches == 1, (b.beats, b.touches)  # not one 30 s heartbeat each


def test_stagger_serves_the_oldest_step_first_where_lookahead_shares_by_demand() -> None:
    """Catches proportional shares pulling runs into phase: a spare worker went to the run with
    more requests left, the one whose step began later, so the older run's rollout ended no earlier
    and both trained at once.  ``stagger`` gives it to the run whose step began first."""
    runs = [
        RunView("a", "rollout", 600, 1024, 3.0, 2.0, 4.0),
        RunView("b", "rollout", 1000, 1024, 1.0, 2.0, 4.0),
    ]
    ws = [WorkerView("w0", "a", 256, 256), WorkerView("w1", "a", 256, 256), WorkerView("w2", "b", 256, 256),
          WorkerView("w3", "b", 256, 256), WorkerView("w4", "", 256, 0)]  # fmt: skip
    assert lookahead(runs, ws, 0.06)["w4"] == "b"
    got = stagger(runs, ws, 0.06)
    assert got["w4"] == "a"
    assert [got[w] for w in ("w0", "w1", "w2", "w3")] == ["a", "a", "b", "b"]  # nobody's full worker moves


def test_stagger_serves_rollouts_before_a_plan_about_to_come() -> None:
    """Order: the rollout that began first, then the one waiting for its plan, then a training run
    whose next step is predicted within the horizon; a run with nothing to do gets nothing."""
    runs = [
        RunView("t", "training", 0, 1024, 1.95, 2.0, 4.0),  # next plan in 0.05 s: counts a step
        RunView("w", "waiting", 0, 1024, 0.01),
        RunView("r", "rollout", 300, 1024, 2.0, 2.0, 4.0),
        RunView("d", "done", 0, 1024, 0.0),
    ]
    ws = [WorkerView(f"w{i}", "", 256) for i in range(6)]
    got = Counter(stagger(runs, ws, 0.06).values())
    assert got == {"r": 2, "w": 4}  # r fills 2 (300 requests), w the 4 left; t and d none
    ws = [WorkerView(f"w{i}", "", 256) for i in range(8)]
    assert Counter(stagger(runs, ws, 0.06).values()) == {"r": 2, "w": 4, "t": 2}
