"""Offline model of the emulated engines + trainer: does the admission order matter?

Not the benchmark (that is `rolloutpipe bench --suite paper`, through Redis and real processes).
This replays the same engine model (continuous batching, step = a + c*batch, late binding) in
plain Python with an oracle that knows every response length, to bound what any admission
order (FIFO, longest-group-first, shortest-group-first) could gain, and how a frontier window
(admit only the groups of the next W mini-batches, as `controller.fgd_lookahead` does) compares.
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
    """Admission in ``order`` (a list of (group, sample)) into free slots, one global queue (late
    binding).  Returns each group's completion time (prefill ignored: <1% of a step here)."""
    return simulate_window(L, None, None, engines, slots, a, c, order=order)


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


def simulate_window(L, gpm, W, engines=2, slots=256, a=0.006, c=0.00008, order=None):
    """Groups in ``order`` (default: index order); with a window ``W``, only groups of mini-batch
    < completed_groups // gpm + W are admitted."""
    B, G = L.shape
    group_order = list(dict.fromkeys(g for g, _ in order)) if order else list(range(B))
    nxt = 0  # index into group_order of the next group to admit
    pending = []  # samples of admitted groups not yet running
    running = [[] for _ in range(engines)]
    t = 0.0
    left = np.full(B, G)
    done_at = np.zeros(B)
    ndone = 0
    while nxt < B or pending or any(running):
        limit = B if W is None else (ndone // gpm + W) * gpm
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
    print("r2t reduction vs sync, by admission order (oracle orders need every length in advance)")
    for name, (med, sig, capl) in workloads.items():
        for B, G, M in [(32, 8, 2), (32, 16, 4), (128, 8, 8)]:
            row = []
            for pol in ["fifo", "lpt", "spt"]:
                red = np.mean([run(B, G, M, med, sig, capl, 0.5, pol, seed)["red"] for seed in range(3)])
                row.append(f"{pol}={red:.1%}")
            for W in [1, 2, 3]:
                rs = []
                for seed in range(3):
                    L = lengths(B, G, med, sig, capl, 0.5, seed)
                    done = simulate_window(L, B // M, W)
                    E, T, _ = trainer_end(done, L, B // M)
                    rs.append(1 - E / (done.max() + T))
                row.append(f"window{W}={np.mean(rs):.1%}")
            print(f"{name:12s} b{B}-n{G}-mb{M}  " + "  ".join(row))


if __name__ == "__main__":
    main()
