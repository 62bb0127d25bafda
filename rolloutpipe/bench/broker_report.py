"""The broker suite's report: rows summarised over repeats, which stage saturated, the table, the picture.

``bench/broker.py`` measures the rows (real runs, sampled); this module turns its ``results.json``
document into ``results.md`` and ``broker.png``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

WAITERS = ("redis", "aggregator", "trainer", "rollout")  # processes whose run-queue wait is summed

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
