"""The multiplex suite's reachable reference: N runs on the emulated engines and trainer, replayed
offline with a static split and with an ideal leasing schedule (issue 30).

Not the benchmark (that is ``rolloutpipe bench --suite multiplex``, real processes over Redis).
This replays the same cost models in plain Python, with no broker, no Python overhead and no
control-plane latency, so that a measured ratio can be read against what leasing *can* give on
this workload:

* **engines** as ``engines/emulated.py``: at most ``max_num_seqs`` sequences; a decode step of
  ``decode_base_s + decode_per_seq_s x running`` seconds; each admitted sequence stalls its engine
  for the prefill of its prompt; an engine holds one run's weights and pays ``switch_s`` to load
  another's;
* **trainer** as ``EmulatedBackend``: per group ``call_overhead_s`` + its tokens (prompt and
  response, every sample) x ``emulated_passes`` / ``tokens_per_s``, an optimizer step of
  ``optimizer_step_s`` after every mini-batch; groups trained in completion order (``pipelined``)
  or all after the last one (``barrier``: sync); the next step's requests exist once the step's
  last optimizer step ends (the fence: strictly on-policy);
* **lengths** drawn as the emulated engine draws them (log-normal, ``length_prompt_share`` of the
  log-variance per prompt, capped), from a seed of their own.

Three schedules, each late-bound (a request waits in its run's queue until a slot of an engine
that holds the run's weights is free, as every real mode does now):

* ``static``: run i holds engines [i x per_run, (i+1) x per_run) for the whole run.  Late binding
  over a run's own engines is what long-tail migration approximates, so this is the reference of
  ``static-migration``.
* ``ideal``: any engine may serve any run.  An engine keeps its run while that run has requests
  waiting; once it is empty, it goes back to its static run if that run has requests waiting,
  else, if its run has none, it switches to the run with requests waiting whose step began first
  (JigsawRL's order; ties by run), paying ``switch_s`` either way.  Nothing waits on a heartbeat
  or a tick, and no request is handed back.
* ``ideal-pack``: ``ideal``, and while another run has requests waiting, a run with none queued
  whose running sequences fit on one engine fewer packs them there (each a continuation that pays
  the prefill of its prompt and the tokens decoded so far), freeing an engine to switch: the
  long-tail migration of JigsawRL, at no control-plane cost.

Each is measured as the suite measures real runs (:func:`steady`): samples/s over the window in
which every run is past its second step and none has ended, and each run's step period over
steps 3..n.  The ceiling is the best of the three over ``static``, on the same lengths, per seed
(never below 1: a shared pool can always keep the split).  It is the best of these stated
schedules, not a bound: a real policy may beat it (a share of the ceiling's gain above 100% says
so).  Neither ``ideal`` nor ``ideal-pack`` wins everywhere: greedy lending can lose to the split
when a run's next step finds its engines busy with another run's long tail
(``tests/unit/test_pool_ceiling.py`` has such a case), and packing slows the packed tail.
Run: .venv/bin/python -m rolloutpipe.bench.pool_ceiling
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from rolloutpipe.bench.admission_oracle import lengths as draw_lengths
from rolloutpipe.config import Config

Schedule = Literal["static", "ideal", "ideal-pack"]
SCHEDULES: tuple[Schedule, ...] = ("static", "ideal", "ideal-pack")
EPS = 1e-9


@dataclass(frozen=True)
class Model:
    """The cost models of one run, in emulated seconds (every run of a setting shares them)."""

    slots: int = 256
    a: float = 0.006  # decode step at batch 0
    c: float = 0.00008  # per running sequence
    prefill_s: float = 0.0000085 * 256  # one sequence's prompt
    switch_s: float = 0.5
    prompt_tokens: int = 256
    tps: float = 34000.0  # trainer tokens/s (one forward+backward)
    passes: float = 1.0  # forward+backward passes a token (emulated_passes)
    call_s: float = 0.01
    opt_s: float = 0.03
    barrier: bool = False  # sync: train only after the step's last group
    prompts: int = 128
    group: int = 8
    minibatches: int = 8
    steps: int = 10
    median: float = 2500.0
    sigma: float = 0.8
    share: float = 0.5
    cap: int = 8192

    @classmethod
    def of(cls, cfg: Config) -> Model:
        from rolloutpipe.roles.trainer.backends import emulated_passes

        e, t, ctl = cfg.rollout.emulated, cfg.trainer.emulated, cfg.controller
        return cls(
            slots=e.max_num_seqs, a=e.decode_base_s, c=e.decode_per_seq_s,
            prefill_s=e.prefill_per_token_s * e.prompt_tokens, switch_s=e.switch_s,
            prompt_tokens=e.prompt_tokens, tps=t.tokens_per_s, passes=emulated_passes(cfg),
            call_s=t.call_overhead_s, opt_s=t.optimizer_step_s, barrier=cfg.trainer.schedule == "barrier",
            prompts=ctl.prompts_per_step, group=ctl.group_size, minibatches=ctl.minibatches, steps=ctl.steps,
            median=e.length_median, sigma=e.length_sigma, share=e.length_prompt_share,
            cap=e.max_response_tokens,
        )  # fmt: skip


@dataclass
class _Engine:
    run: int
    home: int  # the run that holds it in the static split, and that it goes back to when owed
    rem: np.ndarray = field(default_factory=lambda: np.zeros(0))  # tokens left, per running sequence
    group: np.ndarray = field(default_factory=lambda: np.zeros(0, int))  # its group (of ``run``)
    length: np.ndarray = field(default_factory=lambda: np.zeros(0))  # its whole response length
    stall: float = 0.0  # prefill and weight loading still to pay before decoding resumes
    busy: float = 0.0  # seconds with a sequence running or a stall


@dataclass
class Trace:
    """Per run, each step's start and end (emulated seconds), and the samples a step trains."""

    starts: list[list[float]]
    ends: list[list[float]]
    samples_per_step: int
    engines: int
    busy_s: float = 0.0
    switches: int = 0


