"""One training step of the trainer, top to bottom: :func:`train_step` (``trainer.py`` wires the role).

``train_step`` is one call per phase, in this order:

1. **intake** -- :class:`Intake`: the step's groups in FIFO order from the reader's queue.  The
   plan, or when it is not sealed the step's ``StepSeal``, says how many; seals of other steps are
   acknowledged (a restarted controller's) or dead-lettered; each group passes the version fence
   (``fence.py``: it is enforced here, where groups are consumed) and the dedup against
   ``consumed:k``.
2. **schedule** -- :class:`Pipelined` (``trainer.schedule: pipelined``, CGP: forward+backward of
   each group as it arrives, an optimizer step at each mini-batch boundary) or :class:`Barrier`
   (``barrier``, slime's synchronous step: the same computation, started once the step's last group
   is in).  Both have the interface of :class:`StepSchedule` and are chosen once from the config
   (``SCHEDULES``).
3. **measurement** -- :class:`StepClock`: ``observe`` per group (its read time, stamped by the
   reader) and ``compute``, the one place a compute is timed; then :func:`measure` assembles the
   ``StepMetrics`` and the timeline row, and :func:`export` hands them to the step logger and
   Prometheus once the step has committed.  Every time is observed: sample admission and
   completion stamped by the workers, group reads and computes stamped here.  The held-out
   evaluation (``evaluate.py``) of version k+1 is timed apart from the step (``eval_s``).
4. **commit** -- :func:`commit`: the OUT logs, checkpoint k+1 (the commit point), the weights of
   version k+1 published with the step's metrics, then ``consumed:k`` and the acknowledgements
   (``checkpoint.py`` gives the order and why a SIGKILL anywhere neither loses nor repeats a group).

A mini-batch is the j-th run of ``groups_per_minibatch`` groups in arrival order; a last, shorter
one takes what is left, except a lone group: under ``trainer.lone_group: merge`` (the default) it
joins the mini-batch before it, so that no optimizer step is taken on one group.  With
``trainer.flat_minibatch: skip`` a mini-batch whose loss has no gradient (``grpo.has_gradient``)
takes no optimizer step; ``StepMetrics.flat_minibatches`` lists it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from rolloutpipe import metrics
from rolloutpipe.broker.events import Group, StepMetrics, StepPlan, StepSeal
from rolloutpipe.broker.keys import Groups
from rolloutpipe.broker.streams import Broker, Entry
from rolloutpipe.config import TrainerConfig, mode_label
from rolloutpipe.errors import StaleVersionError
from rolloutpipe.rl.grpo import has_gradient
from rolloutpipe.roles.trainer import checkpoint
from rolloutpipe.roles.trainer.backends import Backend
from rolloutpipe.roles.trainer.fence import VersionFence
from rolloutpipe.runtime import queue_get

if TYPE_CHECKING:
    from rolloutpipe.roles.trainer.evaluate import EvalScore
    from rolloutpipe.roles.trainer.trainer import Trainer

log = logging.getLogger("rolloutpipe.trainer")
GROUP = Groups.TRAINER
R = TypeVar("R")


async def train_step(t: Trainer, step: int, plan: StepPlan, stop: asyncio.Event) -> StepMetrics | None:
    """Step ``step`` of ``plan``: its groups trained into version k+1, committed and published.

    None when ``stop`` is set before the step has all its groups (nothing is committed).
    """
    await asyncio.to_thread(t.backend.begin_step, step)  # the backend freezes version k
    clock = StepClock()
    intake = Intake(t.b, t.queue, step, plan, record=t.cfg.trainer.record_groups)
    tc = t.cfg.trainer
    merge = tc.lone_group == "merge"
    schedule = t.schedule(t.backend, clock, plan.groups_per_minibatch, step_rule(tc), merge)
    async for g, read_at in intake.groups(stop):  # 1. intake: FIFO, seals, the fence, dedup
        clock.observe(g, read_at)  # 3. measurement, per group
        await schedule.add(g, left=intake.left)  # 2. schedule: CGP trains it now, barrier keeps it
    if not intake.complete:  # stopped
        return None
    await schedule.finish()  # 2. schedule: what is left (all of it, for the barrier)
    train_end = time.time()
    ev, eval_s = await _evaluate(t, step)  # 3. measurement: version k+1, before it is published
    m, timeline = await measure(t, step, plan, clock, intake, schedule, train_end, ev, eval_s)
    await commit(t, step, m, intake, timeline)  # 4. commit: logs, checkpoint, publish, acks
    export(t, step, m)  # 3. measurement: the step logger and Prometheus
    return m


# ----------------------------------------------------------------------------------------- 1. intake


@dataclass
class Read:
    """An entry of the groups stream as the trainer's reader hands it over: decoded, read at."""

    entry: Entry
    event: Group | StepSeal
    read_at: float


