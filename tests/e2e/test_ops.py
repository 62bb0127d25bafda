"""``rolloutpipe tail`` and ``rolloutpipe status`` against a live run and against hand-made keys.

One emulated run (every role its own OS process) is started for the module and kept running while
the tests look at it; two bad entries are injected so that ``dlq`` has dead letters to show.  The
exact numbers (lag, pending, frontier, health) are pinned on runs whose keys the test writes itself.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.connect import connect_sync
from rolloutpipe.broker.events import DeadLetter, GroupPlan, PolicyVersion, Sample, StepPlan
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.launch.cluster import Cluster, tail
from rolloutpipe.tools import status, view
from rolloutpipe.tools import tail as stream_tail
from tests.support.config import EMULATED_FAST, ROOT, make_config

GARBAGE = b"\xc1\xc1 not msgpack at all"


@dataclass
class Live:
    run: str
    url: str
    keys: Keys
    cluster: Cluster
    bad_sample_id: str  # garbage on samples (the aggregator dead-letters it)
    bad_request_id: str  # a valid plan event on requests (a rollout worker dead-letters it)


def _plan(run: str, step: int) -> StepPlan:
    return StepPlan(run=run, step=step, policy_version=step, policy="fgd",
                    groups=[GroupPlan(group_id=f"{step}:{g}", prompt_index=g, n=4) for g in range(8)],
                    minibatches=2, groups_per_minibatch=4, created_at=time.time())  # fmt: skip


def _wait(cluster: Cluster, what: str, cond: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if (bad := cluster.failed()) is not None:
            raise AssertionError(f"{bad.name} died:\n{tail(bad.log_path, 40)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    run = f"ops{uuid.uuid4().hex[:8]}"
    cfg = make_config(tmp_path_factory.mktemp("ops"), run, *EMULATED_FAST, "controller.steps=10000",
                      "rollout.heartbeat_s=1.0", "rollout.claim_idle_s=10",
                      "rollout.emulated.time_scale=0.03", "redis.trim=false")  # fmt: skip
    keys = Keys(run)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sr = redis.Redis.from_url(redis_url)
    cluster = Cluster(cfg, redis_url, out)
    try:
        cluster.start()
        _wait(cluster, "policy version 2", lambda: _version(sr, keys) >= 2)
        bad_sample: Any = sr.xadd(keys.samples, {DATA: GARBAGE})
        bad_request: Any = sr.xadd(keys.requests, {DATA: DEFAULT_CODEC.encode(_plan(run, 0))})
        ids = {(keys.samples, bad_sample.decode()), (keys.requests, bad_request.decode())}

        def dead_lettered() -> bool:
            rows: Any = sr.xrange(keys.dlq)
            dls = [DEFAULT_CODEC.decode_as(f[DATA], DeadLetter) for _id, f in rows]
            return {(d.source_stream, d.entry_id) for d in dls} >= ids

        _wait(cluster, "both bad entries in dlq", dead_lettered)
        yield Live(run, redis_url, keys, cluster, bad_sample.decode(), bad_request.decode())
    finally:
        sr.set(keys.done, b"1")
        cluster.stop()
        sr.close()


def _version(sr: redis.Redis, keys: Keys) -> int:
    raw: Any = sr.get(keys.version)
    return -1 if raw is None else DEFAULT_CODEC.decode_as(raw, PolicyVersion).policy_version


def _tail(url: str, run: str, stream: str, **kw: Any) -> list[dict[str, Any]]:
    buf = io.StringIO()
    r = connect_sync(url, fail_fast=True)
    try:
        stream_tail.tail(r, run, stream, buf, **kw)
    finally:
        r.close()
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def _rp(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rolloutpipe", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


# ----------------------------------------------------------------------------------------------- tail, live


def test_tail_decodes_requests_samples_and_groups_with_their_frontier(live: Live) -> None:
    reqs = _tail(live.url, live.run, "requests", n=5, where=stream_tail.Filter(kind="request"))
    assert len(reqs) == 5 and all(r["stream"] == "requests" and r["kind"] == "request" for r in reqs)
    assert [r["id"] for r in reqs] == sorted((r["id"] for r in reqs), key=_id_key)  # oldest first

    samples = _tail(live.url, live.run, "samples", n=5, where=stream_tail.Filter(kind="sample"))
    assert len(samples) == 5
    sr = redis.Redis.from_url(live.url)
    for s in samples:
        rows: Any = sr.xrange(live.keys.samples, s["id"], s["id"])
        ((_id, fields),) = rows
        ev = DEFAULT_CODEC.decode_as(fields[DATA], Sample)
        assert s["sample_id"] == ev.sample_id and s["reward"] == ev.reward
        ids, lps = ev.response_ids, ev.logprobs
        if ids.size > 16:  # long arrays: length and the first 8
            assert s["response_ids"] == {"len": ids.size, "head": ids[:8].tolist()}
            assert s["logprobs"]["len"] == ids.size
            assert s["logprobs"]["head"] == pytest.approx(lps[:8].tolist(), rel=1e-6)
        else:
            assert s["response_ids"] == ids.tolist()
    sr.close()

    groups = _tail(live.url, live.run, "groups", n=6)
    assert len(groups) == 6
    for g in groups:
        f = g["frontier"]
        assert f["minibatch_size"] == 4 and f["total_groups"] == 8
        assert f["minibatch"] == f["position"] // 4 and f["needed"] == 3 - f["position"] % 4
        assert len(g["advantages"]) == len(g["samples"]) == 4  # short arrays print whole
        assert all(s["policy_version"] == g["policy_version"] == g["step"] for s in g["samples"])

    buf = io.StringIO()
    r = connect_sync(live.url, fail_fast=True)
    stream_tail.tail(r, live.run, "groups", buf, n=3, pretty=True)
    r.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3 and all("group" in x and "frontier mb " in x and "rewards [" in x for x in lines)


def test_tail_dlq_shows_why_and_undecodable_entries_become_error_lines(live: Live) -> None:
    dls = {(d["source_stream"], d["entry_id"]): d for d in _tail(live.url, live.run, "dlq", from_start=True)}
    garbage = dls[(live.keys.samples, live.bad_sample_id)]
    assert garbage["kind"] == "dead_letter" and garbage["role"] == "aggregator"
    assert garbage["source_stream"] == live.keys.samples and "msgpack" in garbage["reason"]
    assert garbage["payload"] == {"len": len(GARBAGE), "hex": GARBAGE.hex(), "kind": None}
    wrong_kind = dls[(live.keys.requests, live.bad_request_id)]
    assert wrong_kind["role"] == "rollout" and "unexpected kind 'plan'" in wrong_kind["reason"]
    assert wrong_kind["payload"]["kind"] == "plan"

    # the garbage is still on samples: tail prints it as an error line instead of failing
    errors = _tail(live.url, live.run, "samples", n=1, where=stream_tail.Filter(kind="error"))
    assert [e["id"] for e in errors] == [live.bad_sample_id]
    assert "msgpack" in errors[0]["error"] and errors[0]["payload"]["len"] == len(GARBAGE)


def test_tail_filters_by_group_policy_version_and_kind(live: Live) -> None:
    g = _tail(live.url, live.run, "samples", n=100, where=stream_tail.Filter(group="1:3"))
    assert len(g) == 4 and {s["group_id"] for s in g} == {"1:3"}  # a group of 4, all found by paging
    v = _tail(live.url, live.run, "groups", n=100, where=stream_tail.Filter(policy_version=1))
    assert sorted(x["group_id"] for x in v) == sorted(f"1:{i}" for i in range(8))
    plans = _tail(live.url, live.run, "control", from_start=True, where=stream_tail.Filter(kind="plan"))
    assert [p["step"] for p in plans][:3] == [0, 1, 2] and {p["kind"] for p in plans} == {"plan"}


# ----------------------------------------------------------------------------------------------- status, live


def test_status_of_a_live_run(live: Live) -> None:
    r = connect_sync(live.url, fail_fast=True)
    try:
        st = status.collect_status(r, live.run)
    finally:
        r.close()
    assert st["exists"] and not st["done"]
    assert sorted(w["id"] for w in st["workers"]) == [f"{live.run}-w0", f"{live.run}-w1"]
    assert all(w["capacity"] == 16 and w["ttl_s"] >= 0 and w["heartbeat_age_s"] < 5 for w in st["workers"])
    assert st["version"]["policy_version"] >= 2
    groups = {(s, g["name"]): g for s, info in st["streams"].items() for g in info["groups"]}
    assert {("requests", "rollout"), ("samples", "aggregator"), ("groups", "trainer"),
            ("control", "controller"), ("feedback", "controller")} <= groups.keys()  # fmt: skip
    assert len(groups[("requests", "rollout")]["consumers"]) == 2
    for g in groups.values():
        assert g["pending"] >= 0 and g["lag"] is not None and g["lag"] >= 0
    assert st["streams"]["groups"]["length"] >= 16 and st["streams"]["dlq"]["length"] >= 2
    step = st["step"]
    assert step["step"] >= st["version"]["policy_version"] - 1 and step["policy"] == "fgd"
    assert step["groups"] == 8 and step["group_sizes"] == "G 4" and step["requests_total"] == 32
    assert (step["groups_closed"], step["groups_skipped"], step["samples_discarded"]) == (0, 0, 0)
    assert st["stats"]["total"]["dead_letters"] >= 2
    assert status.health(st) == (0, status.health(st)[1]) and status.health(st)[1].startswith("ok: 2 live")
    text = status.render_status(st)
    assert f"{live.run}-w0" in text and "requests" in text and "rollout" in text and "\nfrontier  " in text


# ---------------------------------------------------------------------------------------------- exact numbers


def test_compact_prints_short_arrays_whole_long_ones_as_length_and_head() -> None:
    assert view.compact(np.arange(16, dtype="<i4")) == list(range(16))
    assert view.compact(np.arange(17, dtype="<i4")) == {"len": 17, "head": list(range(8))}
    assert view.compact(np.asarray([0.1, np.nan, -np.inf], dtype="<f4")) == [0.1, "nan", "-inf"]
    payload = DEFAULT_CODEC.encode(_plan("r", 0))
    assert view.compact(payload) == {"len": len(payload), "hex": payload[:32].hex(), "kind": "plan"}
    line = stream_tail.record(stream_tail.decode_entry("samples", b"1-0", {b"x": b"y"}))
    assert line == {"stream": "samples", "id": "1-0", "error": "no 'd' field: ['x']",
                    "payload": {"len": 0, "hex": "", "kind": None}}  # fmt: skip


def test_tail_never_joins_a_group_nor_leaves_pending_entries(
    sr: redis.Redis, redis_url: str, run_name: str
) -> None:
    k = Keys(run_name)
    plan = DEFAULT_CODEC.encode(_plan(run_name, 0))
    for _ in range(6):
        sr.xadd(k.control, {DATA: plan})
    sr.xgroup_create(k.control, "controller", id="0")
    sr.xreadgroup("controller", "c1", {k.control: ">"}, count=2)

    def snapshot() -> tuple[Any, ...]:
        consumers: Any = sr.xinfo_consumers(k.control, "controller")
        return (sr.xinfo_groups(k.control), sr.xpending(k.control, "controller"),
                [(c["name"], c["pending"]) for c in consumers])  # fmt: skip

    before = snapshot()
    assert before[0][0]["pending"] == 2 and before[0][0]["lag"] == 4

    buf = io.StringIO()
    r = connect_sync(redis_url, fail_fast=True)
    reads = 0

    def stop() -> bool:
        nonlocal reads
        reads += 1
        return reads > 3

    assert stream_tail.tail(r, run_name, "control", buf, n=3) == 3
    follower = threading.Thread(target=stream_tail.tail, args=(r, run_name, "control", buf),
                                kwargs={"n": 0, "follow": True, "block_ms": 300, "stop": stop})  # fmt: skip
    follower.start()
    time.sleep(0.1)
    sr.xadd(k.control, {DATA: plan})  # arrives while tail follows
    follower.join(10)
    assert not follower.is_alive()
    assert stream_tail.tail(r, run_name, "control", buf, from_start=True) == 7
    r.close()
    assert len(buf.getvalue().splitlines()) == 3 + 1 + 7
    after = snapshot()
    assert after[1:] == before[1:]
    assert [g["name"] for g in after[0]] == [b"controller"] and after[0][0]["pending"] == 2
    assert after[0][0]["lag"] == 5  # the new entry; tail did not read it for the group


def test_status_pins_lag_pending_frontier_and_health(sr: redis.Redis, redis_url: str, run_name: str) -> None:
    k = Keys(run_name)
    r = connect_sync(redis_url, fail_fast=True)
    assert status.health(status.collect_status(r, run_name))[0] == 2  # nothing of this run yet

    old = time.time() - 900
    pv = PolicyVersion(run=run_name, step=3, policy_version=3, path="", sha256={}, published_at=old)
    sr.set(k.version, DEFAULT_CODEC.encode(pv))
    sr.set(k.plan(3), DEFAULT_CODEC.encode(_plan(run_name, 3)))
    sr.set(k.released(3), 32)
    sr.set(k.finished(3), 21)
    sr.sadd(k.emitted(3), *[f"3:{i}" for i in range(5)])
    for _ in range(5):
        sr.xadd(k.groups, {DATA: b"x"})
    sr.xgroup_create(k.groups, "trainer", id="0")
    sr.xreadgroup("trainer", "trainer-0", {k.groups: ">"}, count=2)
    sr.hset(k.stats, mapping={"dead_letters": 3, "dead_letters:3": 1, "fence_rejections": 2})

    st = status.collect_status(r, run_name)
    (g,) = st["streams"]["groups"]["groups"]
    assert (g["name"], g["pending"], g["lag"]) == ("trainer", 2, 3)
    assert [(c["name"], c["pending"]) for c in g["consumers"]] == [("trainer-0", 2)]
    s = st["step"]
    assert (s["step"], s["state"], s["groups_emitted"], s["samples_finished"]) == (3, "rolling out", 5, 21)
    assert (s["frontier_minibatch"], s["frontier_needs"]) == (1, 3)  # 4 groups per mini-batch, 5 emitted
    assert (s["policy"], s["group_sizes"], s["groups"]) == ("fgd", "G 4", 8)
    assert (s["requests_released"], s["requests_total"]) == (32, 32)
    assert st["stats"] == {"total": {"dead_letters": 3, "fence_rejections": 2}, "step": {"dead_letters": 1}}
    assert "frontier        mini-batch 2/2 needs 3 more groups\n" in status.render_status(st)

    code, why = status.health(st)
    assert code == 1 and "no live rollout worker" in why
    hb = {"capacity": 8, "inflight": 1, "version": 3, "samples": 9, "pid": 1, "host": "h", "t": time.time()}
    sr.set(k.heartbeat("w0"), json.dumps(hb), ex=30)
    sr.zadd(k.workers, {"w0": time.time() + 30})  # a worker registers as it beats (no SCAN finds it)
    st = status.collect_status(r, run_name)
    assert [(w["id"], w["capacity"]) for w in st["workers"]] == [("w0", 8)]
    code, why = status.health(st, stuck_after_s=600)
    assert code == 1 and "trainer stuck: 5 groups" in why  # 2 pending + 3 lag, version 900 s old
    assert status.health(st, stuck_after_s=3600)[0] == 0
    sr.set(k.done, b"1")
    assert status.health(status.collect_status(r, run_name)) == (0, f"ok: run {run_name!r} is done")
    r.close()


# ----------------------------------------------------------------------------------------------- the CLI


def test_cli_tail_prints_json_lines_and_status_check(live: Live) -> None:
    url = ["--run", live.run, "--redis-url", live.url]
    p = _rp("tail", "samples", *url, "-n", "7")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) == 7 and all(r["stream"] == "samples" and "id" in r for r in rows)

    p = _rp("tail", "dlq", "--run", "no-such-run", "--redis-url", live.url)
    assert p.returncode == 0 and p.stdout == "" and "has no dlq stream" in p.stderr

    p = _rp("tail", "bogus", *url)
    assert p.returncode == 2 and "requests" in p.stderr and "dlq" in p.stderr

    p = _rp("status", *url, "--check")
    assert p.returncode == 0 and p.stdout.startswith("ok: 2 live rollout workers"), p.stdout + p.stderr
    p = _rp("status", "--run", live.run, "--redis-url", f"redis://127.0.0.1:{_closed_port()}/0", "--check")
    assert p.returncode == 2 and "cannot reach Redis" in p.stdout

    follow = subprocess.Popen([sys.executable, "-m", "rolloutpipe", "tail", "control", *url, "-n", "1",
                               "--follow"], cwd=ROOT, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert follow.stdout is not None
    first = json.loads(follow.stdout.readline())  # history printed: now it blocks in XREAD
    assert first["stream"] == "control"
    follow.send_signal(signal.SIGINT)
    assert follow.wait(10) == 0  # Ctrl-C is a normal way to stop following
    follow.stdout.close()


def _closed_port() -> int:
    from rolloutpipe.broker.embedded import free_port

    return free_port()


def _id_key(eid: str) -> tuple[int, int]:
    ms, seq = eid.split("-")
    return int(ms), int(seq)


def test_tail_says_why_it_printed_nothing_and_follow_ends_with_the_run(redis_url: str) -> None:
    """``tail samples -n 1`` on a trimmed stream printed nothing without a word, and ``--follow``
    never exited after the run ended.  Both now end with a note, and ``--follow`` still prints
    what came before the end."""
    run = f"t{uuid.uuid4().hex[:8]}"
    k = Keys(run)
    r = redis.Redis.from_url(redis_url)
    eid = r.xadd(k.samples, {"d": b"x"})
    r.xdel(k.samples, eid)  # what trimming leaves: the stream, with no entries
    url = ["--run", run, "--redis-url", redis_url]
    p = _rp("tail", "samples", *url, "-n", "1")
    assert p.returncode == 0 and p.stdout == ""
    assert "no samples entry printed: it holds none now (entries are trimmed once consumed" in p.stderr

    follow = subprocess.Popen([sys.executable, "-m", "rolloutpipe", "tail", "dlq", *url, "--from-start",
                               "--follow"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert follow.stdout is not None
        r.xadd(k.dlq, {"d": b"not msgpack"})  # an undecodable entry becomes an error line
        line = json.loads(follow.stdout.readline())
        assert line["stream"] == "dlq"
        r.xadd(k.dlq, {"d": b"also not msgpack"})
        r.set(k.done, b"1")  # the run ends: --follow prints what is left, then exits
        out, err = follow.communicate(timeout=30)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    assert len(out.splitlines()) == 1 and "is done; nothing more will come" in err
    r.close()
