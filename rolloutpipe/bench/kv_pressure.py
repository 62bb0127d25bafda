"""Does the KV cache bind?  A policy-free statistic per paper setting, before any policy is run.

Replays one synchronous step of each setting (every request released at once, admitted first come
first served into free slots across the engines, as vLLM with late binding) on the emulated
engine's model without a cache limit (``decode_base_s + decode_per_seq_s x running`` a step,
lengths from the workload's log-normal law: ``admission_oracle.lengths``), and records each
engine's KV demand: the prompt and decoded tokens of its running sequences.  Against a cache of
``kv_tokens`` it reports:

* ``peak``: the largest demand of any engine, as a multiple of the cache;
* ``over``: the share of the step's rollout during which some engine's demand exceeds the cache
  (a real engine preempts there; where it is 0 a KV-limited engine runs exactly as the unlimited
  one, and nothing that acts through preemption, such as FGD's priority or migration, can win);
* ``fit``: how many sequences of the step's mean running context the cache holds, against the
  engine's ``max_num_seqs``.

The default cache is hardware.yaml's derivation for Qwen3-1.7B on an 80 GB H100 (600k tokens).
Run: .venv/bin/python -m rolloutpipe.bench.kv_pressure [--kv-tokens N]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rolloutpipe.bench.admission_oracle import Lengths, lengths

KV_TOKENS = 600_000  # configs/bench/hardware.yaml: Qwen3-1.7B, 80 GB, gpu_memory_utilization 0.9


@dataclass(frozen=True)
class Pressure:
    peak: float  # the largest demand of one engine / the cache
    over: float  # share of the rollout with some engine's demand over the cache
    fit: float  # sequences of the mean running context that the cache holds
    makespan_s: float


def pressure(L: Lengths, kv_tokens: int, prompt: int, engines: int, slots: int, a: float,
             c: float) -> Pressure:  # fmt: skip
    """One step of ``L`` (groups x samples) on ``engines`` unlimited engines of ``slots``."""
    queue = [int(x) for x in L.reshape(-1)]  # FIFO in request order
    running: list[list[list[float]]] = [[] for _ in range(engines)]  # per engine: [left, context]
    t = over_t = peak = 0.0
    ctx_time = seq_time = 0.0  # integrals of the running context and the running count
    while queue or any(running):
        while queue:  # the next request to the engine with the fewest running (workers pull at once)
            r = min(running, key=len)
            if len(r) >= slots:
                break
            r.append([float(queue.pop(0)), float(prompt)])
        dt = min(min(x[0] for x in r) * (a + c * len(r)) for r in running if r)
        over = 0.0
        for r in running:
            if not r:
                continue
            adv = dt / (a + c * len(r))
            d0 = sum(x[1] for x in r)
            d1 = d0 + len(r) * adv
            peak = max(peak, d1)
            ctx_time += (d0 + d1) / 2 * dt
            seq_time += len(r) * dt
            if d1 > kv_tokens:  # demand rises linearly within the interval
                over = max(over, dt * (d1 - max(d0, kv_tokens)) / (d1 - d0))
            for x in r:
                x[0] -= adv
                x[1] += adv
            r[:] = [x for x in r if x[0] > 1e-9]
        over_t += over  # the engine longest over the cache in this interval
        t += dt
    mean_ctx = ctx_time / seq_time
    return Pressure(peak / kv_tokens, over_t / t, kv_tokens / mean_ctx, t)


def settings(suite: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, merged emulated-engine and controller settings) of each paper setting."""
    spec = yaml.safe_load(suite.read_text())
    hw = yaml.safe_load((suite.parent / spec["hardware"]).read_text())
    out = []
    for wname, wfile in spec["workloads"].items():
        wl = yaml.safe_load((suite.parent / wfile).read_text())
        eng = {**hw["rollout"]["emulated"], **wl["rollout"]["emulated"]}
        for s in spec["settings"]:
            out.append(
                (f"{wname}-{s['name']}", {**eng, **s["controller"], "workers": hw["rollout"]["workers"]})
            )
    return out


def table(suite: Path, kv_tokens: int, seeds: int = 3) -> list[dict[str, Any]]:
    rows = []
    for name, e in settings(suite):
        law = (e["length_median"], e["length_sigma"], e["max_response_tokens"], e["length_prompt_share"])
        engine = (
            e["prompt_tokens"],
            e["workers"],
            e["max_num_seqs"],
            e["decode_base_s"],
            e["decode_per_seq_s"],
        )
        ps = [
            pressure(lengths(e["prompts_per_step"], e["group_size"], *law, seed), kv_tokens, *engine)
            for seed in range(seeds)
        ]
        mean = {k: float(np.mean([getattr(p, k) for p in ps])) for k in ("peak", "over", "fit")}
        rows.append({"setting": name, "slots": e["max_num_seqs"], **mean})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-tokens", type=int, default=KV_TOKENS, help="the cache of one engine, in tokens")
    ap.add_argument("--suite", type=Path, default=Path("configs/bench/paper.yaml"))
    args = ap.parse_args()
    print(f"KV demand of one synchronous step, FIFO, unlimited engines; a cache of {args.kv_tokens:,} tokens")
    print(
        "| setting | peak demand / cache | rollout share over the cache | sequences the cache holds (slots) |"
    )
    print("|---|---|---|---|")
    for r in table(args.suite, args.kv_tokens):
        print(f"| {r['setting']} | {r['peak']:.2f} | {r['over']:.0%} | {r['fit']:.0f} ({r['slots']}) |")


if __name__ == "__main__":
    main()