class Intake:
    """The step's groups from the reader's queue, in arrival order, and what they commit with."""

    def __init__(
        self, b: Broker, queue: asyncio.Queue[Read], step: int, plan: StepPlan, record: bool
    ) -> None:
        self.b = b
        self.queue = queue
        self.step = step
        self.plan = plan
        self.record = record
        self.fence = VersionFence(step)
        self.total: int | None = plan.n_groups if plan.sealed else None  # else the seal says
        self.seen: set[str] = set()  # consumed:k, then this step's groups
        self.consumed: list[str] = []  # group ids, in arrival order
        self.entry_ids: list[str] = []  # the step's group entries and its seal: acknowledged at the commit
        self.trained: list[bytes] = []  # encoded groups for OUT/groups.msgpack, written at the commit

    @property
    def complete(self) -> bool:
        """The step has all its groups (never before its seal, when the plan is not sealed)."""
        return self.total is not None and len(self.consumed) >= self.total

    @property
    def left(self) -> int | None:
        """How many groups the step has still to get; None while its count is not known."""
        return None if self.total is None else max(0, self.total - len(self.consumed))

    async def groups(self, stop: asyncio.Event) -> AsyncIterator[tuple[Group, float]]:
        """Each trainable group of the step and its read time, until the step is complete or stopped."""
        self.seen = await self.b.consumed(self.step)
        while not self.complete:
            if stop.is_set():
                return
            item = await queue_get(self.queue, 0.1)
            if item is None:
                continue
            if isinstance(item.event, StepSeal):
                await self._seal(item, item.event)
            elif await self._admit(item, item.event):
                yield item.event, item.read_at

    async def _seal(self, item: Read, seal: StepSeal) -> None:
        step, plan = self.step, self.plan
        if seal.step < step:  # a controller restarted after sealing seals its step again
            log.info("seal of step %d again (a restarted controller): acknowledged", seal.step)
            await self.b.incr("duplicate_seals", step=seal.step)
            await self.b.ack(self.b.keys.groups, GROUP, item.entry.id)
            return
        why = ""
        if seal.step > step:
            why = f"seal of step {seal.step} during step {step}"
        elif plan.sealed:
            why = f"seal of step {step}, whose plan was sealed with {plan.n_groups} groups"
        elif seal.n_groups < len(self.consumed):
            why = f"seal of step {step} for {seal.n_groups} groups; {len(self.consumed)} already trained"
        if why:
            await self.b.dead_letter(item.entry, why, step=step, policy_version=seal.policy_version,
                                     counter="rejected_seals", ack_group=GROUP)  # fmt: skip
            return
        self.entry_ids.append(item.entry.id)  # acknowledged with the step's groups
        self.total = seal.n_groups

    async def _admit(self, item: Read, g: Group) -> bool:
        """The fence, then the dedup; a group let through is the step's.

        An entry that an earlier step trained and acknowledged, read again (a lost read reply, a
        sweep), is a duplicate, not a fence rejection: it was trained, on-policy, once.  Another
        entry that reuses a trained group's id is still pending, and the fence rejects it.
        """
        try:
            self.fence.check(g)
        except StaleVersionError as e:
            if await self._trained_before(item, g):
                await self._duplicate(item, g, f" (step {g.step})")
                return False
            why = f"fence: {e}"
            await self.b.dead_letter(item.entry, why, step=self.step, policy_version=g.policy_version,
                                     counter="fence_rejections", ack_group=GROUP)  # fmt: skip
            return False
        if g.group_id in self.seen:
            await self._duplicate(item, g, "")
            return False
        self.seen.add(g.group_id)
        self.consumed.append(g.group_id)
        self.entry_ids.append(item.entry.id)
        if self.record:
            self.trained.append(self.b.encode(g))
        return True

    async def _trained_before(self, item: Read, g: Group) -> bool:
        """``g``'s own entry was trained by step ``g.step``: consumed there, and acknowledged."""
        if g.step >= self.step or g.group_id not in await self.b.consumed(g.step):
            return False
        return await self.b.deliveries(item.entry, GROUP) == 0

    async def _duplicate(self, item: Read, g: Group, of: str) -> None:
        log.warning("group %s%s already consumed; acknowledging the duplicate", g.group_id, of)
        await self.b.incr("duplicate_groups", step=self.step)
        await self.b.ack(self.b.keys.groups, GROUP, item.entry.id)


