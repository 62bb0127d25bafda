"""``rolloutpipe status``: one run at a glance, and its ``--check`` health verdict.

:func:`collect_status` reads the run's streams and consumer groups, live workers, policy version,
current step and frontier, and ``stats`` counters into one JSON-ready record; :func:`render_status`
prints it for a human and :func:`health` / :func:`worker_health` turn it into an exit code.  It
only reads (``XINFO``, ``GET``, ``SCAN`` of the run's own keys, ``HGETALL``, …): it never joins a
consumer group, so it leaves no pending entries and moves no role's offsets.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from redis.exceptions import ResponseError

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import Allocation, PolicyVersion, StepPlan
from rolloutpipe.broker.keys import STREAMS, Groups, Keys, pool_keys, run_keys
from rolloutpipe.broker.state import live_heartbeats_sync
from rolloutpipe.broker.streams import lag_of
from rolloutpipe.errors import CodecError
from rolloutpipe.tools.view import as_str, plan_sizes


def collect_status(r: redis.Redis, run: str, now: float | None = None) -> dict[str, Any]:
    """Everything ``status`` shows, JSON-ready: streams and their consumer groups, live workers,
    the policy version, the current step and its frontier, and the ``stats`` counters."""
    now = time.time() if now is None else now
    k = Keys(run)
    streams = {name: _stream_info(r, getattr(k, name)) for name in STREAMS}
    shards = _int(r.get(k.sample_shards)) or 1  # samples:1.. of a run split across aggregators
    streams.update({f"samples:{i}": _stream_info(r, k.samples_shard(i)) for i in range(1, shards)})
    workers = _workers(r, k, now)
    version = _version(r, k, now)
    step = _current_step(r, k, version)
    stats = {as_str(f): int(v) for f, v in r.hgetall(k.stats).items() if _is_int(v)}
    pool = _pool(r, run, workers)
    others = (k.version, k.stats, k.done, *(getattr(k, s) for s in STREAMS))
    return {
        "run": run,
        "time": now,
        "exists": bool(r.exists(*others)) or bool(workers) or step is not None,
        "done": bool(r.exists(k.done)),
        "version": version,
        "step": step,
        "streams": streams,
        "workers": workers,
        "pool": pool,
        "stats": {
            "total": {f: v for f, v in sorted(stats.items()) if ":" not in f},
            "step": {
                f.rsplit(":", 1)[0]: v
                for f, v in sorted(stats.items())
                if step is not None and f.endswith(f":{step['step']}")
            },
        },
    }


def _stream_info(r: redis.Redis, key: str) -> dict[str, Any]:
    groups: list[dict[str, Any]] = []
    try:
        raw: Any = r.xinfo_groups(key)
    except ResponseError:  # no such key: the stream was never written
        raw = []
    for g in raw:
        name = as_str(g["name"])
        consumers: Any = r.xinfo_consumers(key, name)
        groups.append(
            {
                "name": name,
                "pending": int(g["pending"]),
                "lag": None if g.get("lag") is None else int(g["lag"]),
                "last_delivered_id": as_str(g["last-delivered-id"]),
                "consumers": [
                    {
                        "name": as_str(c["name"]),
                        "pending": int(c["pending"]),
                        "idle_s": int(c["idle"]) / 1000,
                        # Redis >= 7.2: since the last successful read (idle counts any attempt)
                        "inactive_s": None if c.get("inactive") in (None, -1) else int(c["inactive"]) / 1000,
                    }
                    for c in consumers
                ],
            }
        )
    return {"key": key, "length": int(r.xlen(key)), "groups": groups}


def _pool(r: redis.Redis, run: str, workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A pool's leases and each run's share (``--run pool:NAME``), or, for a run served by a shared
    pool, how many of the pool's live workers serve it now."""
    if run.startswith("pool:"):
        lease = {as_str(w): as_str(x) for w, x in r.hgetall(Keys(run).lease).items()}
        live = {w["id"] for w in workers}
        shares: dict[str, int] = {}
        for w, x in sorted(lease.items()):
            if w in live and x:
                shares[x] = shares.get(x, 0) + 1
        return {"name": run.split(":", 1)[1], "members": len(live), "lease": lease, "shares": shares}
    names = {w.get("pool") for w in workers if w.get("pool")}
    if not names:
        return None
    name = sorted(str(n) for n in names)[0]
    members = len(live_heartbeats_sync(r, pool_keys(name)))
    return {"name": name, "members": members, "serving": sum(1 for w in workers if w.get("pool") == name)}


