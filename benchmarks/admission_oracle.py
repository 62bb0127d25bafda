"""Offline model of the emulated engines + trainer: does the admission order matter?

Not the benchmark (that is `rolloutpipe bench --suite paper`, through Redis and real processes).
This replays the same engine model (continuous batching, step = a + c*batch, late binding) in
plain Python with an oracle that knows every response length, to bound what any admission
order (FIFO, longest-group-first, shortest-group-first) could gain.
Run: .venv/bin/python benchmarks/admission_oracle.py
"""

import math

import numpy as np


def lengths(B, G, median, sigma, cap, share, seed):
    r = np.random.default_rng(seed)
    zp = r.standard_normal(B)[:, None]
    zs = r.standard_normal((B, G))
    z = math.sqrt(share) * zp + math.sqrt(1 - share) * zs
    return np.minimum(np.maximum(1, np.round(np.exp(math.log(median) + sigma * z))), cap).astype(int)


def simulate(L, order, engines=2, slots=256, a=0.006, c=0.00008):
    """order: list of (group, sample) in admission priority; late binding (one global queue).
    Returns each group's completion time (prefill is ignored: it is <1% of a step here)."""
    B, G = L.shape
    queue = list(order)
    running = [[] for _ in range(engines)]  # [remaining tokens, g]
    t = 0.0
    left = np.full(B, G)
    done_at = np.zeros(B)
    ndone = 0
    while queue or any(running):
        for e in range(engines):
            while queue and len(running[e]) < slots:
                g, s = queue.pop(0)
                running[e].append([float(L[g, s]), g])
        # advance to next completion across engines (engines independent; approximate with common clock step)
        dts = []
        for e in range(engines):
            if running[e]:
                st = a + c * len(running[e])
                dts.append(min(x[0] for x in running[e]) * st)
        dt = min(dts)
        for e in range(engines):
            if not running[e]:
                continue
            st = a + c * len(running[e])
            adv = dt / st
            keep = []
            for x in running[e]:
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


def trainer_end(done_at, L, gpm, tps=34000, passes=1.67, prompt=256):
    order = np.argsort(done_at)
    work = (L.sum(1) + prompt * L.shape[1]) * passes / tps
    t = 0.0
    for g in order:
        t = max(t, done_at[g]) + work[g]
    return t, work.sum(), work


def run(B, G, M, median, sigma, cap, share, policy, seed=1):
    L = lengths(B, G, median, sigma, cap, share, seed)
    gpm = B // M
    if policy == "fifo":
        order = [(g, s) for g in range(B) for s in range(G)]
    elif policy == "lpt":  # oracle: longest group first
        gs = np.argsort(-L.max(1))
        order = [(g, s) for g in gs for s in range(G)]
    elif policy == "spt":
        gs = np.argsort(L.max(1))
        order = [(g, s) for g in gs for s in range(G)]
    done = simulate(L, order)
    R = done.max()
    E, T, work = trainer_end(done, L, gpm)
    sync = R + T
    last_mb = np.sort(work[np.argsort(done)][-gpm:]).sum()
    ideal = R + last_mb
    return dict(
        R=R,
        T=T,
        E=E,
        sync=sync,
        red=1 - E / sync,
        wait_sync=R / sync,
        wait=(E - T) / E,
        ideal_red=1 - ideal / sync,
        cap=(sync - E) / (sync - ideal),
    )


for name, (med, sig, capl) in {
    "competition": (2500, 0.8, 8192),
    "olympiad": (6000, 0.7, 8192),
    "scienceqa": (1800, 0.9, 8192),
}.items():
    for B, G, M in [(32, 8, 2), (32, 16, 4), (128, 8, 8)]:
        for pol in ["fifo", "lpt", "spt"]:
            r = run(B, G, M, med, sig, capl, 0.5, pol)
            waitred = 1 - r["wait"] / r["wait_sync"]
            print(
                f"{name:12s} b{B}n{G}m{M} {pol:5s} R={r['R']:.0f} T={r['T']:.0f} E={r['E']:.0f} "
                f"sync={r['sync']:.0f} r2t reduction={r['red']:.1%} wait reduction={waitred:.0%}"
            )
