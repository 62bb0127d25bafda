"""A true lower bound on one step's rollout-to-train-end, for the emulated engine and trainer.

Why it exists: a benchmark that reports "share of the achievable cut" needs a figure that no
schedule can beat.  ``makespan + the last mini-batch's training`` is not one (a trainer that
trains group by group beats it), and neither is ``sync's makespan + the last group``: a schedule
that balances load better finishes the rollout sooner.  This bound depends only on the step's
workload (every sample's prompt and response length) and the cost models, never on a schedule.

The models (``engines/emulated.py``, ``roles/trainer/backends.py``), in emulated seconds:

* E engines of S slots; a decode step with n running sequences takes ``a + c*n`` and advances
  each of them one token; a request's prefill ``p`` stalls its engine's batch.
* a group g costs the trainer ``tau_g = h + tokens_g * passes / tokens_per_s``; one optimizer step
  per mini-batch of ``gpm`` groups (mini-batches form in arrival order) costs ``o``; the trainer
  does one thing at a time.

Claims, for any admission order, window, engine assignment and priority, with times measured
from the step's first admission:

1. **A sample of length L completes no earlier than** ``p + L*(a + c)``: its prefill, then L
   decode steps, each at least ``a + c`` (n >= 1).  So group g completes no earlier than
   ``r_g = p + L_g*(a + c)``, L_g its longest sample.
2. **The rollout's work.**  An engine whose decode steps advance N_e tokens in total spends at
   least ``N_e*(c + a/S)`` decoding (a step with n <= S sequences costs ``a + c*n >= n*(c + a/S)``
   for n tokens), plus ``R_e*p`` of prefill.  The last engine to finish finishes no earlier than
   the mean, so the last sample completes no earlier than ``W = (N*(c + a/S) + R*p) / E``.  The
   group it belongs to is then trained (at least ``min tau``) and an optimizer step follows.
   Likewise the group holding the longest sample: ``r_max + tau of that group + o``.
2b. **The engine that decodes the longest sample** (a sample never moves between engines) takes
   at least L_max decode steps and at least N_1/S, and pays ``c`` for each of its N_1 tokens:
   ``T_1 >= a*max(L_max, N_1/S) + c*N_1 + p``, increasing in N_1 >= L_max; the other E - 1
   engines share the other tokens: their mean is at least ``(N - N_1)*(c + a/S)/(E - 1)``,
   decreasing in N_1.  Whatever N_1 a schedule picks, the rollout lasts at least the larger of the
   two, so at least ``min over N_1 of max(T_1, T_rest)`` (found by bisection on the crossing,
   taking the safe side of the final bracket); then a group and a step, as in 2.
3. **The trainer's work.**  Sort groups by r_g.  The groups with r_g >= r_(k) (n - k + 1 of them)
   can all start training only after r_(k), and they fill at least ``ceil((n-k+1)/gpm)``
   mini-batches whose optimizer steps come after their groups: the step ends no earlier than
   ``r_(k) + sum of their tau + ceil((n-k+1)/gpm)*o``, for every k.

The bound is the largest of these.  It holds for ``sync`` too (a barrier only adds waiting).

**It holds as it is for a KV-limited engine** (``rollout.emulated.kv_cache_tokens`` > 0), with
``a`` and ``c`` the engine's ``decode_base_s`` and ``decode_per_seq_s``: every cost the cache adds
is non-negative and none removes one.  A decode step costs ``a + c*n + k*cached >= a + c*n``; a
preempted sequence stays on its engine and pays its prefill again (more prefill than claims 1-2b
count, never less); waiting for free blocks only delays.  It is looser there, since it charges
none of that.
Measured runs can exceed it only by scheduling; they undercut it only if the emulation or the
clock is wrong, which ``rolloutpipe bench`` reports as a violation.

``wait_ratio_bound``: the trainer's busy time B over a step is fixed by the workload (the same
calls in every mode), so ``wait = 1 - B / r2t >= 1 - B / bound``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineModel:
    engines: int
    slots: int
    decode_base_s: float  # a
    decode_per_seq_s: float  # c
    prefill_s: float  # p: one request's prefill
    time_scale: float = 1.0  # wall seconds per emulated second
    # The KV cache, as ``engines/emulated.py`` models it (0: none).  The bound ignores these (the
    # docstring says why it still holds); the oracle (``bench/oracle.py``) plays them.
    kv_tokens: int = 0
    kv_block_tokens: int = 16
    decode_per_kv_token_s: float = 0.0  # k: a decode step's cost per cached token it reads
    prefill_per_token_s: float = 0.0  # a preempted sequence's recompute: this x (prompt + its tokens)
    preemption: str = "vllm"  # whom the engine preempts: "vllm" (priority) or "sglang"


@dataclass(frozen=True)
class TrainerModel:
    tokens_per_s: float
    passes: float
    call_overhead_s: float  # h
    optimizer_step_s: float  # o
    groups_per_minibatch: int
    time_scale: float = 1.0

    def group_s(self, tokens: int) -> float:
        return self.call_overhead_s + tokens * self.passes / self.tokens_per_s


@dataclass(frozen=True)
class Bound:
    """Wall seconds.  ``r2t`` is the bound; the others are its terms, for the table's reader."""

    r2t: float
    rollout_work: float  # terms 2 and 2b, the pool's work (+ a group + a step)
    longest: float  # term 2, the longest sample alone (+ its group + a step)
    trainer: float  # term 3
    train_busy: float  # the trainer's total work


