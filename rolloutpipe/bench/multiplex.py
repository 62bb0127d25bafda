"""``rolloutpipe bench --suite multiplex``: N runs on one shared rollout pool against the same pool
split statically, on the calibrated emulated engine and trainer.

Every configuration is real processes (``multiplex.run_pool``): each run its controller,
aggregator and trainer; the pool its scheduler and workers.  The static split goes through the
same pool code with ``rollout.pool.policy: static`` (worker i serves run i mod N for the whole
run), so the two differ only in the leases.  Each (N, mode) runs ``repeats`` times, the modes
interleaved within a repeat, so drift of this machine falls on every mode alike.

Reported per configuration (mean and 95% t-interval over repeats):

* ``samples_per_s``: samples trained by all runs / (last step's end - first step's start);
* ``pool_utilisation``: the pool's engine busy time (a sequence running) / (workers x that window);
* each run's ``rollout_to_train_end_s``: its steps after the warm-up, pooled over repeats;
* the ratio to ``static`` of each, paired by repeat (run back to back).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rolloutpipe.bench.harness import (
    CONFIGS,
    Suite,
    flatten,
    register,
    session,
    spec_path,
    where,
    write_results,
)
from rolloutpipe.bench.paper import interval
from rolloutpipe.config import load_config
from rolloutpipe.errors import ConfigError
from rolloutpipe.launch.pool import PoolRun, run_pool

# Each mode: the pool's policy and what happens to requests in flight when a worker moves
# (handback: continuations), and whether a run's own workers level their long tail (migration).
MODES: dict[str, list[str]] = {
    "static": ["rollout.pool.policy=static", "rollout.migration.enabled=false"],
    "static-migration": ["rollout.pool.policy=static", "rollout.migration.enabled=true"],
    "greedy": ["rollout.pool.policy=greedy", "rollout.pool.handback=true", "rollout.migration.enabled=true"],
    "lookahead": [
        "rollout.pool.policy=lookahead", "rollout.pool.handback=true", "rollout.migration.enabled=true",
    ],
    "lookahead-no-migration": [
        "rollout.pool.policy=lookahead", "rollout.pool.handback=false", "rollout.migration.enabled=false",
    ],
}  # fmt: skip
SHARED = "lookahead"  # the headline's shared pool


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"benchmark suite not found: {path}")
    spec: dict[str, Any] = yaml.safe_load(path.read_text())
    unknown = [m for m in spec.get("modes", []) if m not in MODES]
    if unknown or "static" not in spec.get("modes", []):
        raise ConfigError(f"multiplex modes must include static and be among {sorted(MODES)}: {unknown}")
    return spec


def summarise(res: PoolRun, workers: int) -> dict[str, Any]:
    starts = [m.step_start for ms in res.metrics.values() for m in ms]
    window = max(res.ended - min(starts), 1e-9)
    samples = sum(m.samples for ms in res.metrics.values() for m in ms)
    return {
        "samples_per_s": samples / window,
        "window_s": window,
        "samples": samples,
        "pool_utilisation": sum(res.busy_s.values()) / (workers * window),
        "switch_s": sum(res.switch_s.values()),
        "lease_changes": sum(1 for x in res.leases if x.from_run),
        "migrations": sum(s.get("migrations", 0) for s in res.stats.values()),
        "runs": {
            run: {
                "r2t": [m.rollout_to_train_end_s for m in ms[1:]],
                "wait": [m.trainer_wait_ratio for m in ms[1:]],
            }
            for run, ms in res.metrics.items()
        },
        "fence_rejections": sum(m.fence_rejections for ms in res.metrics.values() for m in ms),
        "dead_letters": sum(m.dead_letters for ms in res.metrics.values() for m in ms),
    }


def _iv(xs: list[float]) -> dict[str, float]:
    mean, lo, hi = interval(xs)
    return {"mean": mean, "lo": lo, "hi": hi, "n": len(xs)}


def aggregate(reps: dict[str, list[dict[str, Any]]], runs: list[str]) -> dict[str, Any]:
    """Per mode: means and intervals over repeats, each run's r2t pooled, ratios paired with static."""
    out: dict[str, Any] = {}
    static = reps["static"]
    for mode, rs in reps.items():
        d: dict[str, Any] = {
            k: _iv([r[k] for r in rs]) for k in ("samples_per_s", "pool_utilisation", "switch_s")
        }
        d["lease_changes"] = _iv([float(r["lease_changes"]) for r in rs])
        d["migrations"] = _iv([float(r["migrations"]) for r in rs])
        d["throughput_vs_static"] = _iv(
            [r["samples_per_s"] / s["samples_per_s"] for r, s in zip(rs, static, strict=False)]
        )
        d["runs"] = {}
        for run in runs:
            mine = [x for r in rs for x in r["runs"][run]["r2t"]]
            alone = [x for s in static for x in s["runs"][run]["r2t"]]
            d["runs"][run] = {
                "r2t": _iv(mine),
                "r2t_vs_static": statistics.fmean(mine) / statistics.fmean(alone)
                if mine and alone
                else math.nan,
            }
        d["fence_rejections"] = sum(r["fence_rejections"] for r in rs)
        d["dead_letters"] = sum(r["dead_letters"] for r in rs)
        out[mode] = d
    return out


