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

from rolloutpipe.bench import pool_ceiling
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
from rolloutpipe.bench.pool_ceiling import steady
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
    "stagger": [
        "rollout.pool.policy=stagger", "rollout.pool.handback=true", "rollout.migration.enabled=true",
    ],
    # stagger whose moved worker finishes what it runs before it switches, as the simulated
    # ceiling's engines do (they switch only when empty): no hand-back prefill, the tail drained
    "stagger-drain": [
        "rollout.pool.policy=stagger", "rollout.pool.handback=false", "rollout.migration.enabled=true",
    ],
    "lookahead-no-migration": [
        "rollout.pool.policy=lookahead", "rollout.pool.handback=false", "rollout.migration.enabled=false",
    ],
}  # fmt: skip
SHARED = "lookahead"  # the headline's shared pool
CONTROL = "static-migration"  # the control of every claim (migration on, as in the shared modes)


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"benchmark suite not found: {path}")
    spec: dict[str, Any] = yaml.safe_load(path.read_text())
    unknown = [m for m in spec.get("modes", []) if m not in MODES]
    if unknown or not {"static", CONTROL} <= set(spec.get("modes", [])):
        raise ConfigError(
            f"multiplex modes must include static and {CONTROL} and be among {sorted(MODES)}: {unknown}"
        )
    return spec


def summarise(res: PoolRun, workers: int) -> dict[str, Any]:
    starts = [m.step_start for ms in res.metrics.values() for m in ms]
    window = max(res.ended - min(starts), 1e-9)
    samples = sum(m.samples for ms in res.metrics.values() for m in ms)
    runs = list(res.metrics.values())
    st = steady([[m.step_start for m in ms] for ms in runs], [[m.train_end for m in ms] for ms in runs],
                [ms[0].samples if ms else 0 for ms in runs])  # fmt: skip
    return {
        "steady_samples_per_s": st.samples_per_s,
        "steady_window_s": st.window_s,
        "steady_whole_span": st.whole,
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
                "period_s": p,
                "first_r2t": ms[0].rollout_to_train_end_s if ms else math.nan,
            }
            for (run, ms), p in zip(res.metrics.items(), st.period_s, strict=True)
        },
        "fence_rejections": sum(m.fence_rejections for ms in res.metrics.values() for m in ms),
        "dead_letters": sum(m.dead_letters for ms in res.metrics.values() for m in ms),
    }


def _iv(xs: list[float]) -> dict[str, float]:
    mean, lo, hi = interval(xs)
    return {"mean": mean, "lo": lo, "hi": hi, "n": len(xs)}