def r2t_bound(groups: Sequence[Sequence[tuple[int, int]]], eng: EngineModel, tr: TrainerModel) -> Bound:
    """``groups``: for each group, its samples as (prompt tokens, response tokens)."""
    if not groups or any(not g for g in groups):
        raise ValueError("a step's bound needs at least one group, each with at least one sample")
    a, c, p = eng.decode_base_s, eng.decode_per_seq_s, eng.prefill_s
    es, ts = eng.time_scale, tr.time_scale
    tau = [tr.group_s(sum(pt + rt for pt, rt in g)) * ts for g in groups]
    ready = [(p + max(rt for _, rt in g) * (a + c)) * es for g in groups]
    o = tr.optimizer_step_s * ts
    gpm = tr.groups_per_minibatch
    n_tokens = sum(rt for g in groups for _, rt in g)
    n_req = sum(len(g) for g in groups)
    work = (n_tokens * (c + a / eng.slots) + n_req * p) / eng.engines * es
    work = max(work, split_work(n_tokens, max(rt for g in groups for _, rt in g), eng) * es)
    rollout_work = work + min(tau) + o
    longest_g = max(range(len(groups)), key=lambda i: (ready[i], -tau[i]))
    longest = ready[longest_g] + min(tau[i] for i in range(len(groups)) if ready[i] == ready[longest_g]) + o
    order = sorted(range(len(groups)), key=lambda i: ready[i])
    trainer, tail = 0.0, 0.0
    n = len(groups)
    for k in range(n - 1, -1, -1):  # groups order[k:] all become ready at or after ready[order[k]]
        tail += tau[order[k]]
        trainer = max(trainer, ready[order[k]] + tail + math.ceil((n - k) / gpm) * o)
    busy = sum(tau) + math.ceil(n / gpm) * o
    return Bound(max(rollout_work, longest, trainer), rollout_work, longest, trainer, busy)


def split_work(n_tokens: int, longest: int, eng: EngineModel) -> float:
    """Claim 2b: min over N_1 in [longest, n_tokens] of max(T_1(N_1), T_rest(N_1)), emulated s."""
    a, c, p, S, E = eng.decode_base_s, eng.decode_per_seq_s, eng.prefill_s, eng.slots, eng.engines

    def t1(n1: float) -> float:
        return a * max(longest, n1 / S) + c * n1 + p

    def rest(n1: float) -> float:
        return (n_tokens - n1) * (c + a / S) / (E - 1) if E > 1 else (math.inf if n1 < n_tokens else 0.0)

    lo, hi = float(longest), float(n_tokens)
    if t1(lo) >= rest(lo):
        return t1(lo)
    for _ in range(100):  # t1 - rest is increasing: t1(lo) < rest(lo), t1(hi) >= rest(hi)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t1(mid) < rest(mid) else (lo, mid)
    # every N_1 <= lo gives >= rest(lo) >= rest(hi); every N_1 >= hi gives >= t1(hi) >= t1(lo); in
    # between, >= max(t1(lo), rest(hi)): so the minimum is at least that
    return max(t1(lo), rest(hi))


def wait_ratio_bound(train_busy_s: float, r2t_bound_s: float) -> float:
    """No step whose trainer is busy ``train_busy_s`` can wait less than this share of its r2t."""
    return max(0.0, 1.0 - train_busy_s / r2t_bound_s) if r2t_bound_s > 0 else 0.0
