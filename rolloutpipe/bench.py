"""``rolloutpipe bench``: the same workload in ``sync``, ``cgp`` and ``cgp-fgd``, side by side.

Each mode is a separate run (own stream namespace) on one Redis, with real role processes, the
emulated engine and the emulated trainer.  Every figure comes from observed timestamps.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.config import MODES, Config, load_config
from rolloutpipe.runner import run_cluster

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "bench-quick.yaml"
KEYS = (
    "rollout_to_train_end_s",
    "trainer_wait_ratio",
    "first_group_s",
    "dispatch_latency_p50_s",
    "dispatch_latency_p99_s",
    "rollout_makespan_s",
    "last_minibatch_train_s",
    "last_group_train_s",
    "train_busy_s",
)


def _median_metrics(ms: list[StepMetrics], skip_first: bool) -> dict[str, float]:
    use = ms[1:] if skip_first and len(ms) > 1 else ms
    out = {k: statistics.median(getattr(m, k) for m in use) for k in KEYS}
    # No schedule that trains group by group can end before the last group exists and has been
    # trained on, plus the final optimizer step (see docs/architecture.md on the ideal bound).
    out["ideal_bound_s"] = statistics.median(m.rollout_makespan_s + m.last_group_train_s for m in use)
    out["ideal_bound_minibatch_s"] = statistics.median(
        m.rollout_makespan_s + m.last_minibatch_train_s for m in use
    )
    out["steps_measured"] = len(use)
    return out


def table(setting: dict[str, Any]) -> str:
    modes = setting["modes"]
    base = modes["sync"]
    ideal = setting["ideal_bound_s"]
    lines = [
        "| mode | rollout_to_train_end_s | vs sync | trainer_wait_ratio | vs sync | gap captured | "
        "first_group_s | dispatch p50 / p99 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        m = modes[mode]
        red_t = 1 - m["rollout_to_train_end_s"] / base["rollout_to_train_end_s"]
        red_w = (
            1 - m["trainer_wait_ratio"] / base["trainer_wait_ratio"] if base["trainer_wait_ratio"] else 0.0
        )
        gap = base["rollout_to_train_end_s"] - ideal
        cap = (base["rollout_to_train_end_s"] - m["rollout_to_train_end_s"]) / gap if gap > 0 else 0.0
        m["reduction_vs_sync"] = red_t
        m["wait_ratio_reduction_vs_sync"] = red_w
        m["gap_captured"] = cap
        lines.append(
            f"| {mode} | {m['rollout_to_train_end_s']:.2f} | {red_t:+.1%} | {m['trainer_wait_ratio']:.3f} | "
            f"{red_w:+.1%} | {cap:.0%} | {m['first_group_s']:.2f} | "
            f"{m['dispatch_latency_p50_s']:.3f} / {m['dispatch_latency_p99_s']:.3f} |"
        )
    lines.append(
        f"\nideal bound (rollout makespan + training after the last group arrives, sync run): {ideal:.2f} s"
    )
    return "\n".join(lines)


def run_setting(cfg: Config, url: str, out: Path, name: str, progress: bool) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in MODES:
        mcfg = cfg.model_copy(deep=True)
        mcfg.controller.mode = mode
        mcfg.run = f"{name}-{mode}"
        mcfg.out = str(out / name / mode)
        ms = run_cluster(mcfg, url, Path(mcfg.out), progress=progress, timeout_s=900)
        modes[mode] = _median_metrics(ms, skip_first=True)
    return {"name": name, "ideal_bound_s": modes["sync"]["ideal_bound_s"], "modes": modes}


def run_bench(
    config: str | None,
    out: Path,
    overrides: list[str],
    *,
    steps: int | None = None,
    url: str = "",
    progress: bool = True,
) -> int:
    extra = [f"controller.steps={steps}"] if steps is not None else []
    cfg = load_config(config or DEFAULT_CONFIG, [*overrides, *extra])
    out.mkdir(parents=True, exist_ok=True)
    er = None if url else EmbeddedRedis().start()
    try:
        setting = run_setting(cfg, url or (er.url if er else ""), out, "quick", progress)
    finally:
        if er is not None:
            er.stop()
    text = table(setting)
    (out / "results.json").write_text(json.dumps({"settings": [setting]}, indent=2))
    (out / "results.md").write_text(text + "\n")
    print(text)
    print(f"\nresults: {out / 'results.json'}", file=sys.stderr)
    return 0
