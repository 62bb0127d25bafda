"""Timeline pictures from observed timestamps (``OUT/timeline.jsonl`` written by the trainer).

One panel per mode, on one time axis from the step's first admission: a row per rollout worker
(sequences in flight, stamped by the worker), a row of group completions (coloured by mini-batch),
and the trainer's own busy intervals, so the idle bubble that CGP and FGD remove is visible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rolloutpipe.config import MODES


def load_last_step(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines else None


def in_flight(steps: list[dict[str, Any]], worker: str, t0: float) -> tuple[list[float], list[int]]:
    """A step curve of the sequences ``worker`` ran (from each sample's admission to its end) over
    the timeline records ``steps``, in seconds since ``t0``."""
    events = sorted(
        (x - t0, d)
        for rec in steps
        for g in rec["groups"]
        for sw, adm, fin, *_ in g["samples"]
        if sw == worker
        for x, d in ((adm, 1), (fin, -1))
    )
    xs, ys, cur = [0.0], [0], 0
    for x, d in events:
        cur += d
        xs.append(x)
        ys.append(cur)
    return xs, ys


def preemptions(steps: list[dict[str, Any]], worker: str, t0: float) -> list[float]:
    """When ``worker``'s engine preempted a sequence for KV-cache memory (each sample row's sixth
    field, absent from rows written before it existed), in seconds since ``t0``."""
    return sorted(
        x - t0 for rec in steps for g in rec["groups"] for s in g["samples"] if s[0] == worker
        for x in (s[5] if len(s) > 5 else ())
    )  # fmt: skip


def mark_preemptions(ax: Any, xs: list[float], y: float) -> None:
    if xs:
        ax.plot(xs, [y] * len(xs), linestyle="none", marker="x", markersize=3, color="tab:red",
                label="KV-cache preemption")  # fmt: skip


def plot_setting(setting_dir: Path, title: str, modes: tuple[str, ...] = MODES) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = {m: load_last_step(setting_dir / m / "timeline.jsonl") for m in modes}
    present = [m for m in modes if recs[m]]
    horizon = max((recs[m]["train_end"] - recs[m]["step_start"]) for m in present) if present else 1.0  # type: ignore[index]
    fig, axes = plt.subplots(
        len(present), 1, figsize=(11, 2.8 * len(present) + 0.6), sharex=True, squeeze=False
    )
    cmap = plt.get_cmap("tab10")
    for ax, mode in zip(axes[:, 0], present, strict=True):
        rec: dict[str, Any] = recs[mode]  # type: ignore[assignment]
        t0 = rec["step_start"]
        workers = sorted({s[0] for g in rec["groups"] for s in g["samples"]})
        rows = {w: i for i, w in enumerate(workers)}
        n = len(workers)
        for w in workers:
            xs, ys = in_flight([rec], w, t0)
            peak = max(ys) or 1
            y0 = rows[w]
            ax.fill_between(xs, [y0] * len(xs), [y0 + 0.8 * y / peak for y in ys], step="post", alpha=0.6,
                            color="tab:blue", linewidth=0)  # fmt: skip
            mark_preemptions(ax, preemptions([rec], w, t0), y0 + 0.9)
        # one line per group, from its first admission to its completion, in admission order and
        # coloured by the mini-batch it fed: shows the admission order, the window's staircase and
        # which groups the engines served first
        gy, gh = n + 0.1, 1.8
        spans = sorted((min(s[1] for s in g["samples"]) - t0, g["completed_at"] - t0, g["minibatch"])
                       for g in rec["groups"])  # fmt: skip
        for i, (a, b, mb) in enumerate(spans):
            y = gy + gh * (i + 0.5) / max(1, len(spans))
            ax.hlines(y, a, b, color=cmap(mb % 10), linewidth=0.8)
            ax.plot([b], [y], marker="|", color=cmap(mb % 10), markersize=3)
        gy += gh / 2
        ty = n + 2.3
        busy = [(a - t0, b - a) for a, b in rec["busy"]]
        ax.broken_barh([(0, rec["train_end"] - t0)], (ty - 0.3, 0.6), facecolors="#eeeeee")
        ax.broken_barh(busy, (ty - 0.3, 0.6), facecolors="tab:green")
        ax.axvline(rec["train_end"] - t0, color="black", linestyle="--", linewidth=1)
        ax.set_yticks([*range(n), gy, ty], [*(f"worker {i}" for i in range(n)), "groups", "trainer"])
        ax.set_ylim(-0.3, ty + 0.5)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(
            f"{mode}: step {rec['step']}, ends {rec['train_end'] - t0:.2f} s", fontsize=9, loc="left"
        )
    axes[-1, 0].set_xlabel(
        "wall seconds since the step's first admission\nworkers: sequences in flight; groups: one line each, "
        "admission to completion, in admission order, coloured by mini-batch; trainer: busy green, "
        "idle grey; red x: a sequence preempted for KV-cache memory",
        fontsize=8,
    )
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = setting_dir / f"timeline-{title}.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_multiplex(dirs: dict[str, Path], runs: list[str], path: Path, title: str) -> Path:
    """One panel per mode (static split, shared pool) on one time axis: a row per pool worker with
    the sequences it ran, one colour per run, and a row per run with its trainer's busy intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    panels = []
    for mode, d in dirs.items():
        recs: dict[str, list[dict[str, Any]]] = {}
        for sub in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("pool-")):
            f = sub / "timeline.jsonl"
            if f.exists():
                recs[sub.name] = [json.loads(line) for line in f.read_text().splitlines() if line]
        if recs:
            panels.append((mode, recs))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 3.2 * len(panels) + 0.8), sharex=True, squeeze=False
    )
    for ax, (mode, recs) in zip(axes[:, 0], panels, strict=True):
        t0 = min(r["step_start"] for rs in recs.values() for r in rs)  # each panel from its own start
        names = sorted(recs)
        workers = sorted(
            {s[0] for rs in recs.values() for r in rs for g in r["groups"] for s in g["samples"]}
        )
        for wi, w in enumerate(workers):
            for ri, run in enumerate(names):
                xs, ys = in_flight(recs[run], w, t0)
                if len(xs) == 1:
                    continue
                peak = max(ys) or 1
                top = [wi + 0.8 * y / peak for y in ys]
                ax.fill_between(
                    xs, [wi] * len(xs), top, step="post", alpha=0.55, color=cmap(ri % 10), linewidth=0
                )
                mark_preemptions(ax, preemptions(recs[run], w, t0), wi + 0.9)
        base = len(workers) + 0.3
        for ri, run in enumerate(names):
            for r in recs[run]:
                for a, b in r["busy"]:
                    ax.barh(base + ri, b - a, left=a - t0, height=0.6, color=cmap(ri % 10), linewidth=0)
        ax.set_yticks(
            [i + 0.4 for i in range(len(workers))] + [base + i for i in range(len(names))],
            [w.rsplit("-", 1)[-1] for w in workers] + [f"trainer {i + 1}" for i in range(len(names))],
        )
        ax.set_title(f"{mode}: sequences on each pool worker, one colour per run; each run's trainer below")
    handles = [
        matplotlib.patches.Patch(color=cmap(i % 10), label=f"run {i + 1} ({r})") for i, r in enumerate(runs)
    ]
    fig.legend(handles=handles, loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel(
        "wall seconds since the panel's first step started; red x: a sequence preempted for KV-cache memory"
    )
    fig.suptitle(f"Shared rollout pool vs static split: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
