"""Offline model of the emulated engines + trainer: does the admission order matter?

Not the benchmark (that is `rolloutpipe bench --suite paper`, through Redis and real processes).
This replays the same engine model (continuous batching, step = a + c*batch, late binding) in
plain Python with an oracle that knows every response length, to see what an admission order
(FIFO, longest-group-first, shortest-group-first) or a frontier window (admit only the groups of
the next W mini-batches) could gain.

Every schedule is compared with ONE baseline per workload: slime's synchronous step, i.e. the
makespan with every request admitted at once (FIFO) followed by all the training.  (An earlier
version measured each windowed schedule against its own, longer makespan, which flattered the
window.)  The last column is the achievable cut from the true bound (``rolloutpipe/bench/bound.py``).
The trainer is the one in configs/bench/hardware.yaml: one pass a token at 34k tokens/s, 10 ms a
group, 30 ms an optimizer step.
Run: .venv/bin/python -m rolloutpipe.bench.admission_oracle
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

Lengths = npt.NDArray[Any]  # (groups, samples) response lengths, integers
Times = npt.NDArray[np.float64]  # one per group
Order = list[tuple[int, int]]  # (group, sample) in admission order


def lengths(B: int, G: int, median: float, sigma: float, cap: int, share: float, seed: int) -> Lengths:
    r = np.random.default_rng(seed)
    zp = r.standard_normal(B)[:, None]
    zs = r.standard_normal((B, G))
    z = math.sqrt(share) * zp + math.sqrt(1 - share) * zs
    return np.minimum(np.maximum(1, np.round(np.exp(math.log(median) + sigma * z))), cap).astype(int)


def simulate(L: Lengths, order: Order, engines: int = 2, slots: int = 256, a: float = 0.006,
             c: float = 0.00008) -> Times:  # fmt: skip
    """Admission in ``order`` (a list of (group, sample)) into free slots, one global queue (late
    binding).  Returns each group's completion time (prefill ignored: <1% of a step here)."""
    return simulate_window(L, None, None, engines, slots, a, c, order=order)


TRAINER = {"tps": 34000.0, "call": 0.01, "opt": 0.03, "prompt": 256}


def trainer_end(done_at: Times, L: Lengths, gpm: int) -> tuple[float, float, Times]:
    """Groups trained in completion order, an optimizer step after every gpm; returns the end, the
    total training and each group's training time."""
    order = np.argsort(done_at, kind="stable")
    work = TRAINER["call"] + (L.sum(1) + TRAINER["prompt"] * L.shape[1]) / TRAINER["tps"]
    t = 0.0
    for i, g in enumerate(order):
        t = max(t, done_at[g]) + work[g]
        if (i + 1) % gpm == 0 or i + 1 == len(order):
            t += TRAINER["opt"]
    total = work.sum() + math.ceil(len(order) / gpm) * TRAINER["opt"]
    return t, float(total), work


def bound(
    L: Lengths, gpm: int, engines: int = 2, slots: int = 256, a: float = 0.006, c: float = 0.00008
) -> float:
    from rolloutpipe.bench.bound import EngineModel, TrainerModel, r2t_bound

    eng = EngineModel(engines, slots, a, c, 0.0)
    tr = TrainerModel(TRAINER["tps"], 1.0, TRAINER["call"], TRAINER["opt"], gpm)
    return r2t_bound([[(int(TRAINER["prompt"]), int(x)) for x in row] for row in L], eng, tr).r2t


def orders(L: Lengths) -> dict[str, Order]:
    B, G = L.shape
    return {
        "fifo": [(g, s) for g in range(B) for s in range(G)],
        "lpt": [(int(g), s) for g in np.argsort(-L.max(1), kind="stable") for s in range(G)],
        "spt": [(int(g), s) for g in np.argsort(L.max(1), kind="stable") for s in range(G)],
    }


def simulate_window(L: Lengths, gpm: int | None, W: int | None, engines: int = 2, slots: int = 256,
                    a: float = 0.006, c: float = 0.00008, order: Order | None = None) -> Times:  # fmt: skip
    """Groups in ``order`` (default: index order); with a window ``W``, only groups of mini-batch
    < completed_groups // gpm + W are admitted."""
    B, G = L.shape
    group_order = list(dict.fromkeys(g for g, _ in order)) if order else list(range(B))
    nxt = 0  # index into group_order of the next group to admit
    pending: Order = []  # samples of admitted groups not yet running
    running: list[list[list[Any]]] = [[] for _ in range(engines)]  # per engine: [tokens left, group]
    t = 0.0
    left = np.full(B, G)
    done_at = np.zeros(B)
    ndone = 0
    while nxt < B or pending or any(running):
        limit = B if W is None or gpm is None else (ndone // gpm + W) * gpm
        while nxt < B and nxt < limit:
            pending += [(group_order[nxt], s) for s in range(G)]
            nxt += 1
        for e in range(engines):
            while pending and len(running[e]) < slots:
                g, s = pending.pop(0)
                running[e].append([float(L[g, s]), g])
        dt = min(min(x[0] for x in r) * (a + c * len(r)) for r in running if r)
        for e in range(engines):
            r = running[e]
            if not r:
                continue
            adv = dt / (a + c * len(r))
            keep = []
            for x in r:
                x[0] -= adv
                if x[0] <= 1e-9:
                    left[x[1]] -= 1
                    if left[x[1]] == 0:
                        done_at[x[1]] = t + dt
                        ndone += 1
                else:
                    keep.append(x)
            running[e] = keep
        t += dt
    return done_at


def main() -> None:
    workloads = {
        "gsm8k": (450, 0.6, 2048),
        "competition": (2500, 0.8, 8192),
        "olympiad": (6000, 0.7, 8192),
        "scienceqa": (1800, 0.9, 8192),
    }
    print("r2t reduction vs sync (FIFO, everything admitted, then all training), mean of 3 seeds;")
    print("lpt/spt are oracle orders (every length known); 'derived' is FGD's online window rule")
    for name, (med, sig, capl) in workloads.items():
        for B, G, M in [(32, 8, 2), (32, 16, 4), (128, 8, 8)]:
            gpm = B // M
            red: dict[str, list[float]] = {}
            for seed in range(3):
                L = lengths(B, G, med, sig, capl, 0.5, seed)
                runs = {k: simulate(L, o) for k, o in orders(L).items()}
                done = runs["fifo"]
                _, train, _ = trainer_end(done, L, gpm)
                sync = done.max() + train
                for W in (1, 2, 3):
                    runs[f"window{W}"] = simulate_window(L, gpm, W)
                first = np.sort(done)[0]
                if train > done.max() - first:  # the online rule, from the window-free (FIFO) step
                    runs["derived"] = simulate_window(L, gpm, 1 + math.ceil(done.max() / train))
                else:
                    runs["derived"] = done
                for k, d in runs.items():
                    red.setdefault(k, []).append(1 - trainer_end(d, L, gpm)[0] / sync)
                red.setdefault("bound", []).append(1 - bound(L, gpm) / sync)
            row = "  ".join(f"{k}={np.mean(v):.1%}" for k, v in red.items())
            print(f"{name:12s} b{B}-n{G}-mb{M}  {row}")


if __name__ == "__main__":
    main()
