"""``rolloutpipe report DIR``: a run's pictures and a one-page HTML from what the trainer wrote.

Inputs (both written by the trainer into the run directory):

* ``metrics.jsonl``: one StepMetrics line per step (required);
* ``timeline.jsonl``: per step, every sample's worker, admission and completion time, every
  group's completion and read time, and the trainer's busy intervals (``trainer.record_timeline``;
  optional: without it the page says how to get the timeline).

Outputs, next to them: ``report-steps.png`` (per step, one unit per panel: reward, trainer wait
ratio, rollout-to-train-end, response length, the trainer's loss stats), ``report-timeline.png``
(the last few steps on one wall-clock axis: sequences in flight per rollout worker, group
completions, trainer busy and idle) and ``report.html``, which embeds both pictures (data URIs:
one self-contained file) and the per-step table.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from rolloutpipe.errors import RolloutPipeError
from rolloutpipe.tools.timeline import mark_preemptions, preemptions

TIMELINE_STEPS = 4  # steps drawn on the timeline (the last ones)
TABLE_FIELDS = (
    "step",
    "reward_mean",
    "rollout_to_train_end_s",
    "trainer_wait_ratio",
    "first_group_s",
    "train_busy_s",
    "groups",
    "samples",
    "fence_rejections",
    "dead_letters",
)


class ReportError(RolloutPipeError):
    """The run directory holds nothing to report on (or a file that cannot be read)."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{n}: not a JSON line ({e.msg})") from e
    return rows


def load_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mfile = run_dir / "metrics.jsonl"
    if not mfile.exists():
        raise ReportError(f"{run_dir} has no metrics.jsonl (is it the --out of a `rolloutpipe run`?)")
    metrics = read_jsonl(mfile)
    if not metrics:
        raise ReportError(f"{mfile} is empty: the run finished no step")
    tfile = run_dir / "timeline.jsonl"
    timeline = read_jsonl(tfile) if tfile.exists() else []
    return metrics, timeline


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


Panel = tuple[str, dict[str, list[tuple[int, float]]]]  # a title, and its lines: label -> (step, value)

# the trainer's optimizer-step stats (StepMetrics.train), one panel each
TRAIN_PANELS = (
    ("loss", ("loss",)),
    ("grad norm (before clipping)", ("grad_norm",)),
    ("clip fraction", ("clipfrac", "clipfrac_lower")),
    ("entropy", ("entropy",)),
    ("KL to the reference", ("kl",)),
)


def step_panels(metrics: list[dict[str, Any]]) -> list[Panel]:
    """What the per-step picture shows, one unit per panel: reward (train and held-out), the tool use
    (with task.tools: calls per trained sample, and the share of held-out episodes that call), the
    trainer's wait ratio, rollout-to-train-end in seconds, the mean response length, then the loss stats the
    trainer recorded (a panel whose stats no step has is left out)."""

    def series(get: Any) -> list[tuple[int, float]]:
        return [(m["step"], float(v)) for m in metrics if (v := get(m)) is not None]

    panels: list[Panel] = [
        ("mean reward", {"train": series(lambda m: m["reward_mean"]),
                         "held-out": series(lambda m: m.get("eval_reward"))}),
        ("trainer wait ratio", {"wait ratio": series(lambda m: m["trainer_wait_ratio"])}),
        ("rollout-to-train-end (s)", {"seconds": series(lambda m: m["rollout_to_train_end_s"])}),
        ("mean response length (tokens)",
         {"tokens": series(lambda m: m.get("tokens", 0) / m["samples"] if m.get("samples") else None)}),
    ]  # fmt: skip
    if any(m.get("tool_calls") for m in metrics):  # task.tools: the episodes' tool use
        per_sample = series(lambda m: m["tool_calls"] / m["samples"] if m.get("samples") else None)
        calling = series(lambda m: m.get("eval_tool_rate"))
        lines = {"calls / trained sample": per_sample, "held-out episodes calling": calling}
        panels.insert(1, ("tool use", lines))
    for title, names in TRAIN_PANELS:
        lines = {n: series(lambda m, n=n: (m.get("train") or {}).get(n)) for n in names}
        if any(lines.values()):
            panels.append((title, {n: pts for n, pts in lines.items() if pts}))
    return panels


def plot_steps(metrics: list[dict[str, Any]], out: Path, name: str = "report-steps.png") -> Path:
    plt = _plt()
    panels = step_panels(metrics)
    cols = 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.0 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels, strict=False):
        for label, pts in lines.items():
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="." if len(lines) == 1 else "o",
                        markersize=3, label=label)  # fmt: skip
        ax.set(title=title, xlabel="step")
        if title in ("mean reward", "trainer wait ratio", "tool use"):
            ax.set_ylim(0, 1.05)
        if sum(1 for pts in lines.values() if pts) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    mode = metrics[-1].get("mode", "")
    fig.suptitle(f"{len(metrics)} steps, mode {mode}", fontsize=10)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _in_flight(intervals: list[tuple[float, float]]) -> tuple[list[float], list[int]]:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    xs, ys, cur = [], [], 0
    for x, d in events:
        cur += d
        xs.append(x)
        ys.append(cur)
    return xs, ys


