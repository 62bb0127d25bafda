"""Acceptance: bad entries on every stream of a live run are dead-lettered, and the run carries on.

A real run (every role its own OS process, emulated engine) gets three bad entries written to each
of ``requests``, ``samples``, ``groups`` and ``control`` while it runs: garbage bytes, valid msgpack
of the wrong shape, and a well-formed map with an unknown ``kind``.  The run must still finish every
step, no role may die, and ``dlq`` must hold exactly one DeadLetter per injected entry, with a reason.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import SCHEMA_VERSION, DeadLetter, StepMetrics
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.errors import CodecError
from rolloutpipe.launch.cluster import Cluster, tail
from rolloutpipe.launch.follow import ControlFollower
from tests.support.config import EMULATED_FAST, make_config

STEPS = 3
TIMEOUT_S = 90.0

# which role consumes (and so dead-letters) each stream
CONSUMER_ROLE = {"requests": "rollout", "samples": "aggregator", "groups": "trainer", "control": "controller"}


def bad_entries(run: str) -> dict[str, tuple[bytes, str]]:
    """label -> (payload, a word the dead letter's reason must contain)."""
    unknown_kind = {"kind": "teleport", "schema_version": SCHEMA_VERSION, "run": run, "step": 0,
                    "policy_version": 0}  # fmt: skip
    return {
        "garbage": (b"\xc1\xc1 definitely not msgpack \x00\xff", "msgpack"),
        "wrong shape": (msgpack.packb([1, "two", 3.0], use_bin_type=True), "map"),
        "unknown kind": (msgpack.packb(unknown_kind, use_bin_type=True), "teleport"),
    }


def _check_alive(cluster: Cluster) -> None:
    bad = cluster.failed()
    if bad is not None:
        code = bad.proc.returncode
        raise AssertionError(
            f"role {bad.name} exited with code {code} during the run:\n{tail(bad.log_path, 40)}"
        )


def _wait(cluster: Cluster, what: str, cond: Any, deadline: float) -> None:
    while not cond():
        _check_alive(cluster)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _dead_letters(sr: redis.Redis, keys: Keys) -> list[DeadLetter]:
    rows: Any = sr.xrange(keys.dlq)
    return [DEFAULT_CODEC.decode_as(f[DATA], DeadLetter) for _id, f in rows]


def test_bad_entries_on_every_stream_are_dead_lettered_and_the_run_completes(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis
) -> None:
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST, f"controller.steps={STEPS}")
    keys = Keys(run_name)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(cfg, redis_url, out)
    deadline = time.monotonic() + TIMEOUT_S
    injected: dict[
        tuple[str, str], tuple[str, str, bytes, str]
    ] = {}  # (stream, id) -> (name, label, payload, word)
    metrics: list[StepMetrics] = []
    try:
        cluster.start()
        # the run is under way once the trainer has published policy version 0
        _wait(cluster, "policy version 0", lambda: sr.exists(keys.version), deadline)
        assert all(rp.proc.poll() is None for rp in cluster.procs)  # every role is up and running

        for name in CONSUMER_ROLE:
            stream = getattr(keys, name)
            for label, (payload, word) in bad_entries(run_name).items():
                eid = sr.xadd(stream, {DATA: payload})
                injected[(stream, eid.decode())] = (name, label, payload, word)  # type: ignore[union-attr]
        assert len(injected) == 12

        # follow the trainer's step metrics on control, like run_cluster does
        follower = ControlFollower(sr, [run_name])
        while len(metrics) < STEPS:
            _check_alive(cluster)
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(metrics)} of {STEPS} steps done in {TIMEOUT_S:.0f}s")
            try:
                metrics += [m for _run, m in follower.poll(block_ms=200)]
            except CodecError:
                continue  # one of the bad entries written above (the controller dead-letters it)

        def all_dead_lettered() -> bool:
            return {(dl.source_stream, dl.entry_id) for dl in _dead_letters(sr, keys)} >= injected.keys()

        _wait(cluster, "every bad entry in dlq", all_dead_lettered, deadline)
        _check_alive(cluster)  # nobody died on the way to the end
        # the roles end on their own once the run is done; let them, so stop() below does not
        # SIGTERM one that is already past its event loop (which would read as a -15 exit)
        sr.set(keys.done, b"1")
        natural = time.monotonic() + 20
        while time.monotonic() < natural and any(rp.proc.poll() is None for rp in cluster.procs):
            _check_alive(cluster)
            time.sleep(0.05)
    finally:
        sr.set(keys.done, b"1")
        cluster.stop()

    # every role ended cleanly: done on its own or stopped gracefully by SIGTERM, never a crash
    codes = {rp.name: rp.proc.returncode for rp in cluster.procs}
    assert codes == dict.fromkeys(codes, 0), codes
    assert sorted(codes) == sorted(["trainer", "aggregator", "controller", "rollout-0", "rollout-1"])
    for rp in cluster.procs:
        assert "Traceback" not in rp.log_path.read_text(errors="replace"), tail(rp.log_path, 40)

    # the run completed every step, with every real group
    assert [m.step for m in metrics] == list(range(STEPS))
    n_groups = cfg.controller.prompts_per_step
    for m in metrics:
        assert m.groups == n_groups
        assert m.samples == n_groups * cfg.controller.group_size
        assert sorted(g for mb in m.minibatches for g in mb) == sorted(
            f"{m.step}:{g}" for g in range(n_groups)
        )

    # exactly one dead letter per injected entry, from the stream's consumer, with the reason
    dls = _dead_letters(sr, keys)
    by_id: dict[tuple[str, str], list[DeadLetter]] = {}
    for dl in dls:
        by_id.setdefault((dl.source_stream, dl.entry_id), []).append(dl)
    for (stream, eid), (name, label, payload, word) in injected.items():
        got = by_id.get((stream, eid), [])
        assert len(got) == 1, f"{name}/{label} ({eid}): {len(got)} dead letters"
        dl = got[0]
        assert dl.source_stream == stream == getattr(keys, name)
        assert dl.role == CONSUMER_ROLE[name], (name, label, dl.role)
        assert dl.run == run_name
        assert dl.payload == payload
        assert dl.reason.strip(), (name, label)
        assert dl.reason.startswith("decode:"), (name, label, dl.reason)
        assert word in dl.reason, (name, label, dl.reason)
    total: Any = sr.hget(keys.stats, "dead_letters")
    assert int(total or 0) >= len(injected)

    # and nothing injected is left pending in any consumer group
    for name, role in CONSUMER_ROLE.items():
        stream = getattr(keys, name)
        group = "controller" if name == "control" else role
        rows: Any = sr.xpending_range(stream, group, min="-", max="+", count=1000)
        pending = {(stream, row["message_id"].decode()) for row in rows}
        assert not pending & injected.keys(), (name, pending & injected.keys())
