"""``rolloutpipe bench --suite broker``: the streaming path at scale, against the Redis ceiling.

Why: the other suites measure schedules, with the engine and the trainer emulated at a realistic
speed, so the broker is never the bottleneck there.  This suite takes the engine and the trainer
out (an instant or paced emulated engine, an emulated trainer at time scale 0) and asks what the
real path publish -> aggregator -> group -> trainer read and acknowledgement sustains with
realistic payloads (1k-8k response tokens: 8-64 KiB samples), how long a complete group waits to
be read, and which process saturates first.

Each row is one real run (``rolloutpipe.launch.cluster.run_cluster``: every role its own process) in a
namespace of its own on one private Redis, repeated ``repeats`` times.  Figures, all observed:

* ``samples_per_s``: samples trained after the warm-up step / wall seconds between the end of
  step 0's training and the end of the last step's (step boundaries included: they are the path);
* dispatch latency p50/p99: the trainer's read of a group minus its last sample's ``finished_at``
  (stamped by the worker just before it encodes the sample and XADDs it), from ``timeline.jsonl``;
* CPU (cores) of Redis (``INFO cpu``) and of each role (``/proc/<pid>/stat``), and Redis memory
  and network bytes (``INFO``), sampled every ``SAMPLE_S`` over the same window;
* the ceiling: one redis-py client pipelining XADDs of the same encoded sample bytes, and
  ``redis-benchmark`` (if on PATH) doing the same with a payload of the same size.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
import yaml

from rolloutpipe.bench.paper import CONFIGS
from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.connect import cluster_node_url
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.events import AllocationRecord, FrontierStatus, Group, Sample
from rolloutpipe.broker.keys import Groups, Keys, run_keys
from rolloutpipe.config import load_config
from rolloutpipe.errors import ConfigError
from rolloutpipe.launch.cluster import run_cluster

SAMPLE_S = 0.2  # how often Redis INFO and the roles' CPU clocks are read
ROLES = ("controller", "rollout", "aggregator", "trainer")
SETTINGS = ("workers", "response_tokens", "prompt_tokens", "offered_samples_per_s", "slots",
            "repeats", "steps", "prompts_per_step", "group_size", "minibatches", "ceiling_s",
            "ceiling_pipeline", "aggregators", "drain_groups")  # fmt: skip
WAITERS = ("redis", "aggregator", "trainer", "rollout")  # processes whose run-queue wait is summed


def _spec_path(name: str) -> Path:
    return Path(name) if name.endswith(".yaml") else CONFIGS / "bench" / f"{name}.yaml"


def is_broker_suite(name: str) -> bool:
    """A broker suite names ``response_tokens`` (an allocation suite ``policies``, the paper suite
    ``workloads``)."""
    path = _spec_path(name)
    return path.exists() and "response_tokens" in (yaml.safe_load(path.read_text()) or {})


def load_spec(name: str, quick: bool = False) -> dict[str, Any]:
    path = _spec_path(name)
    if not path.exists():
        raise ConfigError(f"benchmark suite {name!r} not found (looked for {path})")
    spec = yaml.safe_load(path.read_text()) or {}
    quick_over = spec.pop("quick", {}) or {}
    if quick:
        spec.update(quick_over)
    missing = [k for k in SETTINGS if k not in spec and k not in ("aggregators", "drain_groups")]
    unknown = [k for k in spec if k not in (*SETTINGS, "base")]
    if missing or unknown:
        raise ConfigError(f"{path}: missing settings {missing}, unknown settings {unknown}")
    spec["base"] = str((path.parent / spec.get("base", "../bench-quick.yaml")).resolve())
    spec.setdefault("aggregators", [1])  # suites written before aggregator shards
    spec.setdefault("drain_groups", 256)  # the one-aggregator measurement: groups put on samples first
    for k in ("workers", "response_tokens", "aggregators"):
        if not spec[k] or any(int(x) < 1 for x in spec[k]):
            raise ConfigError(f"{path}: {k} must be a non-empty list of positive integers")
    if any(x is not None and float(x) <= 0 for x in spec["offered_samples_per_s"]):
        raise ConfigError(f"{path}: offered_samples_per_s entries must be positive, or null (unbounded)")
    if spec["steps"] < 2:
        raise ConfigError(f"{path}: steps must be at least 2 (step 0 is warm-up, not measured)")
    return spec


@dataclass(frozen=True)
class Row:
    workers: int
    tokens: int
    offered: float | None  # samples/s over all workers; None: the instant engine
    repeat: int
    aggregators: int = 1  # redis.sample_shards: one aggregator process a samples stream

    @property
    def name(self) -> str:
        load = "max" if self.offered is None else f"{self.offered:g}"
        aggs = f"-a{self.aggregators}" if self.aggregators > 1 else ""
        return f"broker-w{self.workers}-t{self.tokens}-o{load}{aggs}-r{self.repeat}"


def rows_of(spec: dict[str, Any]) -> list[Row]:
    return [Row(int(w), int(t), None if o is None else float(o), r, int(a))
            for t in spec["response_tokens"] for o in spec["offered_samples_per_s"]
            for a in spec["aggregators"] for w in spec["workers"]
            for r in range(int(spec["repeats"]))]  # fmt: skip


def row_overrides(spec: dict[str, Any], row: Row, out: Path) -> list[str]:
    """The run's config: a fixed response length, an engine that is instant or paced, a null trainer.

    Pacing: each sample lasts one emulated second (``decode_base_s`` = 1 / tokens, no per-sequence
    or prefill cost), so ``time_scale`` is the wall seconds a sample takes in one of ``slots``.
    """
    slots = int(spec["slots"])
    scale = 0.0 if row.offered is None else slots * row.workers / row.offered
    return [
        f"run={row.name}",
        f"out={out / row.name}",
        "controller.mode=cgp",
        f"controller.steps={spec['steps']}",
        f"controller.prompts_per_step={spec['prompts_per_step']}",
        f"controller.group_size={spec['group_size']}",
        f"controller.minibatches={spec['minibatches']}",
        "rollout.engine=emulated",
        f"rollout.workers={row.workers}",
        f"redis.sample_shards={row.aggregators}",
        f"rollout.emulated.max_num_seqs={slots}",
        f"rollout.emulated.prompt_tokens={spec['prompt_tokens']}",
        f"rollout.emulated.length_median={row.tokens}",
        "rollout.emulated.length_sigma=0.0",
        f"rollout.emulated.max_response_tokens={row.tokens + 1}",  # finish_reason "stop", not "length"
        f"rollout.emulated.decode_base_s={1.0 / row.tokens}",
        "rollout.emulated.decode_per_seq_s=0.0",
        "rollout.emulated.prefill_per_token_s=0.0",
        f"rollout.emulated.time_scale={scale}",
        "trainer.backend=emulated",
        "trainer.emulated.time_scale=0.0",
        "trainer.record_timeline=true",
    ]


# ------------------------------------------------------------------------------------ payloads


def sample_payload(tokens: int, prompt_tokens: int, run: str = "broker-ceiling") -> bytes:
    """One encoded ``Sample`` as the emulated engine's workers publish it (ids + logprobs packed)."""
    rng = np.random.default_rng(0)
    s = Sample(
        run=run, step=0, policy_version=0, sample_id="0-0:0:0", request_id="0-0:0:0", group_id="0:0",
        prompt_index=0, sample_index=0, worker=f"{run}-w0",
        prompt_ids=np.zeros(prompt_tokens, np.int32),
        response_ids=rng.integers(3, 18, size=tokens, dtype=np.int32),
        logprobs=np.log(rng.uniform(0.2, 1.0, size=tokens)).astype(np.float32),
        reward=1.0, admitted_at=time.time(), finished_at=time.time(),
    )  # fmt: skip
    return DEFAULT_CODEC.encode(s)