def _paired(rs: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> dict[str, float]:
    return _iv([r[key] / b[key] for r, b in zip(rs, base, strict=False)])


def _r2t_vs(rs: list[dict[str, Any]], base: list[dict[str, Any]], run: str) -> float:
    mine = [x for r in rs for x in r["runs"][run]["r2t"]]
    alone = [x for b in base for x in b["runs"][run]["r2t"]]
    return statistics.fmean(mine) / statistics.fmean(alone) if mine and alone else math.nan


def aggregate(
    reps: dict[str, list[dict[str, Any]]], runs: list[str], ceiling: float | None = None
) -> dict[str, Any]:
    """Per mode: means and intervals over repeats, each run's r2t pooled, ratios paired by repeat
    with ``static`` and (when it ran) with ``static-migration``, the control of every claim; with
    the setting's simulated ``ceiling`` (ideal / static), the share of its gain each mode captures."""
    out: dict[str, Any] = {}
    static = reps["static"]
    control = reps.get(CONTROL) or []
    for mode, rs in reps.items():
        d: dict[str, Any] = {
            k: _iv([r[k] for r in rs])
            for k in ("steady_samples_per_s", "samples_per_s", "pool_utilisation", "switch_s")
        }
        d["lease_changes"] = _iv([float(r["lease_changes"]) for r in rs])
        d["migrations"] = _iv([float(r["migrations"]) for r in rs])
        d["throughput_vs_static"] = _paired(rs, static, "samples_per_s")
        d["steady_ratio_vs_static"] = _paired(rs, static, "steady_samples_per_s")
        if control:
            v = d["steady_ratio_vs_static_migration"] = _paired(rs, control, "steady_samples_per_s")
            if ceiling is not None and ceiling > 1:
                d["share_of_ceiling_gain"] = (v["mean"] - 1) / (ceiling - 1)
        d["runs"] = {}
        for run in runs:
            d["runs"][run] = {
                "r2t": _iv([x for r in rs for x in r["runs"][run]["r2t"]]),
                "period_s": _iv([r["runs"][run]["period_s"] for r in rs]),
                "r2t_vs_static": _r2t_vs(rs, static, run),
                "r2t_vs_static_migration": _r2t_vs(rs, control, run) if control else math.nan,
                # the first step (not in r2t): the delay a policy adds to a run's start, staggering
                "first_r2t_vs_static_migration": statistics.fmean(r["runs"][run]["first_r2t"] for r in rs)
                / statistics.fmean(c["runs"][run]["first_r2t"] for c in control)
                if control
                else math.nan,
            }
        d["fence_rejections"] = sum(r["fence_rejections"] for r in rs)
        d["dead_letters"] = sum(r["dead_letters"] for r in rs)
        out[mode] = d
    return out


def _x(v: dict[str, float]) -> str:
    return f"{v['mean']:.2f}x [{v['lo']:.2f}, {v['hi']:.2f}]"


def table(what: str, workers: int, agg: dict[str, Any], ceil: dict[str, Any] | None = None) -> str:
    reps = next(iter(agg.values()))["steady_samples_per_s"]["n"]
    lines = [
        f"{what} on {workers} pool workers: steady state, samples/s over the window where every run is"
        f" past step 2 and none has ended (mean [95% interval] over {reps} repeats)",
        f"| mode | samples/s | vs static | vs {CONTROL} | share of the ceiling's gain | step period (s) |"
        f" worst run r2t vs {CONTROL} | pool utilisation | lease changes | migrations | fence rejections |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, d in agg.items():
        s, u = d["steady_samples_per_s"], d["pool_utilisation"]
        vc = d.get("steady_ratio_vs_static_migration")
        share = d.get("share_of_ceiling_gain")
        worst = max(x["r2t_vs_static_migration"] for x in d["runs"].values())
        period = statistics.fmean(x["period_s"]["mean"] for x in d["runs"].values())
        cells = [
            mode, f"{s['mean']:.0f} [{s['lo']:.0f}, {s['hi']:.0f}]", _x(d["steady_ratio_vs_static"]),
            _x(vc) if vc else "-", "-" if share is None else f"{share:.0%}", f"{period:.2f}", f"{worst:.2f}x",
            f"{u['mean']:.0%} [{u['lo']:.0%}, {u['hi']:.0%}]", f"{d['lease_changes']['mean']:.0f}",
            f"{d['migrations']['mean']:.0f}", str(d["fence_rejections"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if ceil:
        sch = {k: f"{v['samples_per_emulated_s']:.2f}" for k, v in ceil["schedules"].items()}
        per = ", ".join(f"{x:.3f} ({b})" for x, b in zip(ceil["per_seed"], ceil["best"], strict=True))
        lines.append(
            f"Simulated ceiling (rolloutpipe/bench/pool_ceiling.py, the same cost models, no broker): "
            f"{ceil['ceiling_ratio']:.3f}x static (per seed, with the schedule that won: {per}); samples per "
            f"emulated s: static {sch['static']}, ideal {sch['ideal']}, ideal-pack {sch['ideal-pack']}"
        )
        if CONTROL in agg and "time_scale" in ceil:
            meas = agg[CONTROL]["steady_samples_per_s"]["mean"] * ceil["time_scale"]
            model = ceil["schedules"]["static"]["samples_per_emulated_s"]
            lines.append(
                f"Measured {CONTROL}: {meas:.2f} samples per emulated s, {meas / model:.0%} of the model's"
                " static (the rest is the broker, Python and the control plane)"
            )
    return "\n".join(lines)


def target_ratio(ceiling: float) -> float:
    """Issue 30's target: 90% of the simulated ceiling's gain over the control."""
    return 1 + 0.9 * (ceiling - 1)


def targets(by_n: dict[str, dict[str, Any]], ceilings: dict[str, dict[str, Any]]) -> str:
    out = [f"Targets (issue 30), each shared mode against {CONTROL}, steady state:"]
    for n, agg in by_n.items():
        c = ceilings[n]["ceiling_ratio"]
        want = target_ratio(c)
        for mode in [m for m in agg if m not in ("static", CONTROL)]:
            v = agg[mode].get("steady_ratio_vs_static_migration")
            if v is None:
                continue
            ok = "met" if v["mean"] >= want else f"MISSED by {want - v['mean']:.3f}x"
            out.append(
                f"- {n} {mode}: throughput {_x(v)}; ceiling {c:.3f}x, target >= {want:.3f}x"
                f" (90% of its gain): {ok}"
            )
            runs = agg[mode]["runs"].values()
            r = max(x["r2t_vs_static_migration"] for x in runs)
            first = max(x["first_r2t_vs_static_migration"] for x in runs)
            ok = "met" if r <= 1.10 else f"MISSED by {r - 1.10:.2f}"
            out.append(
                f"- {n} {mode}: worst run's rollout-to-train-end {r:.2f}x on {CONTROL}"
                f" (target <= 1.10): {ok}; its first step {first:.2f}x"
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
    modes: list[str] = ["static", CONTROL, SHARED] if quick else list(spec["modes"])
    per_run = int(spec["workers_per_run"])
    load_config(base, common, environ={})  # fail fast on a bad config
    out.mkdir(parents=True, exist_ok=True)
    total = len(run_modes) * len(counts) * repeats * len(modes)
    results: dict[str, Any] = {"suite": "multiplex", "config": spec, "by_runs": {}}
    by_n: dict[str, dict[str, Any]] = {}
    ceilings: dict[str, dict[str, Any]] = {}
    tables = []
    with session(url, progress=progress, total=total, desc="multiplex") as sess:
        redis_url = sess.url
        for rm, n in [(rm, n) for rm in run_modes for n in counts]:
            key = f"{rm}-{n}runs"
            workers = per_run * n
            names = [f"mx{n}-{chr(97 + i)}" for i in range(n)]
            reps: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            ceil: dict[str, Any] = {}
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
                    if not ceil:  # the setting's simulated ceiling, on the first run's cost models
                        ceil = pool_ceiling.ceiling(n, per_run, pool_ceiling.Model.of(cfgs[0]), seeds=3)
                        ceil["time_scale"] = cfgs[0].rollout.emulated.time_scale
                    sess.label(tag)
                    res = run_pool(cfgs, redis_url, out / tag, pool, workers)
                    s = summarise(res, workers)
                    s["runs"] = {name: s["runs"][run] for name, run in zip(names, runs, strict=True)}
                    s["leases"] = [x.model_dump(mode="json") for x in res.leases]
                    reps[mode].append(s)
                    sess.advance()
            agg = aggregate(reps, names, ceil["ceiling_ratio"])
            by_n[key] = agg
            ceilings[key] = ceil
            results["by_runs"][key] = {"run_mode": rm, "runs": n, "workers": workers, "modes": agg,
                                       "ceiling_ratio": ceil["ceiling_ratio"], "ceiling": ceil,
                                       "target_ratio": target_ratio(ceil["ceiling_ratio"]),
                                       "repeats": reps}  # fmt: skip
            tables.append(table(f"{n} runs ({rm})", workers, agg, ceil))
            try:
                from rolloutpipe.tools.timeline import plot_multiplex

                last = repeats - 1
                dirs = {
                    m: out / f"{key}-{m}-{last}" for m in ("static", CONTROL, SHARED, "stagger") if m in modes
                }
                png = plot_multiplex(dirs, names, out / f"timeline-multiplex-{key}.png", f"{n} runs, {rm}")
                results["by_runs"][key]["timeline_png"] = str(png)
            except ImportError:
                pass
    first = f"{run_modes[0]}-{counts[0]}runs"
    head = by_n[first]
    shared_sps = head[SHARED]["samples_per_s"]["mean"] if SHARED in head else None
    steady_sps = head[SHARED]["steady_samples_per_s"]["mean"] if SHARED in head else None
    results["shared"] = {"mode": SHARED, "setting": first, "samples_per_s": shared_sps,
                         "steady_samples_per_s": steady_sps}  # fmt: skip
    results["static"] = {"setting": first, "samples_per_s": head["static"]["samples_per_s"]["mean"],
                         "steady_samples_per_s": head["static"]["steady_samples_per_s"]["mean"]}  # fmt: skip
    results["runs"] = {
        run: {"shared_r2t": head[SHARED]["runs"][run]["r2t"]["mean"] if SHARED in head else None,
              "static_r2t": head["static"]["runs"][run]["r2t"]["mean"]}
        for run in head["static"]["runs"]
    }  # fmt: skip
    results["wall_s"] = sess.wall_s
    text = "\n\n".join([*tables, targets(by_n, ceilings)])
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