def _train_end(t0: float, done: list[float], work: np.ndarray, gpm: int, m: Model) -> float:
    """When the step's last optimizer step ends, from its groups' completion times."""
    order = sorted(range(len(done)), key=lambda g: done[g])
    t = t0
    last = max(done)
    for i, g in enumerate(order):
        t = max(t, last if m.barrier else done[g]) + float(work[g])
        if (i + 1) % gpm == 0 or i + 1 == len(order):
            t += m.opt_s
    return t


def _pack(held: list[_Engine], m: Model) -> None:
    """``ideal-pack``: while a run with nothing queued holds engines whose sequences fit on one
    engine fewer, its least-loaded engine hands them to the others (each a continuation: it pays
    the prefill of its prompt and the tokens decoded so far), so that engine can switch."""
    held = sorted(held, key=lambda e: e.rem.size)
    if len(held) < 2 or sum(e.rem.size for e in held[1:]) + held[0].rem.size > m.slots * (len(held) - 1):
        return
    src, per_tok = held[0], m.prefill_s / max(m.prompt_tokens, 1)
    i = 0
    for dst in held[1:]:
        k = min(m.slots - dst.rem.size, src.rem.size - i)
        if k <= 0:
            continue
        sl = slice(i, i + k)
        dst.rem = np.concatenate([dst.rem, src.rem[sl]])
        dst.group = np.concatenate([dst.group, src.group[sl]])
        dst.length = np.concatenate([dst.length, src.length[sl]])
        dst.stall += float(np.sum(m.prompt_tokens + src.length[sl] - src.rem[sl])) * per_tok
        i += k
    src.rem, src.group, src.length = np.zeros(0), np.zeros(0, int), np.zeros(0)


