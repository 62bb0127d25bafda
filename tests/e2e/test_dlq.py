"""``rolloutpipe dlq list|show|replay`` against the real Redis of the test session.

Dead letters are made the way the roles make them (``Broker.dead_letter`` on an entry read from its
stream, and one through the aggregator's own ``on_entry``), then listed, shown and replayed through
the library and through ``python -m rolloutpipe dlq``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import GroupPlan, PolicyVersion, RolloutRequest, Sample, StepPlan
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.broker.streams import Broker, Entry
from rolloutpipe.roles.aggregator import Aggregator
from rolloutpipe.tools import dlq
from tests.support.config import EMULATED_FAST, ROOT, make_config
from tests.support.events import step_sample

GARBAGE = b"\xc1\xc1 not msgpack \x00\xff"


def _sample(run: str, step: int = 3) -> Sample:
    return step_sample(run, step, f"{step}:0", 1, n_resp=40)


def _request(run: str, version: int) -> RolloutRequest:
    return RolloutRequest(
        run=run, step=version, policy_version=version, request_id=f"{version}:0:0", group_id=f"{version}:0",
        prompt_index=0, sample_index=0, prompt="1+2=", answer="3", seed=1, max_new_tokens=4,
        released_at=1.0,
    )  # fmt: skip


def _plan(run: str) -> StepPlan:
    return StepPlan(run=run, step=0, policy_version=0, policy="fifo",
                    groups=[GroupPlan(group_id=f"0:{g}", prompt_index=g, n=4) for g in range(4)],
                    minibatches=2, groups_per_minibatch=2, created_at=1.0)  # fmt: skip


def _version(run: str, v: int) -> PolicyVersion:
    return PolicyVersion(run=run, step=v, policy_version=v, path="", sha256={}, published_at=time.time())


@dataclass
class Seeded:
    """Dead letter ids by what they hold, and each one's original payload."""

    ids: dict[str, str]
    payloads: dict[str, bytes]


async def _reject(broker: Broker, stream: str, payload: bytes, reason: str, **kw: Any) -> None:
    """Write ``payload`` to ``stream``, read it back as a consumer would, and dead-letter it."""
    await broker.ensure_group(stream, "g")
    await broker.r.xadd(stream, {DATA: payload})
    [entry] = await broker.read(stream, "g", "c", count=1, block_ms=10)
    await broker.dead_letter(entry, reason, ack_group="g", **kw)


async def _seed(broker: Broker, tmp_path: Path) -> Seeded:
    k, run = broker.keys, broker.run
    await broker.r.set(k.version, DEFAULT_CODEC.encode(_version(run, 2)))
    payloads = {
        "sample": DEFAULT_CODEC.encode(_sample(run, step=3)),  # step 3 >= version 2: replayable
        "garbage": GARBAGE,
        "stale": DEFAULT_CODEC.encode(_request(run, 1)),  # version 1 < 2: the fence would reject it
        "wrong kind": DEFAULT_CODEC.encode(_plan(run)),
        "no source": DEFAULT_CODEC.encode(_request(run, 5)),
        "aggregator": GARBAGE + b"!",
    }
    await _reject(broker, k.samples, payloads["sample"], "no plan for step 3", step=3, policy_version=3)
    await _reject(broker, k.samples, payloads["garbage"], "decode: not msgpack: ExtraData: unpack(b) x")
    await _reject(broker, k.requests, payloads["stale"], "stale request: policy_version 1 < worker's 2",
                  step=1, policy_version=1, counter="fence_rejections")  # fmt: skip
    await _reject(broker, k.requests, payloads["wrong kind"], f"unexpected kind 'plan' on {k.requests}")
    await broker.dead_letter(None, "generation failed", payload=payloads["no source"])
    # and one through a real role: the aggregator dead-letters garbage it reads from samples
    cfg = make_config(tmp_path, run, *EMULATED_FAST)
    agg = Aggregator(cfg, Broker(broker.r, run, "aggregator"), "agg-0")
    await broker.ensure_group(k.samples, "aggregator", start="$")  # sees only what comes after
    await broker.r.xadd(k.samples, {DATA: payloads["aggregator"]})
    for e in await broker.read(k.samples, "aggregator", "agg-0", count=10, block_ms=10):
        await agg.on_entry(e)
    rows: Any = await broker.r.xrange(k.dlq)
    assert len(rows) == 6
    ids = dict(zip(payloads, (r[0].decode() for r in rows), strict=True))
    return Seeded(ids, payloads)


