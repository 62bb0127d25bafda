"""The embedded Redis's AOF: a restart on the same directory and port brings every stream, consumer
group, pending entry and key back, and a run carries on through a crash-and-restart of Redis."""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import redis

from rolloutpipe.broker.connect import connect, retries_for
from rolloutpipe.broker.embedded import EmbeddedRedis, Supervisor
from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.broker.keys import Keys
from rolloutpipe.launch.cluster import run_cluster
from tests.support.config import EMULATED_FAST, make_config
from tests.support.helpers import step_metrics, version


@pytest.mark.parametrize("crash", [False, True], ids=["shutdown", "sigkill"])
def test_aof_restart_restores_streams_groups_pending_and_keys(tmp_path: Path, crash: bool) -> None:
    er = EmbeddedRedis(appendonly=True, appendfsync="always", dir=str(tmp_path / "redis")).start()
    try:
        r = redis.Redis(port=er.port)
        ids = [r.xadd("s", {"d": str(i)}) for i in range(5)]
        r.xgroup_create("s", "g", id="0")
        r.xreadgroup("g", "c1", {"s": ">"}, count=3)  # 3 delivered: pending
        r.xack("s", "g", ids[0])  # ... one of them acknowledged
        r.set("version", b"v7")
        r.incrby("finished:3", 11)
        r.sadd("emitted:3", "3:0", "3:1")
        r.close()
        port = er.port
        if crash:
            assert er.proc is not None
            er.proc.kill()  # SIGKILL: no shutdown fsync; `always` already wrote every reply's write
            er.proc.wait()
        er.restart()
        assert er.port == port
        r = redis.Redis(port=er.port)
        assert r.xlen("s") == 5
        (g,) = r.xinfo_groups("s")
        assert g["pending"] == 2 and g["last-delivered-id"] == ids[2]
        pend = r.xpending_range("s", "g", "-", "+", 10)
        assert [p["message_id"] for p in pend] == ids[1:3] and {p["consumer"] for p in pend} == {b"c1"}
        assert r.xreadgroup("g", "c2", {"s": ">"}) == [
            [b"s", [(ids[3], {b"d": b"3"}), (ids[4], {b"d": b"4"})]]
        ]
        assert r.get("version") == b"v7" and r.get("finished:3") == b"11"
        assert r.smembers("emitted:3") == {b"3:0", b"3:1"}
        r.close()
    finally:
        er.stop()
    assert (tmp_path / "redis" / "appendonlydir").is_dir()  # the AOF outlives the server


async def test_client_retries_through_a_restart(tmp_path: Path) -> None:
    """``connect()``'s clients wait for a restarted server instead of failing the role."""
    assert retries_for(30.0) >= 30  # 50 ms doubling to 1 s: about 30 s of retrying
    er = EmbeddedRedis(appendonly=True, appendfsync="always", dir=str(tmp_path / "redis")).start()
    r = connect(er.url, retry_s=20.0)
    try:
        await r.set("k", b"1")
        assert er.proc is not None
        er.proc.kill()
        er.proc.wait()
        threading.Timer(1.5, er.restart).start()  # down for 1.5 s, then the AOF is replayed
        t0 = time.monotonic()
        assert await r.incr("k") == 2  # blocks through the outage, then succeeds
        assert time.monotonic() - t0 > 1.0
    finally:
        await r.aclose()
        er.stop()


@pytest.mark.slow
def test_run_survives_redis_crash_and_restart(tmp_path: Path) -> None:
    """Kill redis-server (SIGKILL) at step 3 of 8; the supervisor restarts it from its AOF
    (``appendfsync always``) after a pause, every role reconnects, and the run finishes with every
    step trained once on exactly its own groups."""
    steps = 8
    cfg = make_config(
        tmp_path, "dur", *EMULATED_FAST, f"controller.steps={steps}", "redis.appendfsync=always"
    )
    er = EmbeddedRedis(appendonly=True, appendfsync="always", dir=str(tmp_path / "redis")).start()
    result: dict[str, Any] = {}

    def go() -> None:
        try:
            result["metrics"] = run_cluster(cfg, er.url, Path(cfg.out), progress=False, timeout_s=150)
        except BaseException:  # reported by the assertion below
            result["error"] = traceback.format_exc()

    try:
        with Supervisor(er, poll_s=1.0) as sup:  # polls slowly: the server stays down about a second
            t = threading.Thread(target=go)
            t.start()
            r = redis.Redis(port=er.port)
            deadline = time.monotonic() + 60
            while version(r, cfg.run) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert version(r, cfg.run) >= 3
            r.close()
            assert er.proc is not None
            er.proc.kill()
            t.join(170)
            assert not t.is_alive()
            assert "error" not in result, repr(result.get("error"))
            assert sup.restarts == 1
        got: list[StepMetrics] = result["metrics"]
        assert [m.step for m in got][:steps] == list(range(steps))
        r = redis.Redis(port=er.port)
        ms = {m.step: m for m in step_metrics(r, cfg.run)}
        assert sorted(ms) == list(range(steps))
        assert all(m.groups == cfg.controller.prompts_per_step for m in ms.values())
        k = Keys(cfg.run)
        assert version(r, cfg.run) == steps
        for s in range(max(0, steps - cfg.redis.keep_steps), steps):
            assert r.scard(k.consumed(s)) == cfg.controller.prompts_per_step
        r.close()
    finally:
        er.stop()


def test_embedded_redis_with_a_relative_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make demo` runs `rolloutpipe run ... --out runs/demo`: the AOF dir is relative to the cwd."""
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis(appendonly=True, dir="runs/demo/redis") as er:
        r = redis.Redis(port=er.port)
        assert r.set("k", b"v")
        r.close()
    assert (tmp_path / "runs" / "demo" / "redis" / "redis.log").exists()