# --------------------------------------------------------------------------------------- 2. schedule


def step_rule(tc: TrainerConfig) -> Callable[[list[Group]], bool]:
    """Whether a mini-batch takes its optimizer step: always (``trainer.flat_minibatch: step``), or
    only when its loss has a gradient (``skip``; ``grpo.has_gradient``)."""
    if tc.flat_minibatch == "step":
        return lambda mb: True
    return lambda mb: has_gradient(tc, [g.advantages for g in mb])


class StepSchedule:
    """When the step's groups are trained: ``add`` each group the intake lets through, then
    ``finish`` once the step has them all; every compute is timed by ``clock.compute``."""

    def __init__(
        self,
        backend: Backend,
        clock: StepClock,
        groups_per_minibatch: int,
        steps_on: Callable[[list[Group]], bool] = lambda mb: True,
        merge_lone: bool = False,
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.gpm = groups_per_minibatch
        self.steps_on = steps_on  # whether a mini-batch takes its optimizer step (flat_minibatch)
        # a last mini-batch of one group joins the one before (lone_group: merge); one group is a
        # mini-batch by design when groups_per_minibatch is 1
        self.merge_lone = merge_lone and groups_per_minibatch > 1
        self.pending: list[Group] = []  # groups not yet in a closed mini-batch
        self.minibatches: list[list[str]] = []  # group ids of each closed mini-batch
        self.flat: list[int] = []  # indices of the closed mini-batches that took no optimizer step

    def _end(self, mb: list[Group]) -> dict[str, float] | None:
        """In a worker thread: the mini-batch's optimizer step and its stats, or None if it takes none."""
        if self.steps_on(mb):
            return self.backend.optimizer_step()
        self.backend.drop_gradient()
        return None

    def _closed(self, mb: list[Group], stats: dict[str, float] | None, last_group_t0: float) -> None:
        self.clock.close_minibatch(stats, last_group_t0)
        if stats is None:
            self.flat.append(len(self.minibatches))
        self.minibatches.append([x.group_id for x in mb])

    async def add(self, g: Group, left: int | None) -> None:
        """A group of the step; ``left``: the groups still to come (0: this was the last), None
        while the step's count is not known (a plan that is not sealed, before its seal)."""
        raise NotImplementedError

    async def finish(self) -> None:
        """The training left once the step has all its groups (``minibatches`` then has them all)."""
        raise NotImplementedError


class Pipelined(StepSchedule):
    """CGP: forward+backward of each group as it arrives, the optimizer step at each boundary.

    With ``merge_lone``, a full mini-batch that the step's last group may follow alone (one group
    left, or the count not yet known) is held open; the group after it joins it if it is the last,
    else the held mini-batch takes its step first.  While the count is not known that group cannot
    tell, so its compute waits for the next group or the seal (one group's compute, moved later).
    """

    t0: float = 0.0  # when the last accumulated group's compute began
    deferred: Group | None = None  # a group after a held mini-batch, not computed yet

    async def add(self, g: Group, left: int | None) -> None:
        if self.deferred is not None:  # g follows it: the deferred group was not the last
            await self._close(self.t0)
            await self._accumulate(self.deferred)
            self.deferred = None
        elif len(self.pending) >= self.gpm:  # a held mini-batch: is g a lone last group?
            if left == 0:
                await self._accumulate(g)  # it is: it joins
                await self._close(self.t0)
                return
            if left is None:
                self.deferred = g  # cannot tell yet
                return
            await self._close(self.t0)
        await self._accumulate(g)
        if left == 0:  # the step's last group
            await self._close(self.t0)
        elif len(self.pending) == self.gpm and not (self.merge_lone and left in (None, 1)):
            await self._close(self.t0)  # a boundary that no lone group can follow

    async def finish(self) -> None:
        if self.deferred is not None:  # the seal came after it: a lone last group, joining
            await self._accumulate(self.deferred)
            self.deferred = None
        if self.pending:  # the seal came after the last group: a held or a shorter mini-batch
            await self._close(time.time())

    async def _accumulate(self, g: Group) -> None:
        self.pending.append(g)
        _, self.t0 = await self.clock.compute(self.backend.accumulate, g)

    async def _close(self, last_group_t0: float) -> None:
        stats, _ = await self.clock.compute(self._end, self.pending)
        self._closed(self.pending, stats, last_group_t0)
        self.pending = []


class Barrier(StepSchedule):
    """slime's synchronous step: nothing trained before the step's last group is in, then each
    mini-batch (its groups' forward+backward and its optimizer step) as one compute."""

    async def add(self, g: Group, left: int | None) -> None:
        self.pending.append(g)

    async def finish(self) -> None:
        mbs = [self.pending[i : i + self.gpm] for i in range(0, len(self.pending), self.gpm)]
        if self.merge_lone and len(mbs) > 1 and len(mbs[-1]) == 1:
            lone = mbs.pop()
            mbs[-1] = mbs[-1] + lone  # a lone last group joins the mini-batch before it
        for mb in mbs:
            (stats, last_group_t0), _ = await self.clock.compute(self._minibatch, mb)
            self._closed(mb, stats, last_group_t0)
        self.pending = []

    def _minibatch(self, groups: list[Group]) -> tuple[dict[str, float] | None, float]:
        """In a worker thread: the mini-batch's stats and when its last group's compute began."""
        t0 = time.time()
        for g in groups:
            t0 = time.time()
            self.backend.accumulate(g)
        return self._end(groups), t0


SCHEDULES: dict[str, type[StepSchedule]] = {"pipelined": Pipelined, "barrier": Barrier}


# ------------------------------------------------------------------------------------ 3. measurement


@dataclass
class StepClock:
    """Observed timings of one step: group reads (``observe``) and computes (``compute``)."""

    busy: float = 0.0
    mb_busy: float = 0.0  # compute of the open mini-batch
    last_mb: float = 0.0
    last_group: float = 0.0  # compute after the last group arrived: its backward + the final step
    first_read: float = 0.0
    step_start: float = float("inf")
    rollout_end: float = 0.0
    latencies: list[float] = field(default_factory=list)
    admission: list[float] = field(default_factory=list)
    busy_intervals: list[tuple[float, float]] = field(default_factory=list)
    groups: list[dict[str, object]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    tool_calls: int = 0  # the episodes' (task.tools)
    train_stats: list[dict[str, float]] = field(default_factory=list)  # one per optimizer step

    def observe(self, g: Group, read_at: float) -> None:
        """A group the step trains, read at ``read_at``; its samples' worker stamps."""
        metrics.GROUPS.labels("trainer").inc()
        metrics.GROUP_DISPATCH.observe(max(0.0, read_at - max(s.finished_at for s in g.samples)))
        if not self.first_read:
            self.first_read = read_at
        self.step_start = min(self.step_start, min(s.admitted_at for s in g.samples))
        last = max(s.finished_at for s in g.samples)
        self.rollout_end = max(self.rollout_end, last)
        self.latencies.append(read_at - last)
        self.admission.extend(s.admitted_at - s.released_at for s in g.samples if s.released_at)
        self.groups.append(
            {
                "id": g.group_id,
                "minibatch": g.frontier.minibatch,
                "completed_at": g.completed_at,
                "read_at": read_at,
                "samples": [
                    [
                        s.worker,
                        s.admitted_at,
                        s.finished_at,
                        len(s.prompt_ids),
                        len(s.response_ids),
                        s.kv_preempted_at,
                    ]
                    for s in g.samples
                ],
            }
        )
        self.rewards.extend(s.reward for s in g.samples)
        self.samples += len(g.samples)
        self.tokens += sum(len(s.response_ids) for s in g.samples)
        self.tool_calls += sum(s.tool_calls for s in g.samples)

    async def compute(self, fn: Callable[..., R], *args: Any) -> tuple[R, float]:
        """``fn(*args)`` in a worker thread, timed: one busy interval of the timeline, and busy time
        of the open mini-batch.  Its result and start time."""
        t0 = time.time()
        r = await asyncio.to_thread(fn, *args)
        t1 = time.time()
        self.busy_intervals.append((t0, t1))
        self.mb_busy += t1 - t0
        return r, t0

    def close_minibatch(self, stats: dict[str, float] | None, last_group_t0: float) -> None:
        """A mini-batch's optimizer step has returned ``stats`` (None: it took none): its compute
        joins the step's."""
        if stats is not None:
            self.train_stats.append(stats)
        self.last_group = time.time() - last_group_t0
        self.busy += self.mb_busy
        self.last_mb, self.mb_busy = self.mb_busy, 0.0


async def _evaluate(t: Trainer, step: int) -> tuple[EvalScore | None, float]:
    """The held-out score of the weights just made, when due, and its seconds (else 0)."""
    if t.evaluator is None or not t.evaluator.due(step):
        return None, 0.0
    t0 = time.time()
    score = await asyncio.to_thread(t.evaluator.score, getattr(t.backend, "model"))  # noqa: B009
    return score, time.time() - t0


async def measure(
    t: Trainer,
    step: int,
    plan: StepPlan,
    clock: StepClock,
    intake: Intake,
    schedule: StepSchedule,
    train_end: float,
    ev: EvalScore | None,
    eval_s: float,
) -> tuple[StepMetrics, dict[str, Any]]:
    """The step's ``StepMetrics`` and its row of ``OUT/timeline.jsonl``."""
    b = t.b
    mode = mode_label(t.cfg.trainer.schedule, plan.policy)
    timeline: dict[str, Any] = {
        "step": step,
        "mode": mode,
        "step_start": clock.step_start,
        "train_end": train_end,
        "busy": clock.busy_intervals,
        "groups": clock.groups,
    }
    if not intake.consumed:  # every group skipped: the step is its plan's age, with nothing trained
        clock.step_start = clock.first_read = clock.rollout_end = min(plan.created_at, train_end)
    window = max(train_end - clock.step_start, 1e-9)
    lat = np.asarray(clock.latencies or [0.0])
    stats = clock.train_stats  # the mean of each optimizer step's statistics
    train = {
        k: float(np.mean([st[k] for st in stats if k in st])) for k in sorted({k for st in stats for k in st})
    }
    m = StepMetrics(
        run=b.run,
        step=step,
        policy_version=step,
        mode=mode,
        rollout_to_train_end_s=window,
        trainer_wait_ratio=max(0.0, window - clock.busy) / window,
        first_group_s=clock.first_read - clock.step_start,
        reward_mean=float(np.mean(clock.rewards)) if clock.rewards else 0.0,
        groups=len(intake.consumed),
        samples=clock.samples,
        tokens=clock.tokens,
        fence_rejections=await b.stat("fence_rejections", step),
        dead_letters=await b.stat("dead_letters", step),
        groups_skipped=await b.stat("groups_skipped", step),
        verifier_errors=await b.stat("verifier_errors", step),
        verifier_timeouts=await b.stat("verifier_timeouts", step),
        tool_calls=clock.tool_calls,
        tool_errors=await b.stat("tool_errors", step),
        tool_timeouts=await b.stat("tool_timeouts", step),
        tool_bad_output=await b.stat("tool_bad_output", step),
        samples_wasted=max(0, await b.released_count(step) - clock.samples),
        train_busy_s=clock.busy,
        rollout_makespan_s=clock.rollout_end - clock.step_start,
        last_minibatch_train_s=clock.last_mb,
        last_group_train_s=clock.last_group,
        dispatch_latency_p50_s=float(np.percentile(lat, 50)),
        dispatch_latency_p99_s=float(np.percentile(lat, 99)),
        admission_latency_p50_s=float(np.percentile(clock.admission or [0.0], 50)),
        minibatches=schedule.minibatches,
        flat_minibatches=schedule.flat,
        step_start=clock.step_start,
        train_end=train_end,
        eval_reward=None if ev is None else ev.reward,
        eval_s=eval_s,
        eval_lo=None if ev is None else ev.lo,
        eval_hi=None if ev is None else ev.hi,
        eval_tool_rate=None if ev is None else ev.tool_rate,
        train=train,
    )
    return m, timeline


def export(t: Trainer, step: int, m: StepMetrics) -> None:
    """A committed step's metrics to the step logger (``trainer.log_to``) and Prometheus."""
    if t.logger is not None:
        t.logger.log(m)
    metrics.WAIT_RATIO.set(m.trainer_wait_ratio)
    metrics.ROLLOUT_TO_TRAIN_END.set(m.rollout_to_train_end_s)
    metrics.FIRST_GROUP.set(m.first_group_s)
    metrics.REWARD_MEAN.set(m.reward_mean)
    metrics.TRAIN_BUSY.inc(m.train_busy_s)
    metrics.TOKENS.inc(m.tokens)
    metrics.GROUPS_SKIPPED.inc(m.groups_skipped)
    metrics.SAMPLES_WASTED.inc(m.samples_wasted)
    if m.eval_reward is not None:
        metrics.EVAL_REWARD.set(m.eval_reward)
    metrics.STEP.labels("trainer").set(step)
    metrics.POLICY_VERSION.labels("trainer").set(step + 1)


# ----------------------------------------------------------------------------------------- 4. commit


async def commit(t: Trainer, step: int, m: StepMetrics, intake: Intake, timeline: dict[str, Any]) -> None:
    """Logs, checkpoint k+1 (the commit point), version k+1 + metrics, then ``consumed:k`` + acks."""
    row = json.dumps(m.model_dump(mode="json", exclude={"kind", "schema_version"})) + "\n"
    appends: dict[Path, bytes] = {t.out / "metrics.jsonl": row.encode()}
    if t.cfg.trainer.record_groups:
        appends[t.out / "groups.msgpack"] = b"".join(intake.trained)
    if t.cfg.trainer.record_timeline:
        appends[t.out / "timeline.jsonl"] = (json.dumps(timeline) + "\n").encode()
    offsets = await asyncio.to_thread(checkpoint.append_logs, appends, t.logs)
    record = {
        "commit": {"step": step, "groups": intake.consumed, "entries": intake.entry_ids},
        "metrics": m.model_dump(mode="json"),
        "logs": offsets,
    }
    await asyncio.to_thread(t.save_checkpoint, step + 1, record)
    await t.finish_commit(step, m, intake.consumed, intake.entry_ids)