def _last(sr: redis.Redis, key: str) -> tuple[str, bytes]:
    rows: Any = sr.xrevrange(key, count=1)
    return rows[0][0].decode(), rows[0][1][DATA]


# ----------------------------------------------------------------------------------------------- library


async def test_list_shows_every_dead_letter_with_counts(
    broker: Broker, sr: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    s = await _seed(broker, tmp_path)
    lst = dlq.listing(sr, run_name, n=50)
    assert [rec.id for rec in lst.records] == list(s.ids.values())
    assert lst.matching == lst.total == 6
    assert lst.by_source == {"samples": 3, "requests": 2, "-": 1}
    assert lst.by_reason == {
        "decode: not msgpack": 2,  # the hand-made one and the aggregator's own
        "no plan for step N": 1,
        "stale request": 1,
        "unexpected kind 'plan' on requests": 1,
        "generation failed": 1,
    }
    rows = {name: dlq.row(lst.records[i]) for i, name in enumerate(s.ids)}
    assert rows["sample"]["payload_kind"] == "sample" and rows["sample"]["step"] == 3
    assert rows["sample"]["payload_bytes"] == len(s.payloads["sample"])
    assert rows["garbage"]["payload_kind"] is None and "msgpack" in rows["garbage"]["payload_error"]
    assert rows["aggregator"]["role"] == "aggregator" and rows["aggregator"]["source"] == "samples"
    assert rows["stale"]["policy_version"] == 1

    # -n keeps the newest, oldest first; the counts still cover every match
    last2 = dlq.listing(sr, run_name, n=2)
    assert [r.id for r in last2.records] == list(s.ids.values())[-2:] and last2.matching == 6
    by_reason = dlq.listing(sr, run_name, where=dlq.Where(reason="MSGPACK"))
    assert [r.id for r in by_reason.records] == [s.ids["garbage"], s.ids["aggregator"]]
    assert by_reason.matching == 2 and by_reason.total == 6
    for source in ("requests", Keys(run_name).requests):
        got = dlq.listing(sr, run_name, where=dlq.Where(source=source))
        assert [r.id for r in got.records] == [s.ids["stale"], s.ids["wrong kind"]]
    text = dlq.render_listing(lst, run_name)
    assert "by reason:" in text and "by source:" in text and "6 shown of 6 matching" in text
    assert dlq.render_listing(dlq.listing(sr, "nothing-here"), "nothing-here").endswith("no dead letters")


async def test_show_decodes_the_payload_or_dumps_hex(
    broker: Broker, sr: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    s = await _seed(broker, tmp_path)
    d = dlq.detail(dlq.get(sr, run_name, s.ids["sample"]))
    assert d["reason"] == "no plan for step 3" and d["source_stream"] == Keys(run_name).samples
    assert d["payload"]["kind"] == "sample" and d["payload"]["sample_id"] == "3:0:1"
    assert d["payload"]["response_ids"] == {"len": 40, "head": list(range(8))}  # ops' compaction
    assert d["payload"]["prompt_ids"] == [0, 1, 2, 3, 4]
    g = dlq.detail(dlq.get(sr, run_name, s.ids["garbage"]))
    assert "payload" not in g and "msgpack" in g["payload_error"]
    assert g["payload_hex"][0].startswith("00000000  c1 c1 20 6e 6f 74") and g["payload_hex"][0].endswith("|")
    assert "payload_hex:" in dlq.render_detail(g)
    with pytest.raises(dlq.DlqError, match="no dead letter 1-1"):
        dlq.get(sr, run_name, "1-1")
    with pytest.raises(dlq.DlqError, match="not a stream entry id"):
        dlq.get(sr, run_name, "latest")


async def test_replay_puts_the_original_bytes_back_once(
    broker: Broker, sr: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    s = await _seed(broker, tmp_path)
    k = Keys(run_name)
    before = sr.xlen(k.samples)
    [dry] = dlq.replay(sr, run_name, [dlq.get(sr, run_name, s.ids["sample"])], dry_run=True)
    assert dry.done and dry.dry_run and sr.xlen(k.samples) == before  # --dry-run changes nothing
    assert "would replay" in dlq.describe(dry)

    [rp] = dlq.replay(sr, run_name, [dlq.get(sr, run_name, s.ids["sample"])])
    assert rp.done and rp.new_id
    assert sr.xlen(k.samples) == before + 1
    assert _last(sr, k.samples) == (rp.new_id, s.payloads["sample"])  # exactly the original bytes
    rec = dlq.get(sr, run_name, s.ids["sample"])
    assert rec.replayed is not None and rec.replayed["to"] == rp.new_id
    assert int(sr.hget(k.stats, dlq.REPLAYED_COUNTER) or 0) == 1
    assert f"replayed -> {rp.new_id}" in dlq.render_listing(dlq.listing(sr, run_name), run_name)

    # not twice by accident; --force does
    [again] = dlq.replay(sr, run_name, [rec])
    assert again.refused.startswith("already replayed") and again.forceable
    [forced] = dlq.replay(sr, run_name, [rec], force=True)
    assert forced.done and _last(sr, k.samples) == (forced.new_id, s.payloads["sample"])
    assert sr.xlen(k.samples) == before + 2
    # the replayed entry is what a consumer reads and decodes as the original event
    back = DEFAULT_CODEC.decode_as(_last(sr, k.samples)[1], Sample)
    assert back.sample_id == "3:0:1" and back.response_ids.tolist() == list(range(40))


async def test_replay_refuses_garbage_stale_and_foreign_without_force(
    broker: Broker, sr: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    s = await _seed(broker, tmp_path)
    k = Keys(run_name)
    lens = {key: sr.xlen(key) for key in (k.samples, k.requests)}
    recs = {name: dlq.get(sr, run_name, i) for name, i in s.ids.items() if name != "sample"}
    got = {name: rp for name, rp in zip(recs, dlq.replay(sr, run_name, recs.values()), strict=True)}
    assert "does not decode" in got["garbage"].refused and got["garbage"].forceable
    assert "does not decode" in got["aggregator"].refused
    assert "stale" in got["stale"].refused and "fence" in got["stale"].refused
    assert "policy_version 1 < the run's current version 2" in got["stale"].refused
    assert "'plan' event on requests" in got["wrong kind"].refused
    assert "no source stream" in got["no source"].refused and not got["no source"].forceable
    assert {key: sr.xlen(key) for key in lens} == lens  # nothing was written
    assert not sr.exists(dlq.replayed_key(run_name))

    # a dead letter whose source is another run's stream is never replayed there
    other = Keys(run_name + "x")
    await broker.dead_letter(Entry(other.samples, "1-0", {DATA: s.payloads["sample"]}), "elsewhere")
    foreign = dlq.listing(sr, run_name, n=1).records[0]
    [rp] = dlq.replay(sr, run_name, [foreign], force=True)
    assert "is not a stream of run" in rp.refused and not sr.exists(other.samples)

    forced = dict(zip(recs, dlq.replay(sr, run_name, recs.values(), force=True), strict=True))
    assert forced["garbage"].done and _last(sr, k.samples)[1] != GARBAGE  # the aggregator's came after
    assert forced["no source"].refused  # --force never invents a destination
    assert {n for n, rp in forced.items() if rp.done} == {"garbage", "aggregator", "stale", "wrong kind"}
    assert sr.xlen(k.samples) == lens[k.samples] + 2 and sr.xlen(k.requests) == lens[k.requests] + 2
    assert _last(sr, k.requests)[1] == s.payloads["wrong kind"]


async def test_replayed_garbage_is_dead_lettered_again_by_the_role(
    broker: Broker, sr: redis.Redis, run_name: str, tmp_path: Path
) -> None:
    """Replay only puts the payload back: the role checks it like any entry (no bypass)."""
    s = await _seed(broker, tmp_path)
    k = Keys(run_name)
    [rp] = dlq.replay(sr, run_name, [dlq.get(sr, run_name, s.ids["aggregator"])], force=True)
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST)
    agg = Aggregator(cfg, Broker(broker.r, run_name, "aggregator"), "agg-0")
    entries = await broker.read(k.samples, "aggregator", "agg-0", count=10, block_ms=10)
    assert [e.id for e in entries] == [rp.new_id]
    await agg.on_entry(entries[0])
    newest = dlq.listing(sr, run_name, n=1).records[0]
    assert newest.letter is not None and newest.letter.entry_id == rp.new_id
    assert newest.letter.payload == s.payloads["aggregator"]


# ----------------------------------------------------------------------------------------------- CLI


def _rp(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rolloutpipe", "dlq", *args, "--redis-url", url],
        cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


async def test_cli_list_show_replay(
    broker: Broker, sr: redis.Redis, run_name: str, redis_url: str, tmp_path: Path
) -> None:
    s = await _seed(broker, tmp_path)
    k = Keys(run_name)
    out = _rp("list", "--run", run_name, url=redis_url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:6]] == list(s.ids.values())
    assert "undecodable" in lines[1] and "sample" in lines[0] and "step 3 v3" in lines[0]
    assert "      3  samples" in out.stdout and "by reason:" in out.stdout

    js = _rp("list", "--run", run_name, "--json", "-n", "2", "--reason", "msgpack", url=redis_url)
    doc = json.loads(js.stdout)
    assert doc["matching"] == 2 and doc["total"] == 6 and doc["by_source"] == {"samples": 2}
    assert [d["id"] for d in doc["dead_letters"]] == [s.ids["garbage"], s.ids["aggregator"]]

    show = _rp("show", s.ids["stale"], "--run", run_name, url=redis_url)
    assert show.returncode == 0, show.stderr
    assert "reason: stale request" in show.stdout and '  prompt: "1+2="' in show.stdout

    dry = _rp("replay", "--all", "--dry-run", "--run", run_name, url=redis_url)
    assert dry.returncode == 1  # some are refused
    assert dry.stdout.count("would replay dead letter") == 1 and "refused 5" in dry.stdout
    before = sr.xlen(k.samples)
    rep = _rp("replay", s.ids["sample"], "--run", run_name, url=redis_url)
    assert rep.returncode == 0, rep.stderr
    assert f"replayed dead letter {s.ids['sample']}" in rep.stdout
    assert sr.xlen(k.samples) == before + 1 and _last(sr, k.samples)[1] == s.payloads["sample"]
    bad = _rp("replay", s.ids["garbage"], s.ids["stale"], "--run", run_name, url=redis_url)
    assert bad.returncode == 1 and "does not decode" in bad.stdout and "stale" in bad.stdout
    assert "--force would replay some" in bad.stdout

    again = _rp(
        "replay", "--all", "--yes", "--reason", "NO PLAN", "--force", "--run", run_name, url=redis_url
    )
    assert again.returncode == 0 and "replayed 1, refused 0" in again.stdout, again.stdout
    assert sr.xlen(k.samples) == before + 2 and _last(sr, k.samples)[1] == s.payloads["sample"]

    no_yes = _rp("replay", "--all", "--run", run_name, url=redis_url)
    assert no_yes.returncode == 2 and "--yes" in no_yes.stderr
    unknown = _rp("show", "1-1", "--run", run_name, url=redis_url)
    assert unknown.returncode == 2 and "no dead letter 1-1" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    down = _rp("list", "--run", run_name, url="redis://127.0.0.1:1/0")
    assert down.returncode == 2 and "cannot reach Redis" in down.stderr and "Traceback" not in down.stderr
    both = _rp("replay", s.ids["sample"], "--all", "--run", run_name, url=redis_url)
    assert both.returncode == 2


def test_reason_class() -> None:
    assert (
        dlq.reason_class("decode: invalid 'sample' event: 2 errors: x: y") == "decode: invalid 'sample' event"
    )
    assert dlq.reason_class("fence: group 3:1: step 3, policy_version 2; trainer is at 3") == "fence"
    assert (
        dlq.reason_class("unexpected kind 'plan' on rp:{t1}:requests") == "unexpected kind 'plan' on requests"
    )
    assert dlq.reason_class("") == "(no reason)"
