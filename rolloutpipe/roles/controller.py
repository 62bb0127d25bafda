"""The controller: the I/O around one admission and allocation policy (``scheduling/``).

For each step, once policy version k is published (the trainer's fence makes that binding):

1. the policy plans the step's groups and their initial sample counts (``StepPlan``);
2. as engine capacity frees and groups complete, the policy says which requests to release;
3. group statistics from the aggregator (``feedback``) go to the policy, whose decisions (extend,
   finalize, close, skip, add) are written as ``Allocation`` events and applied;
4. once every group's count is final and its requests are released, a plan that could change its
   groups is sealed (``StepSeal``: the number of groups the trainer will get).

Nothing here decides anything: FIFO, FGD and every allocation policy live in ``scheduling/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import astuple
from typing import Any

import numpy as np
from redis.exceptions import NoPermissionError, RedisError

from rolloutpipe import metrics
from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.events import (
    Allocation,
    GroupPlan,
    GroupStats,
    PolicyVersion,
    RolloutRequest,
    StepMetrics,
    StepPlan,
    StepSeal,
)
from rolloutpipe.broker.keys import Groups
from rolloutpipe.broker.streams import Broker
from rolloutpipe.broker.trim import trim_run
from rolloutpipe.config import Config
from rolloutpipe.errors import PolicyError
from rolloutpipe.model.lm import prompt_measure
from rolloutpipe.runtime import close_client, end_tasks, wait_event
from rolloutpipe.scheduling import make_policy
from rolloutpipe.scheduling.base import (
    AddGroup,
    Close,
    Decision,
    Extend,
    Finalize,
    GroupView,
    Policy,
    PrevStep,
    PromptRecord,
    Release,
    Skip,
    StepInfo,
    StepView,
)
from rolloutpipe.tasks.datasets import Prompt, task_prompts

log = logging.getLogger("rolloutpipe.controller")
CONSUMER = "controller"
CAPACITY_EVERY_S = 0.5  # how often live workers' slots are re-read while requests wait for them
PENDING_SWEEP_S = 2.0  # how often, when idle, the controller re-reads its own pending feedback/control


class Controller:
    def __init__(self, cfg: Config, broker: Broker, policy: Policy | None = None) -> None:
        self.cfg = cfg
        self.cc = cfg.controller
        self.b = broker
        self.prompts = task_prompts(
            cfg.task, cfg.task.num_prompts, cfg.task.seed, measure=prompt_measure(cfg)
        )
        self.policy = policy if policy is not None else make_policy(cfg.controller)
        self.streams = bool(getattr(self.policy, "stream", False))
        if self.streams and not self.policy.changes_groups:
            raise PolicyError(
                f"{self.cc.policy}: a policy that draws from the dataset stream (stream True) must set "
                "changes_groups: the next step's start is written before the step's seal"
            )
        self.history: dict[int, list[PromptRecord]] = {}
        self._history_dirty: set[int] = set()  # prompts whose history is not saved yet
        self.stop = asyncio.Event()  # the run's stop event, once ``run`` starts

    # ------------------------------------------------------------------------------------ the run

    async def run(self, stop: asyncio.Event) -> int:
        self.stop = stop
        await self.b.check_shards()
        await self.b.ensure_group(self.b.keys.feedback, Groups.CONTROLLER)
        audit = asyncio.create_task(self.audit_control(stop))
        trim = asyncio.create_task(self.trim_loop(stop))
        try:
            return await self._run(stop)
        finally:
            await end_tasks(stop, audit, trim)

    async def _run(self, stop: asyncio.Event) -> int:
        if self.policy.history > 0:
            self.history = {
                p: [PromptRecord(*r) for r in recs] for p, recs in (await self.b.prompt_history()).items()
            }
        start = max(0, await self.b.version_number())
        planned = start
        for step in range(start, self.cc.steps):
            if await self.b.wait_version(step, stop) is None:
                return 0
            view = await self.release_step(step, stop)
            planned = step + 1
            spent = 0
            if self.cc.max_rollouts > 0:  # the budget's count, kept in Redis so a restart keeps it
                spent = await self.b.record_step_rollouts(step, sum(g.released for g in view.groups.values()))
            if await self.b.wait_version(step + 1, stop) is None:
                return 0
            if 0 < self.cc.max_rollouts <= spent and step + 1 < self.cc.steps:
                log.info("%d rollouts released by step %d (max_rollouts %d): done", spent, step,
                         self.cc.max_rollouts)  # fmt: skip
                break
        await self.b.mark_done()
        log.info("run done: %d steps", planned)
        return 0

    async def audit_control(self, stop: asyncio.Event) -> None:
        """Consume ``control``: anything that is not a control event goes to dlq."""
        k = self.b.keys
        await self.b.ensure_group(k.control, Groups.CONTROLLER)
        swept = time.monotonic()
        while not stop.is_set():
            entries = await self.b.read(k.control, Groups.CONTROLLER, CONSUMER, count=64, block_ms=200)
            if not entries and time.monotonic() - swept > PENDING_SWEEP_S:  # a read whose reply was lost
                swept = time.monotonic()
                entries = await self.b.read(k.control, Groups.CONTROLLER, CONSUMER, count=64, block_ms=1,
                                            start="0")  # fmt: skip
            for e in entries:
                ev = await self.b.decode_or_dlq(e, Groups.CONTROLLER, (StepPlan, PolicyVersion, StepMetrics))
                if ev is not None:
                    await self.b.ack(k.control, Groups.CONTROLLER, e.id)

    async def trim_loop(self, stop: asyncio.Event, every_s: float = 1.0, poll_s: float = 0.1) -> None:
        """Trim acknowledged stream entries and old steps' keys (``rolloutpipe/broker/trim.py``)."""
        rc = self.cfg.redis
        if not rc.trim:
            return
        last_v, last_t = -2, 0.0
        while not stop.is_set():
            try:
                v = await self.b.version_number()
                if v != last_v or time.monotonic() - last_t >= every_s:
                    await trim_run(
                        self.b.r,
                        self.b.keys,
                        max(0, v),
                        keep_steps=rc.keep_steps,
                        control_maxlen=rc.control_maxlen,
                        sample_shards=self.b.shards,
                    )
                    last_v, last_t = v, time.monotonic()
            except NoPermissionError as e:  # an ACL user without XTRIM/XINFO/XPENDING/DEL (compose)
                log.error("trimming off for this run: the controller's Redis user may not trim: %s", e)
                with contextlib.suppress(RedisError):
                    await self.b.incr("trim_errors")
                return
            except RedisError as e:  # trimming is housekeeping: never the reason a run fails
                log.warning("trim failed (trying again): %s", e)
                with contextlib.suppress(RedisError):
                    await self.b.incr("trim_errors")
            await wait_event(stop, poll_s)

    async def wait_for_trainer(self, stop: asyncio.Event, poll_s: float = 0.05) -> None:
        """Backpressure: hold releases while the trainer is more than ``max_trainer_lag_groups`` behind."""
        limit = self.cc.max_trainer_lag_groups
        if limit <= 0:
            return
        held = False
        while not stop.is_set():
            lag = await self.b.trainer_lag()
            if lag <= limit:
                break
            if not held:
                held = True
                log.warning("trainer %d groups behind (> %d): holding releases", lag, limit)
                await self.b.incr("backpressure_holds")
            await wait_event(stop, poll_s)
        if held:
            log.info("trainer caught up: releasing again")

    # ------------------------------------------------------------------------------------ a step

    async def release_step(self, step: int, stop: asyncio.Event) -> StepView:
        """Plan step ``step`` and drive its policy until every count is final and every request released.

        On a restart the plan, the released request ids and the allocations are read back, so a
        request is released once and a decision is not taken twice.
        """
        await self.b.ensure_group(self.b.keys.feedback, Groups.CONTROLLER)
        plan = await self.b.plan(step)
        if plan is None:
            await self.drain_feedback(None)  # the last step's groups, into the per-prompt history
        info = await self.step_info(step, plan)
        specs = self.policy.plan(info)  # also on a restart: per-step state
        if plan is None:
            gpm = self.cc.prompts_per_step // self.cc.minibatches
            plan = StepPlan(
                run=self.b.run,
                step=step,
                policy_version=step,
                policy=self.cc.policy,
                groups=[
                    GroupPlan(group_id=f"{step}:{i}", prompt_index=s.prompt_index, n=s.n, final=s.final)
                    for i, s in enumerate(specs)
                ],
                minibatches=self.cc.minibatches,
                groups_per_minibatch=gpm,
                sealed=not self.policy.changes_groups,
                first_prompt=info.first_prompt,
                created_at=time.time(),
            )
            await self.b.write_plan(plan)
            view = self.view_of(plan)
        else:
            view = self.view_of(plan)
            await self.restore(step, view)
            await self.drain_feedback(view)  # news an earlier controller read but did not act on
        await self.drive(step, plan, view, stop)
        return view

    async def step_info(self, step: int, plan: StepPlan | None = None) -> StepInfo:
        B = self.cc.prompts_per_step
        prev = await self.b.step_metrics(step - 1)
        first = step * B
        if plan is not None and plan.first_prompt >= 0:  # a restart: where the step began
            first = plan.first_prompt
        elif self.streams and step > 0:  # where the last step stopped drawing
            pos = await self.b.prompt_cursor(step)
            if pos is None:
                raise PolicyError(
                    f"{self.cc.policy}: step {step - 1} left no dataset position for step {step} (a run "
                    "started with a policy that does not draw from the stream?)"
                )
            first = pos
        return StepInfo(
            step=step,
            prompts=[(first + g) % len(self.prompts) for g in range(B)],
            group_size=self.cc.group_size,
            minibatches=self.cc.minibatches,
            n_prompts=len(self.prompts),
            prev=None
            if prev is None
            else PrevStep(prev.step, prev.train_busy_s, prev.rollout_makespan_s, prev.first_group_s),
            history=self.history,
            first_prompt=first,
        )

    def view_of(self, plan: StepPlan) -> StepView:
        gpm = plan.groups_per_minibatch
        groups = {
            g.group_id: GroupView(
                group_id=g.group_id,
                prompt_index=g.prompt_index,
                order=i,
                minibatch=i // gpm,
                initial=g.n,
                target=g.n,
                final=g.final,
                status="final" if g.final else "open",
                counts=[g.n],
            )
            for i, g in enumerate(plan.groups)
        }
        first = plan.first_prompt if plan.first_prompt >= 0 else plan.step * self.cc.prompts_per_step
        return StepView(plan.step, plan.minibatches, gpm, groups, history=self.history, first_prompt=first)

    async def restore(self, step: int, view: StepView) -> None:
        """A restarted controller: what was released, and every decision already taken."""
        for gid, a in sorted((await self.b.allocations(step)).items(), key=lambda x: x[1].minibatch_hint):
            g = view.groups.get(gid) or self.add_view(view, a.prompt_index, a.initial, a.final, gid)
            g.target, g.final, g.status, g.counts = a.n, a.final, a.status, list(a.counts)
            g.revision, g.completed, g.rewards, g.lengths = a.revision, a.completed, a.rewards, a.lengths
            if g.status == "skipped" and g.completed:  # the history of a skip not saved before the restart
                self.record(step, g.prompt_index, g.rewards, g.lengths, 0, trained=False)
        for rid in await self.b.released_ids(step):
            gid, _, _ = rid.rpartition(":")
            if gid in view.groups:
                view.groups[gid].released += 1
        for gid in await self.b.emitted_ids(step):
            if gid in view.groups:
                view.groups[gid].emitted = True
        view.emitted = sum(1 for g in view.groups.values() if g.emitted)
        n = sum(g.released for g in view.groups.values())
        log.info("step %d already planned (restart): %d requests released", step, n)

    async def drive(self, step: int, plan: StepPlan, view: StepView, stop: asyncio.Event) -> None:
        cap, cap_at = 0, 0.0
        sealed = plan.sealed
        swept = time.monotonic()
        while not stop.is_set():
            todo = any(g.unreleased for g in view.groups.values())
            entries = await self.b.read_feedback(CONSUMER, block_ms=5 if todo else 200)
            if not entries and time.monotonic() - swept > PENDING_SWEEP_S:
                # Feedback delivered to us whose reply was lost (a dropped connection) is pending
                # without our having seen it; on_stats ignores news it already had.
                swept = time.monotonic()
                entries = await self.b.read_feedback(CONSUMER, block_ms=1, count=1024, start="0")
            for e in entries:
                ev = await self.b.decode_or_dlq(e, Groups.CONTROLLER, (GroupStats,))
                if ev is not None:
                    assert isinstance(ev, GroupStats)
                    await self.on_stats(view, ev)
                    await self.b.ack(self.b.keys.feedback, Groups.CONTROLLER, e.id)
            self.check_not_stuck(view)
            if any(g.unreleased for g in view.groups.values()):
                if time.monotonic() - cap_at > CAPACITY_EVERY_S or cap == 0:
                    cap, cap_at = await self.b.capacity(), time.monotonic()
                    view.kv_tokens = await self.b.kv_tokens()
                released = sum(g.released for g in view.groups.values())
                view.capacity = cap
                view.inflight = released - await self.b.finished(step)
                releases = self.policy.admit(view, max(cap, 1) - view.inflight)
                await self.release(step, plan, view, releases)
            if all(g.status != "open" and not g.unreleased for g in view.groups.values()):
                if self.streams:  # before the seal: the trainer cannot end the step before it
                    await self.b.set_prompt_cursor(step + 1, self.policy.next_prompt(view))
                if not sealed:
                    await self.seal(step, view)
                    sealed = True
                log.info("step %d: every request released, every count final (%s)", step, self.cc.policy)
                return

    def check_not_stuck(self, view: StepView) -> None:
        """A group left open with every sample complete, and no other news to come, would wait forever."""
        groups = view.groups.values()
        waiting = [g.group_id for g in groups if g.waiting]
        if waiting and all(g.waiting or g.emitted or g.status == "skipped" for g in groups):
            raise PolicyError(
                f"{self.cc.policy}: groups {waiting} of step {view.step} are complete but not final, and no "
                "other group will report again: on_stats must extend, finalize, close or skip them"
            )

    async def on_stats(self, view: StepView, ev: GroupStats) -> None:
        """Feedback on one group: record it, and give the policy its turn if the group is this step's."""
        if ev.emitted:
            self.remember(ev)
        g = view.groups.get(ev.group_id) if ev.step == view.step else None
        if g is None or ev.n < g.completed or (ev.n == g.completed and g.emitted == ev.emitted):
            return  # another step's, or news we have already had (a redelivery)
        g.completed, g.rewards, g.lengths, g.truncated = ev.n, ev.rewards, ev.lengths, ev.truncated
        if ev.emitted and not g.emitted:
            g.emitted = True
            view.emitted += 1
        await self.apply(view, self.policy.on_stats(view, g))

    def remember(self, ev: GroupStats) -> None:
        """An emitted group into its prompt's history (only as much as the policy reads)."""
        self.record(ev.step, ev.prompt_index, ev.rewards, ev.lengths, ev.truncated, trained=True)

    def record(
        self, step: int, prompt: int, rewards: Any, lengths: Any, truncated: int, *, trained: bool
    ) -> None:
        """A finished group into its prompt's history: trained (emitted) or skipped with the samples
        it had (a pilot, a flat group), so a policy can tell a prompt seen from a prompt trained."""
        keep = self.policy.history
        if keep <= 0:
            return
        r = np.asarray(rewards, dtype=np.float64)
        n = len(r)
        rec = PromptRecord(
            step=step,
            n=n,
            reward_mean=float(r.mean()) if n else 0.0,
            reward_std=float(r.std()) if n else 0.0,
            pass_rate=float((r > 0).mean()) if n else 0.0,
            mean_length=float(np.mean(lengths)) if len(lengths) else 0.0,
            truncated_frac=truncated / max(1, n),
            trained=trained,
        )
        recs = [x for x in self.history.get(prompt, []) if x.step != step]
        self.history[prompt] = [*recs, rec][-keep:]
        self._history_dirty.add(prompt)

    async def drain_feedback(self, view: StepView | None) -> None:
        """Take the feedback that is there without waiting: first any entry read before but not
        acknowledged (a restart), then the new ones.  ``view``: the step under way, whose news goes
        to the policy; without one (a step not planned yet) only the history learns from it."""
        for start in ("0", ">"):
            while entries := await self.b.read_feedback(CONSUMER, block_ms=1, count=1024, start=start):
                for e in entries:
                    ev = await self.b.decode_or_dlq(e, Groups.CONTROLLER, (GroupStats,))
                    if not isinstance(ev, GroupStats):
                        continue
                    if view is not None:
                        await self.on_stats(view, ev)
                    elif ev.emitted:
                        self.remember(ev)
                    await self.b.ack(self.b.keys.feedback, Groups.CONTROLLER, e.id)
                if start == "0":
                    break  # the pending list, read once
        await self.save_history()

    async def save_history(self) -> None:
        dirty, self._history_dirty = self._history_dirty, set()
        await self.b.save_prompt_history(
            {p: [astuple(r) for r in self.history[p]] for p in dirty if p in self.history}
        )

    # ------------------------------------------------------------------------------------ decisions

    async def apply(self, view: StepView, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, AddGroup):
                if not self.policy.changes_groups:
                    raise PolicyError(f"{self.cc.policy}: AddGroup from a policy with changes_groups False")
                g = self.add_view(view, d.prompt_index, d.n, d.final)
                await self.allocate(view, g, d.reason)
                continue
            found = view.groups.get(d.group_id)
            if found is None:
                raise PolicyError(f"{self.cc.policy}: decision on unknown group {d.group_id!r}")
            g = found
            if g.status != "open":
                raise PolicyError(f"{self.cc.policy}: {type(d).__name__} on group {g.group_id} ({g.status})")
            if isinstance(d, Extend):
                if d.n < 1:
                    raise PolicyError(f"{self.cc.policy}: Extend by {d.n} samples")
                g.target += d.n
                g.counts.append(g.target)
                g.final = d.final
                g.status = "final" if d.final else "open"
            elif isinstance(d, Finalize):
                g.final, g.status = True, "final"
            elif isinstance(d, Close):
                if not 1 <= d.keep <= g.completed:
                    raise PolicyError(
                        f"{self.cc.policy}: Close({g.group_id}, keep={d.keep}) but {g.completed} samples are "
                        "complete: a group keeps only completed samples (use Skip to drop it)"
                    )
                g.target, g.final, g.status = d.keep, True, "closed"
                g.counts.append(d.keep)
            elif isinstance(d, Skip):
                if not self.policy.changes_groups:
                    raise PolicyError(f"{self.cc.policy}: Skip from a policy with changes_groups False")
                g.final, g.status = True, "skipped"
                if g.completed:  # what the skipped group showed, for the policy's next look at it
                    self.record(view.step, g.prompt_index, g.rewards, g.lengths, g.truncated, trained=False)
            await self.allocate(view, g, getattr(d, "reason", ""))

    def add_view(
        self, view: StepView, prompt_index: int | None, n: int, final: bool, group_id: str = ""
    ) -> GroupView:
        i = len(view.groups)
        if prompt_index is None:  # the dataset's next prompts after the step's own
            prompt_index = (view.first_prompt + i) % len(self.prompts)
        g = GroupView(
            group_id=group_id or f"{view.step}:{i}",
            prompt_index=prompt_index,
            order=i,
            minibatch=i // view.groups_per_minibatch,
            initial=n,
            target=n,
            final=final,
            status="final" if final else "open",
            counts=[n],
            added=True,
        )
        view.groups[g.group_id] = g
        return g

    async def allocate(self, view: StepView, g: GroupView, reason: str) -> None:
        g.revision += 1
        alloc = Allocation(
            run=self.b.run,
            step=view.step,
            policy_version=view.step,
            group_id=g.group_id,
            prompt_index=g.prompt_index,
            n=g.target,
            completed=g.completed,
            rewards=g.rewards,
            lengths=g.lengths,
            final=g.final,
            status=g.status,
            reason=reason,
            initial=g.initial,
            counts=list(g.counts),
            revision=g.revision,
            minibatch_hint=g.order,
            created_at=time.time(),
        )
        await self.b.write_allocation(alloc)
        if g.status in ("closed", "skipped"):
            await self.b.incr(f"groups_{g.status}", step=view.step)
        log.info("step %d group %s: %s at %d samples%s", view.step, g.group_id, g.status, g.target,
                 f" ({reason})" if reason else "")  # fmt: skip

    async def seal(self, step: int, view: StepView) -> None:
        skipped = [g.group_id for g in view.groups.values() if g.status == "skipped"]
        n = len(view.groups) - len(skipped)
        await self.b.seal(
            StepSeal(
                run=self.b.run,
                step=step,
                policy_version=step,
                n_groups=n,
                skipped=skipped,
                created_at=time.time(),
            )
        )
        log.info("step %d sealed: %d groups for the trainer, %d skipped", step, n, len(skipped))

    # ------------------------------------------------------------------------------------ releases

    async def release(self, step: int, plan: StepPlan, view: StepView, releases: list[Release]) -> None:
        reqs: list[RolloutRequest] = []
        share = plan.n_requests if self.policy.engine_queue else 0
        for r in releases:
            g = view.groups.get(r.group_id)
            if g is None or r.n < 0 or r.n > g.unreleased:
                raise PolicyError(f"{self.cc.policy}: {r} but the group has {g and g.unreleased} to release")
            reqs += [self.request(step, g, s, share) for s in range(g.released, g.released + r.n)]
        if await self.send(step, reqs):
            for r in releases:
                view.groups[r.group_id].released += r.n

    async def send(self, step: int, reqs: list[RolloutRequest]) -> bool:
        """Release ``reqs`` (one MULTI), after backpressure; False if nothing went (stopping, or none)."""
        if not reqs:
            return False
        await self.wait_for_trainer(self.stop)
        if self.stop.is_set():
            return False
        await self.b.release(step, reqs)
        metrics.REQUESTS_RELEASED.inc(len(reqs))
        metrics.STEP.labels("controller").set(step)
        return True

    def request(self, step: int, g: GroupView, s: int, share: int) -> RolloutRequest:
        p: Prompt = self.prompts[g.prompt_index]
        rc = self.cfg.rollout
        return RolloutRequest(
            run=self.b.run,
            step=step,
            policy_version=step,
            request_id=f"{g.group_id}:{s}",
            group_id=g.group_id,
            prompt_index=g.prompt_index,
            sample_index=s,
            prompt=p.text,
            answer=p.answer,
            seed=(self.cc.seed * 1_000_003 + step * 10_007 + g.order * 101 + s) % (2**31),
            max_new_tokens=rc.max_new_tokens,
            temperature=rc.temperature,
            minibatch_hint=g.minibatch,
            priority=g.priority,
            queue_share_of=share,
            released_at=time.time(),
            messages=list(p.messages),
            data_source=p.data_source,
            extra_info=p.extra_info,
        )


async def run_controller(cfg: Config, url: str, run: str, stop: asyncio.Event) -> int:
    metrics.serve(cfg.metrics.port, cfg.metrics.host, "controller")
    r = connect(url)
    try:
        b = Broker(r, run, "controller", maxlen=cfg.redis.maxlen, sample_shards=cfg.redis.sample_shards)
        return await Controller(cfg, b).run(stop)
    finally:
        await close_client(r)