def simulate(runs: int, per_run: int, m: Model, schedule: Schedule, seed: int = 0) -> Trace:
    """``runs`` identical runs (their own lengths) on ``runs x per_run`` engines."""
    B, G, W = m.prompts, m.group, runs * per_run
    gpm = max(1, math.ceil(B / m.minibatches))
    L = [[draw_lengths(B, G, m.median, m.sigma, m.cap, m.share, seed * 7919 + r * 104729 + k)
          for k in range(m.steps)] for r in range(runs)]  # fmt: skip
    work = [[m.call_s + (Lk.sum(1) + m.prompt_tokens * G) * m.passes / m.tps for Lk in Lr] for Lr in L]
    engines = [_Engine(run=i // per_run, home=i // per_run) for i in range(W)]
    queue: list[deque[tuple[int, int]]] = [deque() for _ in range(runs)]  # (group, sample)
    step = [0] * runs
    left = [[G] * B for _ in range(runs)]  # samples still running or queued, per group
    done_at: list[list[float]] = [[0.0] * B for _ in range(runs)]
    groups_left = [B] * runs
    starts: list[list[float]] = [[] for _ in range(runs)]
    ends: list[list[float]] = [[] for _ in range(runs)]
    pending: list[tuple[float, int]] = []  # (time, run): a step whose requests exist from then
    switches = 0
    now = 0.0

    def begin(r: int) -> None:
        starts[r].append(now)
        queue[r].extend((g, s) for g in range(B) for s in range(G))  # the plan's order (group-major)
        left[r] = [G] * B
        groups_left[r] = B

    for r in range(runs):
        begin(r)
    while any(step[r] < m.steps for r in range(runs)):
        if schedule == "ideal-pack" and any(queue):
            for r in range(runs):
                if not queue[r]:
                    _pack([e for e in engines if e.run == r and e.rem.size], m)
        for e in engines:  # admissions, then (ideal) an empty engine with nothing of its run switches
            if schedule != "static" and not e.rem.size and e.run != e.home and queue[e.home]:
                e.run = e.home  # a lent engine, empty, goes back to its run when that run has work
                e.stall += m.switch_s
                switches += 1
            elif schedule != "static" and not e.rem.size and not queue[e.run]:
                waiting = [r for r in range(runs) if queue[r]]
                if waiting:
                    e.run = min(waiting, key=lambda r: (starts[r][-1], r))
                    e.stall += m.switch_s
                    switches += 1
            q, free = queue[e.run], m.slots - e.rem.size
            if q and free > 0:
                take = [q.popleft() for _ in range(min(free, len(q)))]
                gs = np.array([g for g, _ in take])
                lk = L[e.run][step[e.run]]
                new = lk[gs, [s for _, s in take]].astype(float)
                e.rem = np.concatenate([e.rem, new])
                e.length = np.concatenate([e.length, new])
                e.group = np.concatenate([e.group, gs])
                e.stall += m.prefill_s * len(take)
        nxt = [t for t, _ in pending]
        for e in engines:
            if e.rem.size:
                nxt.append(now + e.stall + float(e.rem.min()) * (m.a + m.c * e.rem.size))
            elif e.stall > EPS:
                nxt.append(now + e.stall)
        t = min(nxt)
        for e in engines:  # advance every engine to t
            d = t - now
            paid = min(e.stall, d)
            e.stall -= paid
            e.busy += d if e.rem.size else paid
            if not e.rem.size:
                continue
            e.rem = e.rem - (d - paid) / (m.a + m.c * e.rem.size)
            out = e.rem <= EPS
            if not out.any():
                continue
            r = e.run
            for g in e.group[out].tolist():
                left[r][g] -= 1
                if left[r][g] == 0:
                    done_at[r][g] = t
                    groups_left[r] -= 1
                    if groups_left[r] == 0:
                        pending.append((_train_end(starts[r][-1], done_at[r], work[r][step[r]], gpm, m), r))
            e.rem, e.group, e.length = e.rem[~out], e.group[~out], e.length[~out]
        now = t
        for item in sorted(p for p in pending if p[0] <= now + EPS):
            pending.remove(item)
            _, r = item
            ends[r].append(now)
            step[r] += 1
            if step[r] < m.steps:
                begin(r)
    return Trace(starts, ends, B * G, W, sum(e.busy for e in engines), switches)


@dataclass(frozen=True)
class Steady:
    """The suite's steady-state measure of one configuration (real or simulated)."""

    samples_per_s: float  # every run's samples over the window, per second
    window_s: float  # the window: every run past its second step, none ended
    whole: bool  # the window was empty (runs of unequal length): the whole span instead
    period_s: list[float]  # per run, its mean step period over steps 3..n


def steady(starts: list[list[float]], ends: list[list[float]], samples: list[int]) -> Steady:
    """Samples/s over [the last run's end of step 2, the first run's end of its last step], each
    run's samples counted as a piecewise-linear curve through its step ends; each run's step period
    over steps 3..n.  With no such window (a run ends before another's step 2), the whole span."""
    lo = max(e[min(1, len(e) - 1)] for e in ends)
    hi = min(e[-1] for e in ends)
    whole = not hi > lo
    if whole:
        lo, hi = min(s[0] for s in starts), max(e[-1] for e in ends)

    def cum(r: int, t: float) -> float:
        xs = [starts[r][0], *ends[r]]
        ys = [samples[r] * k for k in range(len(xs))]
        return float(np.interp(t, xs, ys))

    rate = sum(cum(r, hi) - cum(r, lo) for r in range(len(ends))) / max(hi - lo, EPS)
    period = [(e[-1] - e[1]) / (len(e) - 2) if len(e) > 2 else (e[-1] - s[0]) / len(e)
              for s, e in zip(starts, ends, strict=True)]  # fmt: skip
    return Steady(rate, hi - lo, whole, period)


def steady_of(t: Trace) -> Steady:
    return steady(t.starts, t.ends, [t.samples_per_step] * len(t.ends))


def ceiling(runs: int, per_run: int, m: Model, seeds: int = 3) -> dict[str, Any]:
    """Per seed, the best of the three schedules over ``static``, in steady samples/s on the same
    lengths (so never below 1: the pool can always keep the split): the mean, the per-seed values
    and winners, and each schedule's figures (emulated s)."""
    rows: dict[str, list[Steady]] = {s: [] for s in SCHEDULES}
    for seed in range(seeds):
        for s in SCHEDULES:
            rows[s].append(steady_of(simulate(runs, per_run, m, s, seed)))
    best = [max(SCHEDULES, key=lambda s: rows[s][i].samples_per_s) for i in range(seeds)]
    ratios = [rows[b][i].samples_per_s / rows["static"][i].samples_per_s for i, b in enumerate(best)]
    return {
        "ceiling_ratio": float(np.mean(ratios)),
        "per_seed": ratios,
        "best": best,
        "schedules": {
            s: {
                "samples_per_emulated_s": float(np.mean([x.samples_per_s for x in xs])),
                "period_emulated_s": float(np.mean([np.mean(x.period_s) for x in xs])),
            }
            for s, xs in rows.items()
        },
    }


def main() -> None:
    from pathlib import Path

    import yaml

    from rolloutpipe.bench.harness import CONFIGS, flatten
    from rolloutpipe.config import load_config

    d = CONFIGS / "bench"
    spec = yaml.safe_load((d / "multiplex.yaml").read_text())
    common = [
        *flatten(yaml.safe_load((d / spec["workload"]).read_text()) or {}),
        *flatten(spec.get("run", {})),
    ]
    for mode in spec["run_modes"]:
        for n in spec["run_counts"]:
            cfg = load_config(Path(d / spec["hardware"]), [*common, f"controller.mode={mode}"], environ={})
            c = ceiling(n, int(spec["workers_per_run"]), Model.of(cfg))
            per = ", ".join(f"{x:.3f}" for x in c["per_seed"])
            print(
                f"{mode}, {n} runs: ceiling {c['ceiling_ratio']:.3f}x static (seeds: {per}; won: {c['best']})"
            )


if __name__ == "__main__":
    main()