def bytes_breakdown(tokens: int, prompt_tokens: int, group_size: int) -> dict[str, int]:
    """Where a sample's bytes go: its arrays, its envelope, and its share of the group that re-embeds it."""
    raw = sample_payload(tokens, prompt_tokens)
    s = DEFAULT_CODEC.decode(raw)
    assert isinstance(s, Sample)
    g = Group(
        run=s.run, step=0, policy_version=0, group_id="0:0", prompt_index=0,
        samples=[s] * group_size, advantages=np.zeros(group_size, np.float32),
        frontier=FrontierStatus(minibatch=0, position=0, minibatch_size=1, needed=0, total_groups=1),
        allocation=AllocationRecord(initial=group_size), completed_at=time.time(),
    )  # fmt: skip
    group_bytes = len(DEFAULT_CODEC.encode(g))
    return {
        "sample_bytes": len(raw),
        "response_ids_bytes": 4 * tokens,
        "logprobs_bytes": 4 * tokens,
        "prompt_ids_bytes": 4 * prompt_tokens,
        "envelope_bytes": len(raw) - 8 * tokens - 4 * prompt_tokens,
        "group_bytes_per_sample": group_bytes // group_size,
        # into Redis: the sample's XADD and the group's; out: the aggregator's and the trainer's reads
        "wire_bytes_per_sample": 2 * len(raw) + 2 * (group_bytes // group_size),
    }


# ------------------------------------------------------------------------------------ the ceiling


def ceiling_redis_py(url: str, payload: bytes, seconds: float, pipeline: int) -> float:
    """Samples/s of one redis-py client pipelining ``XADD … MAXLEN ~ 1000 * d payload``."""
    r = redis.Redis.from_url(url)
    key = f"rp:{{broker-ceiling-{uuid.uuid4().hex[:8]}}}:samples"  # a scratch stream of its own
    try:
        r.delete(key)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            p = r.pipeline(transaction=False)
            for _ in range(pipeline):
                p.xadd(key, {b"d": payload}, maxlen=1000, approximate=True)
            p.execute()
            n += pipeline
        return n / (time.perf_counter() - t0)
    finally:
        r.delete(key)
        r.close()


def ceiling_redis_benchmark(url: str, size: int, seconds: float, pipeline: int) -> float | None:
    """``redis-benchmark`` (one client, ``-P pipeline``) XADDing a ``size``-byte field; None if absent."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    kw = redis.Redis.from_url(url).connection_pool.connection_kwargs
    host, port = str(kw.get("host", "127.0.0.1")), int(kw.get("port", 6379))
    auth = ["--user", str(kw["username"])] if kw.get("username") else []
    auth += ["-a", str(kw["password"]), "--no-auth-warning"] if kw.get("password") else []
    key = f"rp:{{broker-rb-{uuid.uuid4().hex[:8]}}}:samples"
    # a first short run sizes the real one to about ``seconds``
    rate = 0.0
    for n in (max(pipeline, 200), 0):
        if n == 0:
            n = max(pipeline, int(rate * seconds))
        cmd = [exe, "-h", host, "-p", str(port), *auth, "-c", "1", "-P", str(pipeline), "-n", str(n),
               "--csv", "XADD", key, "MAXLEN", "~", "1000", "*", "d", "x" * size]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if res.returncode != 0:
            return None
        try:
            rate = float(res.stdout.strip().splitlines()[-1].split('","')[1].strip('"'))
        except (IndexError, ValueError):
            return None
    with contextlib.suppress(redis.RedisError):
        redis.Redis.from_url(url).delete(key)
    return rate


# ------------------------------------------------------------------------------------ one aggregator


def aggregator_capacity(
    url: str, tokens: int, prompt_tokens: int, group_size: int, groups: int
) -> dict[str, float]:
    """What one aggregator process can take: ``groups`` complete groups of real samples are put on
    ``samples`` first, then an in-process ``Aggregator`` drains them (reads, decodes, emits groups
    with the emit script) as fast as it can.  Samples per second of its wall clock and per second
    of its CPU: the second is the one to size from (one aggregator on a core of its own)."""
    return asyncio.run(_drain(url, tokens, prompt_tokens, group_size, groups))


async def _drain(url: str, tokens: int, prompt_tokens: int, group_size: int, groups: int) -> dict[str, float]:
    from rolloutpipe.broker.connect import connect
    from rolloutpipe.broker.events import GroupPlan, PolicyVersion, StepPlan
    from rolloutpipe.broker.keys import DATA
    from rolloutpipe.broker.streams import Broker
    from rolloutpipe.roles.aggregator import Aggregator

    run = f"broker-drain-{uuid.uuid4().hex[:8]}"
    r = connect(url)
    try:
        b = Broker(r, run, "aggregator", maxlen=10 * groups * group_size)
        k = b.keys
        gps = [GroupPlan(group_id=f"0:{g}", prompt_index=g, n=group_size) for g in range(groups)]
        plan = StepPlan(run=run, step=0, policy_version=0, policy="fifo", groups=gps, minibatches=1,
                        groups_per_minibatch=groups, created_at=time.time())  # fmt: skip
        await b.write_plan(plan)
        pv = PolicyVersion(run=run, step=0, policy_version=0, path="", sha256={}, published_at=time.time())
        await b.publish_version(pv, None)
        await b.ensure_group(k.samples, Groups.AGGREGATOR)
        rng = np.random.default_rng(0)
        for i in range(group_size):  # interleaved across groups, as many workers publish them
            pipe = r.pipeline(transaction=False)
            for g in range(groups):
                s = Sample(
                    run=run, step=0, policy_version=0, sample_id=f"{g}:{i}", request_id=f"{g}:{i}",
                    group_id=f"0:{g}", prompt_index=g, sample_index=i, worker="w0",
                    prompt_ids=np.zeros(prompt_tokens, np.int32),
                    response_ids=rng.integers(3, 18, size=tokens, dtype=np.int32),
                    logprobs=np.log(rng.uniform(0.2, 1.0, size=tokens)).astype(np.float32),
                    reward=float(rng.random() < 0.5), admitted_at=1.0, finished_at=2.0,
                )  # fmt: skip
                pipe.xadd(k.samples, {DATA: DEFAULT_CODEC.encode(s)})
            await pipe.execute()
        cfg = load_config(CONFIGS / "bench-quick.yaml", [f"run={run}", "out=/nonexistent"], environ={})
        agg = Aggregator(cfg, b, "drain-0")
        t0, c0 = time.perf_counter(), time.process_time()
        while agg.groups_emitted < groups:
            await agg.on_batch(await b.read(k.samples, Groups.AGGREGATOR, "drain-0", count=256, block_ms=10))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = groups * group_size
        return {"aggregator_samples_per_s": n / wall, "aggregator_samples_per_cpu_s": n / max(cpu, 1e-9)}
    finally:
        keys = [x async for x in r.scan_iter(match=f"rp:{{{run}}}:*", count=1000)]
        if keys:
            await r.unlink(*keys)
        await r.aclose()


# ------------------------------------------------------------------------------------ sampling


def _children() -> dict[int, str]:
    """This process's children that are roles: pid -> role (from their command lines)."""
    out: dict[int, str] = {}
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != me:
                continue
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for i, a in enumerate(argv[:-1]):
            if a == b"rolloutpipe" and argv[i + 1].decode() in ROLES:
                out[int(d.name)] = argv[i + 1].decode()
    return out


def _cpu_s(pid: int) -> tuple[float, float] | None:
    """User + system CPU seconds of ``pid`` (``/proc/<pid>/stat`` fields 14 and 15), and the seconds
    its main thread was runnable but waiting for a CPU (``/proc/<pid>/schedstat``; 0 if absent).

    The wait tells a saturated process from one that only waits for its turn on a busy machine.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    try:
        wait = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        wait = 0.0
    return cpu, wait


class Sampler(threading.Thread):
    """Reads Redis ``INFO`` and every role's CPU clock every ``SAMPLE_S`` while a row runs."""

    def __init__(self, url: str, redis_pid: int | None = None, run: str = "", aggregators: int = 1) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.redis_pid = redis_pid
        # the queues in front of the aggregator and the trainer: entries not yet delivered to them
        k = Keys(run)
        shards = k.sample_streams(aggregators)
        self.queues = {"aggregator": (shards, Groups.AGGREGATOR), "trainer": ([k.groups], Groups.TRAINER)}
        self.snaps: list[dict[str, Any]] = []
        self._halt = threading.Event()
        self.has_proc = Path("/proc/self/stat").exists()

    def run(self) -> None:
        while not self._halt.is_set():
            with contextlib.suppress(redis.RedisError):
                info: Any = self.r.info()
                roles: dict[str, tuple[float, float]] = {}
                procs = _children() if self.has_proc else {}
                if self.redis_pid is not None and self.has_proc:
                    procs[self.redis_pid] = "redis"
                for pid, role in procs.items():
                    c = _cpu_s(pid)
                    if c is not None:
                        roles[f"{role}:{pid}"] = c
                backlog = {
                    role: sum(self._lag(st, g) for st in streams)
                    for role, (streams, g) in self.queues.items()
                }
                self.snaps.append({
                    "backlog": backlog,
                    "t": time.time(),
                    "redis_cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                    "used_memory": int(info["used_memory"]),
                    "net_in": int(info["total_net_input_bytes"]),
                    "net_out": int(info["total_net_output_bytes"]),
                    "roles": roles,
                })  # fmt: skip
            self._halt.wait(SAMPLE_S)

    def _lag(self, stream: str, group: str) -> int:
        """Entries of ``stream`` not yet delivered to ``group`` (XINFO GROUPS ``lag``; 0 before it exists)."""
        try:
            groups: Any = self.r.xinfo_groups(stream)
        except redis.ResponseError:  # no stream yet
            return 0
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == group:
                return int(g.get("lag") or 0)
        return 0

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.r.close()

    def window(self, a: float, b: float) -> dict[str, float]:
        """Rates over [a, b] from the snapshots nearest inside it: cores, bytes, bytes/s."""
        inside = [s for s in self.snaps if a <= s["t"] <= b]
        if len(inside) < 2:
            inside = sorted(self.snaps, key=lambda s: min(abs(s["t"] - a), abs(s["t"] - b)))[:2]
            inside.sort(key=lambda s: s["t"])
        if len(inside) < 2:
            return {}
        s0, s1 = inside[0], inside[-1]
        dt = max(s1["t"] - s0["t"], 1e-9)
        out = {
            "redis_cpu": (s1["redis_cpu_s"] - s0["redis_cpu_s"]) / dt,
            "redis_used_memory_max_bytes": float(max(s["used_memory"] for s in inside)),
            "redis_net_in_bytes_per_s": (s1["net_in"] - s0["net_in"]) / dt,
            "redis_net_out_bytes_per_s": (s1["net_out"] - s0["net_out"]) / dt,
            "redis_net_in_bytes": float(s1["net_in"] - s0["net_in"]),
            "redis_net_out_bytes": float(s1["net_out"] - s0["net_out"]),
        }
        for role in self.queues:  # how many entries waited in front of each consumer, on average
            out[f"{role}_backlog_mean"] = statistics.fmean(s["backlog"][role] for s in inside)
            out[f"{role}_backlog_max"] = float(max(s["backlog"][role] for s in inside))
        r0, r1 = s0["roles"], s1["roles"]
        for role in (*ROLES, "redis"):  # summed over a role's processes (the rollout workers)
            keys = [k for k in r0 if k.startswith(role + ":") and k in r1]
            if not keys:
                continue
            if role != "redis":  # Redis's CPU comes from INFO (every thread), its wait from here
                out[f"{role}_cpu"] = sum(r1[k][0] - r0[k][0] for k in keys) / dt
            out[f"{role}_runq_wait"] = sum(r1[k][1] - r0[k][1] for k in keys) / dt
            if role in ("rollout", "aggregator"):  # the busiest one process (one thread each)
                out[f"{role}_cpu_max_one"] = max(r1[k][0] - r0[k][0] for k in keys) / dt
        return out


# ------------------------------------------------------------------------------------ one row


def run_row(
    spec: dict[str, Any], row: Row, url: str, out: Path, redis_pid: int | None = None
) -> dict[str, Any]:
    cfg = load_config(Path(spec["base"]), row_overrides(spec, row, out), environ={})
    run_out = Path(cfg.out)
    load0 = os.getloadavg()[0]
    calls0 = _command_calls(url)
    sampler = Sampler(url, redis_pid, cfg.run, row.aggregators)
    sampler.start()
    try:
        ms = sorted(run_cluster(cfg, url, run_out, progress=False, timeout_s=900), key=lambda m: m.step)
    finally:
        sampler.stop()
        calls1 = _command_calls(url)
        _drop_run(url, cfg.run)
    measured = ms[1:]
    a, b = ms[0].train_end, ms[-1].train_end
    samples = sum(m.samples for m in measured)
    lat: list[float] = []
    for line in (run_out / "timeline.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] >= 1:
            lat += [g["read_at"] - max(s[2] for s in g["samples"]) for g in rec["groups"]]
    if not lat:
        raise RuntimeError(f"run {cfg.run}: no group read after the warm-up step (timeline.jsonl)")
    res: dict[str, Any] = {
        "name": row.name,
        "workers": row.workers,
        "aggregators": row.aggregators,
        "response_tokens": row.tokens,
        "offered_samples_per_s": row.offered,
        "repeat": row.repeat,
        "group_size": cfg.controller.group_size,
        "steps_measured": len(measured),
        "samples_released": sum(m.samples + m.samples_wasted for m in ms),
        "samples_trained": sum(m.samples for m in ms),
        "dead_letters": sum(m.dead_letters + m.fence_rejections for m in ms),
        "window_s": b - a,
        "samples_per_s": samples / max(b - a, 1e-9),
        "dispatch_p50_s": float(np.percentile(lat, 50)),
        "dispatch_p99_s": float(np.percentile(lat, 99)),
        "groups_measured": len(lat),
        "loadavg_1m": [load0, os.getloadavg()[0]],  # before and after: other work on the machine
    }
    res.update(sampler.window(a, b))
    # Redis commands a sample costs, over the whole run (a shared server counts others' too)
    released = max(1, res["samples_released"])
    per = {c: (calls1.get(c, 0) - calls0.get(c, 0)) / released for c in calls1}
    res["redis_calls_per_sample"] = {c: round(v, 3) for c, v in sorted(per.items()) if v >= 0.01}
    res["redis_calls_per_sample_total"] = sum(per.values())
    if samples and "redis_net_in_bytes" in res:
        res["redis_net_in_bytes_per_sample"] = res["redis_net_in_bytes"] / samples
        res["redis_net_out_bytes_per_sample"] = res["redis_net_out_bytes"] / samples
    return res


def _command_calls(url: str) -> dict[str, int]:
    """``INFO commandstats``: calls so far, per command."""
    r = redis.Redis.from_url(url)
    try:
        stats: Any = r.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    finally:
        r.close()


def _drop_run(url: str, run: str) -> None:
    """Delete a finished row's keys, so the next row starts on an empty Redis."""
    r = redis.Redis.from_url(url)
    try:
        keys = run_keys(r, Keys(run), f"rp:{{{run}}}:*")
        for i in range(0, len(keys), 500):
            r.unlink(*keys[i : i + 500])
    finally:
        r.close()


# ------------------------------------------------------------------------------------ summary

STATS = ("samples_per_s", "dispatch_p50_s", "dispatch_p99_s", "redis_cpu", "aggregator_cpu",
         "trainer_cpu", "rollout_cpu", "controller_cpu", "redis_runq_wait", "aggregator_runq_wait",
         "trainer_runq_wait", "rollout_runq_wait", "redis_used_memory_max_bytes",
         "redis_net_in_bytes_per_sample", "redis_net_out_bytes_per_sample",
         "redis_calls_per_sample_total", "aggregator_backlog_mean", "trainer_backlog_mean",
         "aggregator_cpu_max_one")  # fmt: skip


def summarise(
    runs: list[dict[str, Any]], payload: dict[int, int], ceiling: dict[int, float]
) -> list[dict[str, Any]]:
    """One row per (workers, tokens, offered, aggregators): the median over repeats, the min and max."""
    keyed: dict[tuple[int, int, float | None, int], list[dict[str, Any]]] = {}
    for r in runs:
        key = (r["workers"], r["response_tokens"], r["offered_samples_per_s"], r.get("aggregators", 1))
        keyed.setdefault(key, []).append(r)
    rows = []
    for (w, t, o, a), rs in keyed.items():
        row: dict[str, Any] = {"workers": w, "aggregators": a, "response_tokens": t,
                               "payload_bytes": payload[t], "offered_samples_per_s": o, "repeats": len(rs),
                               "group_size": rs[0]["group_size"]}  # fmt: skip
        for k in STATS:
            xs = [r[k] for r in rs if k in r]
            if xs:
                row[k] = statistics.median(xs)
                row[k + "_min"], row[k + "_max"] = min(xs), max(xs)
        row["ceiling_samples_per_s"] = ceiling[t]
        row["ratio_to_ceiling"] = row["samples_per_s"] / ceiling[t]
        rows.append(row)
    return rows


def saturation(row: dict[str, Any]) -> str:
    """Which stage saturated first.  Redis and each Python role run on one thread, so one at 0.85
    core or more is saturated.  Below that a stage can still be the bottleneck, bound by its
    round trips or by waiting for a CPU: then entries queue in front of it (a group's worth or more
    on average), and the stage with the longer queue is the one that fell behind.  With nothing
    queued and the offered load not reached (or no limit offered), the workers themselves are the
    limit: they generate, encode and publish every sample.  When the processes wait for a CPU (the
    run-queue wait: on average that many runnable threads had no core), the machine's cores are
    what is full, whichever stage shows the queue."""
    single = {k: row.get(f"{k}_cpu", 0.0) for k in ("redis", "aggregator", "trainer", "controller")}
    single["aggregator"] = row.get("aggregator_cpu_max_one", single["aggregator"])  # of several: the busiest
    busiest = max(single, key=lambda k: single[k])
    wait = sum(row.get(f"{k}_runq_wait", 0.0) for k in WAITERS)
    cores = f"; cores full: {wait:.1f} runnable processes wait for one" if wait >= 1.0 else ""
    if single[busiest] >= 0.85:
        return f"{busiest} (CPU: {single[busiest]:.2f} core){cores}"
    agg, tr = row.get("aggregator_backlog_mean", 0.0), row.get("trainer_backlog_mean", 0.0)
    group = row.get("group_size", 8)
    if agg >= group and agg >= tr * group:
        return f"aggregator ({agg:.0f} samples queued, {single['aggregator']:.2f} core){cores}"
    if tr >= 1:
        return f"trainer ({tr:.1f} groups queued, {single['trainer']:.2f} core){cores}"
    offered = row.get("offered_samples_per_s")
    if offered is None or row["samples_per_s"] < 0.8 * offered:
        one = row.get("rollout_cpu_max_one", row.get("rollout_cpu", 0.0))
        return f"rollout workers (nothing queued after them; busiest worker {one:.2f} core){cores}"
    return f"none (keeps up; busiest {busiest} {single[busiest]:.2f} core){cores}"


def table(doc: dict[str, Any]) -> str:
    lines = []
    for c in doc["ceilings"]:
        rb = c["redis_benchmark_samples_per_s"]
        lines.append(
            f"ceiling, {c['response_tokens']} tokens ({c['payload_bytes'] / 1024:.1f} KiB a sample): "
            f"redis-py pipelined XADD {c['redis_py_samples_per_s']:,.0f} samples/s"
            + (f", redis-benchmark {rb:,.0f}/s" if rb else ", redis-benchmark not on PATH")
            + f"; the path moves {c['wire_bytes_per_sample'] / c['payload_bytes']:.1f}x a sample's bytes"
            f" through Redis (sample in + out, group in + out); one aggregator alone drains"
            f" {c['aggregator_samples_per_s']:,.0f} samples/s ({c['aggregator_samples_per_cpu_s']:,.0f}"
            " per second of its CPU)"
        )
    lines += [
        "",
        "| workers | aggregators | payload KiB | offered /s | samples/s median [min-max] | of ceiling | "
        "dispatch p50 / p99 ms | Redis CPU | aggregator CPU | trainer CPU | workers CPU | "
        "Redis mem MiB | run-queue wait s/s | queued for aggregator / trainer | saturated first |",
        "|" + "---|" * 15,
    ]

    def rng(r: dict[str, Any], k: str, f: str = ",.0f", scale: float = 1.0) -> str:
        return (f"{r[k] * scale:{f}} [{r[k + '_min'] * scale:{f}}-{r[k + '_max'] * scale:{f}}]"
                if r["repeats"] > 1 else f"{r[k] * scale:{f}}")  # fmt: skip

    for r in doc["rows"]:
        off = "max" if r["offered_samples_per_s"] is None else f"{r['offered_samples_per_s']:,.0f}"
        lines.append(
            f"| {r['workers']} | {r.get('aggregators', 1)} | {r['payload_bytes'] / 1024:.1f} | {off} | "
            f"{rng(r, 'samples_per_s')} | "
            f"{r['ratio_to_ceiling']:.1%} | {r['dispatch_p50_s'] * 1e3:.1f} / "
            f"{rng(r, 'dispatch_p99_s', '.1f', 1e3)} | {r.get('redis_cpu', 0):.2f} | "
            f"{r.get('aggregator_cpu', 0):.2f} | {r.get('trainer_cpu', 0):.2f} | "
            f"{r.get('rollout_cpu', 0):.2f} | {r.get('redis_used_memory_max_bytes', 0) / 2**20:.0f} | "
            f"{sum(r.get(f'{k}_runq_wait', 0.0) for k in WAITERS):.2f} | "
            f"{r.get('aggregator_backlog_mean', 0):.0f} / {r.get('trainer_backlog_mean', 0):.1f} | "
            f"{saturation(r)} |"
        )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """samples/s and dispatch p99 against workers (top) and against the offered load (bottom)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # a dependency, but a missing picture must not lose the numbers
        return None
    rows = doc["rows"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    series: dict[tuple[int, float | None, int], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(
            (r["payload_bytes"], r["offered_samples_per_s"], r.get("aggregators", 1)), []
        ).append(r)
    # one colour per (payload, offered load); solid: one aggregator, dashed: several (shards)
    loads_top = sorted({(r["payload_bytes"], r["offered_samples_per_s"] or float("inf")) for r in rows})
    colour = {k: plt.get_cmap("tab20")(i % 20) for i, k in enumerate(loads_top)}
    order = sorted(series.items(), key=lambda x: (x[0][0], x[0][1] or float("inf"), x[0][2]))
    for (pb, off, na), rs in order:
        rs = sorted(rs, key=lambda r: r["workers"])
        label = f"{pb / 1024:.0f} KiB, offered {'max' if off is None else f'{off:,.0f}/s'}"
        label += f", {na} aggregators" if na > 1 else ""
        xs = [r["workers"] for r in rs]
        c = colour[(pb, off or float("inf"))]
        style: dict[str, Any] = {"marker": "o" if na == 1 else "s", "ls": "-" if na == 1 else "--",
                                 "capsize": 3, "color": c, "label": label}  # fmt: skip
        ax[0][0].errorbar(xs, [r["samples_per_s"] for r in rs], yerr=_err(rs, "samples_per_s"), **style)
        p99 = [r["dispatch_p99_s"] * 1e3 for r in rs]
        ax[0][1].errorbar(xs, p99, yerr=_err(rs, "dispatch_p99_s", 1e3), **style)
    for c in doc["ceilings"]:
        for frac, ls in ((1.0, ":"), (0.5, "--")):
            y = frac * c["redis_py_samples_per_s"]
            ax[0][0].axhline(y, ls=ls, color="grey", lw=0.8)
            ax[0][0].annotate(f"{frac:.0%} of the {c['payload_bytes'] / 1024:.0f} KiB ceiling", (1, y),
                              fontsize="x-small", color="grey", va="bottom")  # fmt: skip
    ax[0][0].set(title="end-to-end samples/s vs workers", xlabel="rollout workers", ylabel="samples/s",
                 xscale="log", yscale="log")  # fmt: skip
    ax[0][1].set(title="dispatch latency p99 vs workers", xlabel="rollout workers", ylabel="ms",
                 xscale="log", yscale="log")  # fmt: skip
    ax[0][1].axhline(10, ls=":", color="red", label="target p99 10 ms")
    ax[0][0].legend(fontsize="xx-small", ncol=2, loc="upper right")  # over the ceiling lines, not the data
    paced = [r for r in rows if r["offered_samples_per_s"] is not None]
    by_wp: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for r in paced:
        by_wp.setdefault((r["workers"], r["payload_bytes"], r.get("aggregators", 1)), []).append(r)
    wp = sorted({(r["workers"], r["payload_bytes"]) for r in paced})
    colour_wp = {k: plt.get_cmap("tab20")(i % 20) for i, k in enumerate(wp)}
    for (w, pb, na), rs in sorted(by_wp.items()):
        rs = sorted(rs, key=lambda r: r["offered_samples_per_s"])
        xs = [r["offered_samples_per_s"] for r in rs]
        label = f"{w} workers, {pb / 1024:.0f} KiB" + (f", {na} aggregators" if na > 1 else "")
        line: dict[str, Any] = {"marker": "o" if na == 1 else "s", "ls": "-" if na == 1 else "--",
                                "color": colour_wp[(w, pb)], "label": label}  # fmt: skip
        ax[1][0].plot(xs, [r["samples_per_s"] for r in rs], **line)
        ax[1][1].plot(xs, [r["dispatch_p99_s"] * 1e3 for r in rs], **line)
    if paced:
        lo, hi = (
            min(r["offered_samples_per_s"] for r in paced),
            max(r["offered_samples_per_s"] for r in paced),
        )
        ax[1][0].plot([lo, hi], [lo, hi], ls=":", color="grey", label="achieved = offered")
    ax[1][0].set(title="samples/s vs offered load", xlabel="offered samples/s", ylabel="samples/s",
                 xscale="log", yscale="log")  # fmt: skip
    ax[1][1].set(title="dispatch p99 vs offered load", xlabel="offered samples/s", ylabel="ms",
                 xscale="log", yscale="log")  # fmt: skip
    ax[1][1].axhline(10, ls=":", color="red", label="target p99 10 ms")
    if paced:
        ax[1][0].legend(fontsize="xx-small", ncol=2)
    # plain tick labels at the measured points (after the log scales, which reset the ticks)
    workers = sorted({r["workers"] for r in rows})
    loads = sorted({r["offered_samples_per_s"] for r in paced})
    for a, xs in ((ax[0][0], workers), (ax[0][1], workers), (ax[1][0], loads), (ax[1][1], loads)):
        if xs:
            a.minorticks_off()
            a.set_xticks(xs, [f"{x:,.0f}" for x in xs])
    fig.suptitle(f"broker path, {doc['machine']['cpus']} cores; median of {doc['repeats']} (bars: min-max)",
                 fontsize="small")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _err(rs: list[dict[str, Any]], k: str, scale: float = 1.0) -> list[list[float]] | None:
    if not all(k + "_min" in r for r in rs):
        return None
    return [[(r[k] - r[k + "_min"]) * scale for r in rs], [(r[k + "_max"] - r[k]) * scale for r in rs]]


# ------------------------------------------------------------------------------------ the suite


def run_broker(
    suite: str, out: Path, *, url: str = "", progress: bool = True, quick: bool = False
) -> tuple[str, str]:
    """Run the suite; returns the table and a line saying where the results are."""
    if cluster_node_url(url) is not None:  # its ceiling, INFO and redis-benchmark are one server's
        raise ConfigError(
            "bench --suite broker measures one Redis server; give it the redis:// URL of the master "
            "that serves the run's slot (docs/operations.md, Redis Cluster)"
        )
    spec = load_spec(suite, quick)
    rows = rows_of(spec)
    load_config(Path(spec["base"]), row_overrides(spec, rows[0], out), environ={})  # fail fast
    out.mkdir(parents=True, exist_ok=True)
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(rows) + len(spec["response_tokens"]), desc="bench broker", unit="run",
                   file=sys.stderr)  # fmt: skip
    t0 = time.monotonic()
    er = None if url else EmbeddedRedis().start()
    url = url or (er.url if er else "")
    runs: list[dict[str, Any]] = []
    ceilings: list[dict[str, Any]] = []
    try:
        for t in spec["response_tokens"]:
            if bar is not None:
                bar.set_postfix_str(f"ceiling {t} tokens")
            payload = sample_payload(int(t), int(spec["prompt_tokens"]))
            c: dict[str, Any] = {"response_tokens": int(t), "payload_bytes": len(payload)}
            c.update(bytes_breakdown(int(t), int(spec["prompt_tokens"]), int(spec["group_size"])))
            c["redis_py_samples_per_s"] = ceiling_redis_py(
                url, payload, spec["ceiling_s"], spec["ceiling_pipeline"]
            )
            c["redis_benchmark_samples_per_s"] = ceiling_redis_benchmark(
                url, len(payload), spec["ceiling_s"], spec["ceiling_pipeline"]
            )
            c.update(aggregator_capacity(url, int(t), int(spec["prompt_tokens"]), int(spec["group_size"]),
                                         int(spec["drain_groups"])))  # fmt: skip
            ceilings.append(c)
            if bar is not None:
                bar.update(1)
        for row in rows:
            if bar is not None:
                bar.set_postfix_str(row.name)
            runs.append(run_row(spec, row, url, out, er.proc.pid if er and er.proc else None))
            if bar is not None:
                bar.update(1)
    finally:
        if er is not None:
            er.stop()
        if bar is not None:
            bar.close()
    payload_of = {c["response_tokens"]: c["payload_bytes"] for c in ceilings}
    ceiling_of = {c["response_tokens"]: c["redis_py_samples_per_s"] for c in ceilings}
    doc: dict[str, Any] = {
        "suite": "broker-quick" if quick else "broker",
        "machine": {"cpus": os.cpu_count() or 1, "redis_server": shutil.which("redis-server") or ""},
        "repeats": int(spec["repeats"]),
        "settings": {k: spec[k] for k in SETTINGS},
        "ceiling_samples_per_s": {str(c["payload_bytes"]): c["redis_py_samples_per_s"] for c in ceilings},
        "ceilings": ceilings,
        "rows": summarise(runs, payload_of, ceiling_of),
        "runs": runs,
        "wall_s": time.monotonic() - t0,
    }
    png = plot(doc, out / "broker.png")
    doc["png"] = str(png) if png else None
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    text = table(doc)
    (out / "results.md").write_text(text + "\n")
    pics = f", {png}" if png else ""
    return text, f"results: {out / 'results.json'}, {out / 'results.md'}{pics} ({doc['wall_s']:.0f} s)"
