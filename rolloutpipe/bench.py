"""``rolloutpipe bench``: the same workload in ``sync``, ``cgp`` and ``cgp-fgd``, side by side.

Each (setting, mode) is a separate run (own stream namespace) on one Redis, with real role
processes, the emulated engine and the emulated trainer.  Every figure comes from observed
timestamps: sample admission/completion stamped by the workers, group reads and busy intervals
stamped by the trainer.

* ``rolloutpipe bench`` runs one quick setting (``configs/bench-quick.yaml``);
* ``rolloutpipe bench --suite paper`` runs the 12 settings of ``configs/bench/paper.yaml``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.config import MODES, load_config
from rolloutpipe.errors import ConfigError
from rolloutpipe.runner import run_cluster

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIGS / "bench-quick.yaml"
KEYS = ("rollout_to_train_end_s", "trainer_wait_ratio", "first_group_s", "dispatch_latency_p50_s",
        "dispatch_latency_p99_s", "admission_latency_p50_s", "rollout_makespan_s", "last_minibatch_train_s",
        "last_group_train_s", "train_busy_s")  # fmt: skip


def flatten(d: dict[str, Any], prefix: str = "") -> list[str]:
    """``{"a": {"b": 1}}`` -> ``["a.b=1"]`` (config overrides)."""
    out: list[str] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += flatten(v, key + ".")
        else:
            out.append(f"{key}={json.dumps(v) if not isinstance(v, str) else v}")
    return out


def median_metrics(ms: list[StepMetrics], skip_first: bool = True) -> dict[str, float]:
    use = ms[1:] if skip_first and len(ms) > 1 else ms
    out: dict[str, float] = {k: statistics.median(getattr(m, k) for m in use) for k in KEYS}
    # The design's ideal bound: rollout makespan + the last mini-batch's training time.
    out["ideal_bound_s"] = statistics.median(m.rollout_makespan_s + m.last_minibatch_train_s for m in use)
    # Stricter: a trainer that accumulates group by group can start the last mini-batch before the
    # rollout ends, so only the last group's training and the final step must follow the makespan
    # (see docs/architecture.md on the ideal bound).
    out["ideal_bound_group_s"] = statistics.median(m.rollout_makespan_s + m.last_group_train_s for m in use)
    out["overhead_frac"] = (out["admission_latency_p50_s"] + out["dispatch_latency_p50_s"]) / out[
        "rollout_to_train_end_s"
    ]
    out["steps_measured"] = len(use)
    return out


def derive(setting: dict[str, Any]) -> None:
    """Reductions against sync and the share of the sync->ideal gap captured, per mode."""
    modes = setting["modes"]
    base = modes["sync"]
    ideal = setting["ideal_bound_s"]
    gap = base["rollout_to_train_end_s"] - ideal
    setting["max_possible_reduction"] = gap / base["rollout_to_train_end_s"]
    strict_gap = base["rollout_to_train_end_s"] - setting["ideal_bound_group_s"]
    for m in modes.values():
        m["reduction_vs_sync"] = 1 - m["rollout_to_train_end_s"] / base["rollout_to_train_end_s"]
        bw = base["trainer_wait_ratio"]
        m["wait_ratio_reduction_vs_sync"] = 1 - m["trainer_wait_ratio"] / bw if bw > 0 else 0.0
        saved = base["rollout_to_train_end_s"] - m["rollout_to_train_end_s"]
        m["gap_captured"] = saved / gap if gap > 0 else 0.0
        m["gap_captured_strict"] = saved / strict_gap if strict_gap > 0 else 0.0


def mode_table(setting: dict[str, Any]) -> str:
    lines = [
        "| mode | rollout_to_train_end_s | vs sync | trainer_wait_ratio | vs sync | gap captured | "
        "first_group_s | dispatch p50 / p99 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        m = setting["modes"][mode]
        lines.append(
            f"| {mode} | {m['rollout_to_train_end_s']:.2f} | {0.0 - m['reduction_vs_sync']:+.1%} | "
            f"{m['trainer_wait_ratio']:.3f} | {0.0 - m['wait_ratio_reduction_vs_sync']:+.1%} | "
            f"{m['gap_captured']:.0%} | {m['first_group_s']:.2f} | "
            f"{m['dispatch_latency_p50_s']:.3f} / {m['dispatch_latency_p99_s']:.3f} |"
        )
    lines.append(
        f"\nideal bound (rollout makespan + last mini-batch's training): {setting['ideal_bound_s']:.2f} s; "
        f"strict (makespan + training after the last group): {setting['ideal_bound_group_s']:.2f} s; "
        f"broker+Python overhead "
        f"{max(m['overhead_frac'] for m in setting['modes'].values()):.2%} of a step"
    )
    return "\n".join(lines)


def suite_table(settings: list[dict[str, Any]]) -> str:
    """One row per setting; times in emulated seconds (wall seconds / time_scale)."""
    head = (
        "| setting | sync r2t (s) | cgp r2t | cgp-fgd r2t | ideal | max possible | sync wait | cgp wait | "
        "cgp-fgd wait | gap captured (fgd) | strict gap captured | first group sync / cgp / fgd (s) | "
        "dispatch p50 / p99 | overhead |"
    )
    lines = [head, "|" + "---|" * 14]
    for s in settings:
        m = s["modes"]
        sy, cg, fg = m["sync"], m["cgp"], m["cgp-fgd"]

        def t(x: float, scale: float = s["time_scale"]) -> str:
            return f"{x / scale:.0f}"

        lines.append(
            f"| {s['name']} | {t(sy['rollout_to_train_end_s'])} | {t(cg['rollout_to_train_end_s'])} "
            f"({0.0 - cg['reduction_vs_sync']:+.1%}) | {t(fg['rollout_to_train_end_s'])} "
            f"({0.0 - fg['reduction_vs_sync']:+.1%}) | {t(s['ideal_bound_s'])} "
            f"| {0.0 - s['max_possible_reduction']:+.1%} | {sy['trainer_wait_ratio']:.2f} "
            f"| {cg['trainer_wait_ratio']:.2f} ({0.0 - cg['wait_ratio_reduction_vs_sync']:+.0%}) "
            f"| {fg['trainer_wait_ratio']:.2f} ({0.0 - fg['wait_ratio_reduction_vs_sync']:+.0%}) "
            f"| {fg['gap_captured']:.0%} | {fg['gap_captured_strict']:.0%} "
            f"| {t(sy['first_group_s'])} / {t(cg['first_group_s'])} / "
            f"{t(fg['first_group_s'])} | {fg['dispatch_latency_p50_s'] * 1000:.0f} / "
            f"{fg['dispatch_latency_p99_s'] * 1000:.0f} ms | "
            f"{max(x['overhead_frac'] for x in m.values()):.2%} |"
        )
    return "\n".join(lines)


def run_setting(
    name: str, overrides: list[str], base: Path, url: str, out: Path, bar: Any = None
) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in MODES:
        cfg = load_config(
            base,
            [*overrides, f"controller.mode={mode}", f"run={name}-{mode}", f"out={out / name / mode}",
             "trainer.record_timeline=true"],
            environ={},
        )  # fmt: skip
        ms = run_cluster(cfg, url, Path(cfg.out), progress=False, timeout_s=900)
        modes[mode] = median_metrics(ms)
        if bar is not None:
            bar.update(1)
    setting: dict[str, Any] = {
        "name": name,
        "time_scale": cfg.rollout.emulated.time_scale,
        "ideal_bound_s": modes["sync"]["ideal_bound_s"],
        "ideal_bound_group_s": modes["sync"]["ideal_bound_group_s"],
        "modes": modes,
    }
    derive(setting)
    try:
        from rolloutpipe.timeline import plot_setting

        setting["timeline_png"] = str(plot_setting(out / name, name))
    except ImportError:  # matplotlib is a dependency; a missing picture must not lose the numbers
        pass
    return setting


def load_suite(name: str) -> tuple[Path, list[tuple[str, list[str]]]]:
    path = Path(name) if name.endswith(".yaml") else CONFIGS / "bench" / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"benchmark suite {name!r} not found (looked for {path})")
    spec = yaml.safe_load(path.read_text())
    base = path.parent / spec["hardware"]
    settings = []
    for wname, wfile in spec["workloads"].items():
        wover = flatten(yaml.safe_load((path.parent / wfile).read_text()) or {})
        for s in spec["settings"]:
            extra = {k: v for k, v in s.items() if k != "name"}
            settings.append((f"{wname}-{s['name']}", [*wover, *flatten(extra)]))
    return base, settings


def run_bench(
    config: str | None,
    out: Path,
    overrides: list[str],
    *,
    steps: int | None = None,
    url: str = "",
    progress: bool = True,
    suite: str = "",
    scale: float | None = None,
) -> tuple[str, str]:
    """Run the benchmark; returns the table and a line saying where the results are."""
    extra = list(overrides)
    if steps is not None:
        extra.append(f"controller.steps={steps}")
    if scale is not None:
        extra += [f"rollout.emulated.time_scale={scale}", f"trainer.emulated.time_scale={scale}"]
    if suite:
        base, settings = load_suite(suite)
        settings = [(n, [*o, *extra]) for n, o in settings]
    else:
        base = Path(config) if config else DEFAULT_CONFIG
        settings = [("quick", extra)]
    load_config(base, settings[0][1], environ={})  # fail fast on a bad config, before any process starts
    out.mkdir(parents=True, exist_ok=True)
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(settings) * len(MODES), desc="bench", unit="run", file=sys.stderr)
    t0 = time.monotonic()
    er = None if url else EmbeddedRedis().start()
    results = []
    try:
        for name, over in settings:
            if bar is not None:
                bar.set_postfix_str(name)
            results.append(run_setting(name, over, base, url or (er.url if er else ""), out, bar))
    finally:
        if er is not None:
            er.stop()
        if bar is not None:
            bar.close()
    doc = {"suite": suite or "quick", "wall_s": time.monotonic() - t0,
           "settings": results}  # fmt: skip
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    text = mode_table(results[0]) if len(results) == 1 else suite_table(results)
    (out / "results.md").write_text(text + "\n")
    return text, f"results: {out / 'results.json'}, {out / 'results.md'} ({doc['wall_s']:.0f} s)"