def plot_timeline(timeline: list[dict[str, Any]], out: Path, steps: int = TIMELINE_STEPS) -> Path:
    """The last ``steps`` steps on one wall-clock axis: workers, groups, trainer."""
    plt = _plt()
    recs = timeline[-steps:]
    t0 = min(r["step_start"] for r in recs)
    t_end = max(r["train_end"] for r in recs) - t0
    workers = sorted({s[0] for r in recs for g in r["groups"] for s in g["samples"]})
    n = len(workers)
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.45 * (n + 2)))
    for i, w in enumerate(workers):
        iv = [(a - t0, b - t0) for r in recs for g in r["groups"] for sw, a, b, *_ in g["samples"] if sw == w]
        xs, ys = _in_flight(iv)
        peak = max(ys, default=1) or 1
        ax.fill_between(xs, [i] * len(xs), [i + 0.8 * y / peak for y in ys], step="post", alpha=0.6,
                        color="tab:blue", linewidth=0)  # fmt: skip
        ax.text(t_end * 1.005, i + 0.3, f"peak {peak}", fontsize=7, va="center")
        mark_preemptions(ax, preemptions(recs, w, t0), i + 0.9)
    gy, ty = n + 0.4, n + 1.2
    for r in recs:
        colour = cmap(r["step"] % 10)
        for g in r["groups"]:
            ax.vlines(g["completed_at"] - t0, gy - 0.3, gy + 0.3, color=colour, linewidth=1.0)
        ax.broken_barh([(r["step_start"] - t0, r["train_end"] - r["step_start"])], (ty - 0.3, 0.6),
                       facecolors="#eeeeee")  # fmt: skip
        ax.broken_barh([(a - t0, b - a) for a, b in r["busy"]], (ty - 0.3, 0.6), facecolors=colour)
        ax.axvline(r["train_end"] - t0, color="black", linestyle="--", linewidth=0.8)
        ax.text(r["step_start"] - t0, ty + 0.45, f"step {r['step']}", fontsize=7, color=colour)
    ax.set_yticks([*range(n), gy, ty], [*(f"worker {i}" for i in range(n)), "groups done", "trainer"])
    ax.set_ylim(-0.3, ty + 0.8)
    ax.set_xlim(0, t_end * 1.06)
    ax.set_xlabel(
        "wall seconds (workers: sequences in flight; groups: completions, coloured by step; trainer: "
        "busy in the step's colour, idle grey; dashed: a step's training ends; red x: a KV-cache preemption)",
        fontsize=8,
    )
    mode = recs[-1].get("mode", "")
    ax.set_title(f"timeline of steps {recs[0]['step']}-{recs[-1]['step']} ({mode})", fontsize=10, loc="left")
    fig.tight_layout()
    path = out / "report-timeline.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _cell(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def render_html(
    run_dir: Path, metrics: list[dict[str, Any]], steps_png: Path, timeline_png: Path | None
) -> str:
    rewards = [m["reward_mean"] for m in metrics]
    last10 = rewards[-10:]
    fence = sum(m.get("fence_rejections", 0) for m in metrics)
    dead = sum(m.get("dead_letters", 0) for m in metrics)
    summary = [
        ("steps", len(metrics)),
        ("mode", metrics[-1].get("mode", "")),
        ("reward: first step → mean of the last 10", f"{rewards[0]:.3f} → {sum(last10) / len(last10):.3f}"),
        ("median rollout-to-train-end (s)", _median([m["rollout_to_train_end_s"] for m in metrics])),
        ("median trainer wait ratio", _median([m["trainer_wait_ratio"] for m in metrics])),
        ("fence rejections / dead letters", f"{fence} / {dead}"),
    ]
    every = max(1, len(metrics) // 25)
    rows = [m for i, m in enumerate(metrics) if i % every == 0 or i == len(metrics) - 1]
    fields = [f for f in TABLE_FIELDS if f in metrics[0]]
    table = "".join(
        "<tr>" + "".join(f"<td>{_cell(m.get(f, ''))}</td>" for f in fields) + "</tr>" for m in rows
    )
    timeline = (
        _img(timeline_png, "timeline")
        if timeline_png
        else "<p>No timeline: run with <code>trainer.record_timeline=true</code> to record one.</p>"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>RolloutPipe report: {html.escape(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>RolloutPipe run <code>{html.escape(str(run_dir))}</code></h1>
<table>{"".join(f"<tr><th>{html.escape(k)}</th><td>{_cell(v)}</td></tr>" for k, v in summary)}</table>
<h2>Per step</h2>
{_img(steps_png, "reward, wait ratio and rollout-to-train-end per step")}
<h2>Timeline</h2>
{timeline}
<h2>Steps{f" (every {every}th)" if every > 1 else ""}</h2>
<table><tr>{"".join(f"<th>{f}</th>" for f in fields)}</tr>{table}</table>
</body></html>
"""


def write_html_report(run_dir: Path) -> dict[str, Path]:
    """Write the pictures and ``report.html`` into ``run_dir``; returns what was written."""
    metrics, timeline = load_run(run_dir)
    steps_png = plot_steps(metrics, run_dir)
    # a step that trained no group (dynamic sampling out of refills) has no span on the axis
    timeline = [r for r in timeline if math.isfinite(r["step_start"]) and math.isfinite(r["train_end"])]
    timeline_png = plot_timeline(timeline, run_dir) if timeline else None
    page = run_dir / "report.html"
    page.write_text(render_html(run_dir, metrics, steps_png, timeline_png))
    out = {"html": page, "steps_png": steps_png}
    if timeline_png:
        out["timeline_png"] = timeline_png
    return out
