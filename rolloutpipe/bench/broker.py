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
* the ceiling (``bench/broker_ceiling.py``): one redis-py client pipelining XADDs of the same
  encoded sample bytes, and ``redis-benchmark`` (if on PATH) doing the same with a payload of the
  same size.

This module holds the suite (its spec, its rows, each row's run and the sampler that watches it);
``bench/broker_report.py`` turns the results into the table and the picture.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis
import yaml

from rolloutpipe.bench.broker_ceiling import (
    aggregator_capacity,
    bytes_breakdown,
    ceiling_redis_benchmark,
    ceiling_redis_py,
    sample_payload,
)
from rolloutpipe.bench.broker_report import plot, summarise, table
from rolloutpipe.bench.harness import CONFIGS, Suite, register, session, spec_path, where, write_results
from rolloutpipe.broker.connect import cluster_node_url
from rolloutpipe.broker.keys import Groups, Keys, run_keys
from rolloutpipe.config import load_config
from rolloutpipe.errors import ConfigError
from rolloutpipe.launch.cluster import run_cluster

SAMPLE_S = 0.2  # how often Redis INFO and the roles' CPU clocks are read
ROLES = ("controller", "rollout", "aggregator", "trainer")
SETTINGS = ("workers", "response_tokens", "prompt_tokens", "offered_samples_per_s", "slots",
            "repeats", "steps", "prompts_per_step", "group_size", "minibatches", "ceiling_s",
            "ceiling_pipeline", "aggregators", "drain_groups")  # fmt: skip


def is_broker_suite(name: str) -> bool:
    """A broker suite names ``response_tokens`` (an allocation suite ``policies``, the paper suite
    ``workloads``)."""
    path = spec_path(name)
    return path.exists() and "response_tokens" in (yaml.safe_load(path.read_text()) or {})


def load_spec(name: str, quick: bool = False) -> dict[str, Any]:
    path = spec_path(name)
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
    runs: list[dict[str, Any]] = []
    ceilings: list[dict[str, Any]] = []
    total = len(rows) + len(spec["response_tokens"])
    with session(url, progress=progress, total=total, desc="bench broker") as s:
        for t in spec["response_tokens"]:
            s.label(f"ceiling {t} tokens")
            payload = sample_payload(int(t), int(spec["prompt_tokens"]))
            c: dict[str, Any] = {"response_tokens": int(t), "payload_bytes": len(payload)}
            c.update(bytes_breakdown(int(t), int(spec["prompt_tokens"]), int(spec["group_size"])))
            c["redis_py_samples_per_s"] = ceiling_redis_py(
                s.url, payload, spec["ceiling_s"], spec["ceiling_pipeline"]
            )
            c["redis_benchmark_samples_per_s"] = ceiling_redis_benchmark(
                s.url, len(payload), spec["ceiling_s"], spec["ceiling_pipeline"]
            )
            c.update(aggregator_capacity(s.url, int(t), int(spec["prompt_tokens"]), int(spec["group_size"]),
                                         int(spec["drain_groups"])))  # fmt: skip
            ceilings.append(c)
            s.advance()
        for row in rows:
            s.label(row.name)
            runs.append(run_row(spec, row, s.url, out, s.redis_pid))
            s.advance()
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
        "wall_s": s.wall_s,
    }
    png = plot(doc, out / "broker.png")
    doc["png"] = str(png) if png else None
    text = table(doc)
    write_results(out, doc, text)
    return text, where(out, doc["wall_s"], *([png] if png else []))


register(
    Suite(
        name="broker",
        run=lambda a: run_broker(a.suite, a.out, url=a.url, progress=a.progress, quick=a.quick),
        config=CONFIGS / "bench" / "broker.yaml",
        refuses=frozenset({"config", "overrides", "steps", "scale"}),
        refusal="--suite broker takes its settings from configs/bench/broker.yaml "
        "(or a copy given as --suite FILE), not overrides, --steps or --scale",
        selects=lambda name: bool(name) and is_broker_suite(name),
        order=10,  # before the others: a broker suite file names ``response_tokens``
    )
)