def table(what: str, workers: int, agg: dict[str, Any]) -> str:
    lines = [
        f"{what} on {workers} pool workers (mean [95% interval] over repeats)",
        "| mode | samples/s | vs static | pool utilisation | worst run r2t vs static | lease changes |"
        " migrations |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, d in agg.items():
        s, v, u = d["samples_per_s"], d["throughput_vs_static"], d["pool_utilisation"]
        worst = max(x["r2t_vs_static"] for x in d["runs"].values())
        lines.append(
            f"| {mode} | {s['mean']:.0f} [{s['lo']:.0f}, {s['hi']:.0f}] | {v['mean']:.2f}x [{v['lo']:.2f}, "
            f"{v['hi']:.2f}] | {u['mean']:.0%} [{u['lo']:.0%}, {u['hi']:.0%}] | {worst:.2f}x | "
            f"{d['lease_changes']['mean']:.0f} | {d['migrations']['mean']:.0f} |"
        )
    return "\n".join(lines)


def targets(by_n: dict[str, dict[str, Any]]) -> str:
    out = ["Targets (issue 14), for the shared pool (lookahead) against the static split:"]
    for n, agg in by_n.items():
        if SHARED not in agg:
            continue
        v = agg[SHARED]["throughput_vs_static"]
        ok = "met" if v["mean"] >= 1.5 else f"MISSED by {1.5 - v['mean']:.2f}x"
        out.append(
            f"- {n}: throughput {v['mean']:.2f}x [{v['lo']:.2f}, {v['hi']:.2f}] (target >= 1.5x): {ok}"
        )
        _, worst = max(agg[SHARED]["runs"].items(), key=lambda kv: kv[1]["r2t_vs_static"])
        r = worst["r2t_vs_static"]
        ok = "met" if r <= 1.10 else f"MISSED by {r - 1.10:.2f}"
        out.append(
            f"- {n}: worst run's rollout-to-train-end {r:.2f}x its static share's (target <= 1.10): {ok}"
        )
    return "\n".join(out)


def run_multiplex(
    out: Path,
    overrides: list[str],
    *,
    url: str = "",
    progress: bool = True,
    quick: bool = False,
    run_overrides: Sequence[Sequence[str]] = (),
) -> tuple[str, str]:
    """Run the suite (``configs/bench/multiplex.yaml``); returns the table and where the results are.

    ``run_overrides``: overrides for the i-th run of each setting only (after ``overrides``), e.g. runs of
    unequal length, so that one is done while another still needs the pool.
    """
    path = spec_path("multiplex")
    spec = load(path)
    base = path.parent / spec["hardware"]
    common = [*flatten(yaml.safe_load((path.parent / spec["workload"]).read_text()) or {}),
              *flatten(spec.get("run", {})), "trainer.record_timeline=true", *overrides]  # fmt: skip
    counts: list[int] = [2] if quick else list(spec["run_counts"])
    run_modes: list[str] = list(spec["run_modes"])[:1] if quick else list(spec["run_modes"])
    repeats = 1 if quick else int(spec["repeats"])
    modes: list[str] = ["static", SHARED] if quick else list(spec["modes"])
    per_run = int(spec["workers_per_run"])
    load_config(base, common, environ={})  # fail fast on a bad config
    out.mkdir(parents=True, exist_ok=True)
    total = len(run_modes) * len(counts) * repeats * len(modes)
    results: dict[str, Any] = {"suite": "multiplex", "config": spec, "by_runs": {}}
    by_n: dict[str, dict[str, Any]] = {}
    tables = []
    with session(url, progress=progress, total=total, desc="multiplex") as sess:
        redis_url = sess.url
        for rm, n in [(rm, n) for rm in run_modes for n in counts]:
            key = f"{rm}-{n}runs"
            workers = per_run * n
            names = [f"mx{n}-{chr(97 + i)}" for i in range(n)]
            reps: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for rep in range(repeats):
                for mode in modes:
                    tag = f"{key}-{mode}-{rep}"
                    pool = f"mx-{key}-{mode}-{rep}"
                    runs = [f"{x}-{rm}-{mode}-{rep}" for x in names]
                    pool_over = [f"rollout.pool.name={pool}", "rollout.pool.runs=" + json.dumps(runs)]
                    cfgs = [
                        load_config(base, [*common, f"controller.mode={rm}", *MODES[mode], *pool_over,
                                           f"run={run}", f"out={out / tag / run}",
                                           *(run_overrides[i] if i < len(run_overrides) else ())], environ={})
                        for i, run in enumerate(runs)
                    ]  # fmt: skip
                    sess.label(tag)
                    res = run_pool(cfgs, redis_url, out / tag, pool, workers)
                    s = summarise(res, workers)
                    s["runs"] = {name: s["runs"][run] for name, run in zip(names, runs, strict=True)}
                    s["leases"] = [x.model_dump(mode="json") for x in res.leases]
                    reps[mode].append(s)
                    sess.advance()
            agg = aggregate(reps, names)
            by_n[key] = agg
            results["by_runs"][key] = {"run_mode": rm, "runs": n, "workers": workers, "modes": agg,
                                       "repeats": reps}  # fmt: skip
            tables.append(table(f"{n} runs ({rm})", workers, agg))
            try:
                from rolloutpipe.tools.timeline import plot_multiplex

                last = repeats - 1
                dirs = {m: out / f"{key}-{m}-{last}" for m in ("static", SHARED) if m in modes}
                png = plot_multiplex(dirs, names, out / f"timeline-multiplex-{key}.png", f"{n} runs, {rm}")
                results["by_runs"][key]["timeline_png"] = str(png)
            except ImportError:
                pass
    first = f"{run_modes[0]}-{counts[0]}runs"
    head = by_n[first]
    shared_sps = head[SHARED]["samples_per_s"]["mean"] if SHARED in head else None
    results["shared"] = {"mode": SHARED, "setting": first, "samples_per_s": shared_sps}
    results["static"] = {"setting": first, "samples_per_s": head["static"]["samples_per_s"]["mean"]}
    results["runs"] = {
        run: {"shared_r2t": head[SHARED]["runs"][run]["r2t"]["mean"] if SHARED in head else None,
              "static_r2t": head["static"]["runs"][run]["r2t"]["mean"]}
        for run in head["static"]["runs"]
    }  # fmt: skip
    results["wall_s"] = sess.wall_s
    text = "\n\n".join([*tables, targets(by_n)])
    write_results(out, results, text, default=str)
    return text, where(out, results["wall_s"])


register(
    Suite(
        name="multiplex",
        run=lambda a: run_multiplex(a.out, a.overrides, url=a.url, progress=a.progress, quick=a.quick),
        config=CONFIGS / "bench" / "multiplex.yaml",
        refuses=frozenset({"config", "scale", "steps"}),
        refusal="--suite multiplex takes its settings from configs/bench/multiplex.yaml and overrides",
        order=20,
    )
)