def _workers(r: redis.Redis, k: Keys, now: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for wid, raw, ttl in sorted(live_heartbeats_sync(r, k)):  # the run's registry, no SCAN
        try:
            hb = json.loads(raw)
            fields = (
                "capacity",
                "inflight",
                "version",
                "samples",
                "migrations",
                "pid",
                "host",
                "pool",
                "run",
            )
            info = {f: hb.get(f) for f in fields}
            info["heartbeat_age_s"] = round(now - float(hb["t"]), 3)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            info = {"error": f"bad heartbeat: {e}"}
        out.append({"id": wid, **info, "ttl_s": int(ttl)})
    return out


def _version(r: redis.Redis, k: Keys, now: float) -> dict[str, Any] | None:
    raw: Any = r.get(k.version)
    if raw is None:
        return None
    try:
        pv = DEFAULT_CODEC.decode_as(raw, PolicyVersion)
    except CodecError as e:
        return {"error": str(e)}
    return {
        "policy_version": pv.policy_version,
        "published_at": pv.published_at,
        "age_s": round(now - pv.published_at, 3),
        "path": pv.path,
    }


def _current_step(r: redis.Redis, k: Keys, version: dict[str, Any] | None) -> dict[str, Any] | None:
    """The highest step with a plan, with how far its requests, samples and groups have got."""
    steps = [
        int(s)
        for key in run_keys(r, k, k.prefix + "plan:*")  # on a cluster: only the run's own node
        if (s := key.rsplit(":", 1)[-1]).isdigit()
    ]
    if not steps:
        return None
    step = max(steps)
    try:
        plan = DEFAULT_CODEC.decode_as(r.get(k.plan(step)), StepPlan)
    except CodecError as e:
        return {"step": step, "error": str(e)}
    gpm = plan.groups_per_minibatch
    allocs = {as_str(g): DEFAULT_CODEC.decode_as(v, Allocation) for g, v in r.hgetall(k.alloc(step)).items()}
    emitted = int(r.scard(k.emitted(step)))
    trained = version is not None and int(version.get("policy_version", -1)) > step
    frontier = emitted < plan.n_groups and not trained
    return {
        "step": step,
        "policy": plan.policy,
        "groups": plan.n_groups,
        "group_sizes": plan_sizes(plan),
        "minibatches": plan.minibatches,
        "requests_released": _int(r.get(k.released(step))),
        "requests_total": sum(
            {**{g.group_id: g.n for g in plan.groups}, **{g: a.n for g, a in allocs.items()}}.values()
        ),
        "groups_closed": sum(1 for a in allocs.values() if a.status == "closed"),
        "groups_skipped": sum(1 for a in allocs.values() if a.status == "skipped"),
        "samples_discarded": _int(r.hget(k.stats, f"discarded_samples:{step}")),
        "samples_finished": _int(r.get(k.finished(step))),
        "migrations": _int(r.hget(k.stats, f"migrations:{step}")),  # requests moved mid-decode
        "migrated_tokens": _int(r.hget(k.stats, f"migrated_tokens:{step}")),
        "groups_emitted": emitted,
        "groups_consumed": int(r.scard(k.consumed(step))),  # written when the step's training ends
        "state": "trained" if trained else ("rolling out" if frontier else "training"),
        # the mini-batch the trainer needs next (0-based, as in FrontierStatus) and what it lacks
        "frontier_minibatch": emitted // gpm if frontier else None,
        "frontier_needs": gpm - emitted % gpm if frontier else 0,
    }


def health(st: dict[str, Any], stuck_after_s: float = 600.0) -> tuple[int, str]:
    """``--check``: 0 healthy or done; 1 no live rollout worker, or the trainer is stuck (groups
    wait for it and no policy version came for ``stuck_after_s``); 2 no such run."""
    run = st["run"]
    if not st["exists"]:
        return 2, f"unhealthy: unknown run {run!r}: no keys under rp:{{{run}}}:"
    if st["done"]:
        return 0, f"ok: run {run!r} is done"
    live = [w for w in st["workers"] if "error" not in w]
    if not live:
        return 1, f"unhealthy: no live rollout worker heartbeat for run {run!r}"
    v = st["version"]
    waiting = trainer_backlog(st)
    if v is not None and "age_s" in v and waiting and v["age_s"] > stuck_after_s:
        return 1, (
            f"unhealthy: trainer stuck: {waiting} groups wait for it and policy version "
            f"{v['policy_version']} is {v['age_s']:.0f}s old (> {stuck_after_s:.0f}s)"
        )
    step = st["step"] or {}
    where = f", step {step['step']} {step.get('state', '')}".rstrip() if "step" in step else ""
    pv = v.get("policy_version", "?") if v else "none yet"
    return 0, f"ok: {len(live)} live rollout workers, policy version {pv}{where}"


def worker_health(r: Any, run: str, worker: str) -> tuple[int, str]:
    """``--check --worker ID``: 0 while that worker's heartbeat key lives, else 1."""
    ttl = int(r.pttl(Keys(run).heartbeat(worker)))
    if ttl == -2:  # no such key: never started, or its TTL ran out (dead or stuck)
        return 1, f"unhealthy: no live heartbeat for worker {worker!r} of run {run!r}"
    return 0, f"ok: worker {worker!r} heartbeat live"


def trainer_backlog(st: dict[str, Any]) -> int:
    """Groups not yet trained on: the ``trainer`` group's lag + pending (all of them with no such group)."""
    groups = st["streams"]["groups"]
    trainer = [g for g in groups["groups"] if g["name"] == Groups.TRAINER]
    if not trainer:
        return int(groups["length"])
    lag = lag_of(trainer, Groups.TRAINER)  # the same reading as the controller's backpressure
    return int(trainer[0]["pending"]) if lag is None else lag


def render_status(st: dict[str, Any]) -> str:
    """The human-readable form of ``collect_status``."""
    lines = [
        f"run {st['run']}" + ("  (done)" if st["done"] else "") + ("" if st["exists"] else "  (unknown)")
    ]
    v = st["version"]
    if v is None:
        lines.append("policy version  none published")
    elif "error" in v:
        lines.append(f"policy version  undecodable: {v['error']}")
    else:
        lines.append(f"policy version  {v['policy_version']}  (published {v['age_s']:.1f}s ago)")
    s = st["step"]
    if s is not None and "error" not in s:
        needs = s["frontier_needs"]
        if s["frontier_minibatch"] is not None:
            fr = f"mini-batch {s['frontier_minibatch'] + 1}/{s['minibatches']} needs {needs} more group"
            fr += "s" if needs != 1 else ""
        else:
            fr = "none: " + ("the step is trained" if s["state"] == "trained" else "every group is emitted")
        lines += [
            f"step            {s['step']}  {s['policy']}  {s['state']}",
            f"frontier        {fr}",
            f"progress        requests {s['requests_released']}/{s['requests_total']} released, "
            f"{s['samples_finished']} finished; groups {s['groups_emitted']}/{s['groups']} emitted, "
            f"{s['groups_consumed']} consumed",
            f"migration       {s['migrations']} requests moved mid-decode, "
            f"{s['migrated_tokens']} tokens re-prefilled on their new workers",
            f"allocation      {s['group_sizes']}; {s['groups_closed']} closed, "
            f"{s['groups_skipped']} skipped, "
            f"{s['samples_discarded']} samples discarded",
        ]
    elif s is not None:
        lines.append(f"step            {s['step']}  undecodable plan: {s['error']}")
    pool = st.get("pool")
    if pool and "shares" in pool:
        sh = ", ".join(f"{run} {n}" for run, n in pool["shares"].items()) or "none"
        lines.append(f"pool            {pool['name']}: {pool['members']} live workers; shares {sh}")
    elif pool:
        n, m = pool["serving"], pool["members"]
        lines.append(f"pool            {n} of the {m} live workers of pool {pool['name']} serve this run")
    lines += ["", *_table(("stream", "length", "group", "pending", "lag", "consumers"), _stream_rows(st))]
    consumers = [
        (c["name"], name, g["name"], c["pending"], f"{c['idle_s']:.1f}")
        for name, info in st["streams"].items()
        for g in info["groups"]
        for c in g["consumers"]
    ]
    if consumers:
        lines += ["", *_table(("consumer", "stream", "group", "pending", "idle_s"), consumers)]
    wcols = (
        "capacity",
        "inflight",
        "version",
        "samples",
        "migrations",
        "host",
        "pid",
        "heartbeat_age_s",
        "ttl_s",
    )
    rows = [
        (w["id"], w["error"], *[""] * (len(wcols) - 1)) if "error" in w else (w["id"], *(w[c] for c in wcols))
        for w in st["workers"]
    ]
    lines += ["", *(_table(("worker", *wcols), rows) if rows else ["workers: no live heartbeat"])]
    total, per_step = st["stats"]["total"], st["stats"]["step"]
    if total:
        lines += ["", "counters: " + "  ".join(f"{f} {v}" for f, v in total.items())]
    if per_step and s is not None:
        lines.append(f"step {s['step']}: " + "  ".join(f"{f} {v}" for f, v in per_step.items()))
    return "\n".join(lines)


def _stream_rows(st: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for name, info in st["streams"].items():
        if not info["groups"]:
            rows.append((name, info["length"], "-", "", "", ""))
        for g in info["groups"]:
            lag = "?" if g["lag"] is None else g["lag"]
            rows.append((name, info["length"], g["name"], g["pending"], lag, len(g["consumers"])))
    return rows


def _table(head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    cells = [list(head), *([str(x) for x in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    numeric = [all(_is_number(row[i]) for row in cells[1:]) for i in range(len(head))]
    return [
        "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True)
        ).rstrip()
        for row in cells
    ]


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return s == ""
    return True


def _is_int(v: Any) -> bool:
    try:
        int(v)
    except (TypeError, ValueError):
        return False
    return True


def _int(v: Any) -> int:
    return int(v) if v is not None and _is_int(v) else 0
