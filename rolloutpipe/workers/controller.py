"""The controller: turns the dataset into rollout requests for step k, in one of three modes.

* ``sync`` and ``cgp`` release every request of the step at once, in plain FIFO (dataset) order;
* ``cgp-fgd`` (frontier-group dispatch) holds requests back and admits them only as engine
  capacity frees, frontier groups first: groups already under way and groups that the next
  mini-batch needs go before later groups, and leftover capacity is filled with later groups.

Step k starts only once policy version k is published (the trainer's fence makes that binding).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from redis.exceptions import NoPermissionError, RedisError, ResponseError

from rolloutpipe import metrics
from rolloutpipe.broker.events import PolicyVersion, RolloutRequest, StepMetrics, StepPlan
from rolloutpipe.broker.streams import DATA, Broker, connect
from rolloutpipe.broker.trim import TRAINER_GROUP, trim_run
from rolloutpipe.broker.trim import as_str as _str
from rolloutpipe.config import Config
from rolloutpipe.errors import CodecError
from rolloutpipe.runtime import close_client, end_tasks, wait_event
from rolloutpipe.workers.task import Prompt, load_dataset

log = logging.getLogger("rolloutpipe.controller")


def build_requests(cfg: Config, run: str, step: int, prompts: list[Prompt]) -> list[RolloutRequest]:
    """Requests of step ``step`` in group-major order (all samples of group 0, then group 1, …)."""
    cc = cfg.controller
    B, G = cc.prompts_per_step, cc.group_size
    gpm = B // cc.minibatches
    now = time.time()
    out = []
    for g in range(B):
        pidx = (step * B + g) % len(prompts)
        p = prompts[pidx]
        gid = f"{step}:{g}"
        for s in range(G):
            out.append(
                RolloutRequest(
                    run=run,
                    step=step,
                    policy_version=step,
                    request_id=f"{gid}:{s}",
                    group_id=gid,
                    prompt_index=pidx,
                    sample_index=s,
                    group_size=G,
                    prompt=p.text,
                    answer=p.answer,
                    seed=(cc.seed * 1_000_003 + step * 10_007 + g * 101 + s) % (2**31),
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature,
                    minibatch_hint=g // gpm,
                    released_at=now,
                )
            )
    return out


class Controller:
    def __init__(self, cfg: Config, broker: Broker) -> None:
        self.cfg = cfg
        self.b = broker
        self.k = broker.keys
        self.prompts = load_dataset(cfg.task.dataset, cfg.task.num_prompts, cfg.task.seed, cfg.task.path)
        self.window_on: dict[int, bool] = {}  # FGD frontier window per step
        self.free_makespan: float | None = None  # makespan of the last step without the window
        self.stop = asyncio.Event()  # the run's stop event, once ``run`` starts

    async def version(self) -> int:
        raw = await self.b.r.get(self.k.version)
        return -1 if raw is None else self.b.codec.decode_as(raw, PolicyVersion).policy_version

    async def wait_version(self, v: int, stop: asyncio.Event) -> bool:
        while not stop.is_set():
            if await self.version() >= v:
                return True
            await wait_event(stop, 0.01)
        return False

    async def capacity(self) -> int:
        """Sum of live workers' slots, from their heartbeat keys (TTL'd)."""
        total = 0
        async for key in self.b.r.scan_iter(match=self.k.heartbeat_pattern(), count=100):
            raw = await self.b.r.get(key)
            if raw:
                with contextlib.suppress(ValueError, KeyError):
                    total += int(json.loads(raw)["capacity"])
        return total

    async def audit_control(self, stop: asyncio.Event) -> None:
        """Consume ``control`` (group ``controller``): anything that is not a control event goes to dlq."""
        await self.b.ensure_group(self.k.control, "controller")
        while not stop.is_set():
            entries = await self.b.read(self.k.control, "controller", "controller", count=64, block_ms=200)
            for e in entries:
                ev = await self.b.decode_or_dlq(e, "controller", (StepPlan, PolicyVersion, StepMetrics))
                if ev is not None:
                    await self.b.ack(self.k.control, "controller", e.id)

    async def run(self, stop: asyncio.Event) -> int:
        self.stop = stop
        audit = asyncio.create_task(self.audit_control(stop))
        trim = asyncio.create_task(self.trim_loop(stop))
        try:
            return await self._run(stop)
        finally:
            await end_tasks(stop, audit, trim)

    async def trim_loop(self, stop: asyncio.Event, every_s: float = 1.0, poll_s: float = 0.1) -> None:
        """Trim acknowledged stream entries and old steps' keys (``rolloutpipe/broker/trim.py``).

        Runs as each new policy version (step) appears, and at least every ``every_s`` seconds.
        """
        rc = self.cfg.redis
        if not rc.trim:
            return
        last_v, last_t = -2, 0.0
        while not stop.is_set():
            try:
                v = await self.version()
                if v != last_v or time.monotonic() - last_t >= every_s:
                    await trim_run(
                        self.b.r,
                        self.k,
                        max(0, v),
                        keep_steps=rc.keep_steps,
                        control_maxlen=rc.control_maxlen,
                    )
                    last_v, last_t = v, time.monotonic()
                    for old in [s for s in self.window_on if s < v - 2]:  # use_window reads step - 1
                        del self.window_on[old]
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

    async def trainer_lag(self) -> int:
        """Groups in ``groups`` the trainer has not acknowledged: undelivered (lag) + pending."""
        try:
            groups: Any = await self.b.r.xinfo_groups(self.k.groups)
        except ResponseError:  # no stream yet
            return 0
        for g in groups:
            if _str(g["name"]) != TRAINER_GROUP:
                continue
            lag = g.get("lag")
            if lag is None:  # Redis cannot tell (entries deleted mid-stream): count them
                after: Any = await self.b.r.xrange(
                    self.k.groups, min="(" + _str(g["last-delivered-id"]), max="+"
                )
                lag = len(after)
            return int(lag) + int(g["pending"])
        return int(await self.b.r.xlen(self.k.groups))  # no trainer group yet: nothing consumed

    async def wait_for_trainer(self, stop: asyncio.Event, poll_s: float = 0.05) -> None:
        """Backpressure: hold releases while the trainer is more than ``max_trainer_lag_groups`` behind."""
        limit = self.cfg.controller.max_trainer_lag_groups
        if limit <= 0:
            return
        held = False
        while not stop.is_set():
            lag = await self.trainer_lag()
            if lag <= limit:
                break
            if not held:
                held = True
                log.warning("trainer %d groups behind (> %d): holding releases", lag, limit)
                await self.b.incr("backpressure_holds")
            await wait_event(stop, poll_s)
        if held:
            log.info("trainer caught up: releasing again")

    async def _run(self, stop: asyncio.Event) -> int:
        cc = self.cfg.controller
        start = max(0, await self.version())
        for step in range(start, cc.steps):
            if not await self.wait_version(step, stop):
                return 0
            await self.release_step(step, stop)
            if not await self.wait_version(step + 1, stop):
                return 0
        await self.b.r.set(self.k.done, b"1")
        log.info("all %d steps done", cc.steps)
        return 0

    def released_ids(self, step: int) -> str:
        """Set of the request ids of step ``step`` already on ``requests`` (written with them)."""
        return f"{self.k.released(step)}:ids"

    async def release_step(self, step: int, stop: asyncio.Event) -> None:
        """Plan step ``step`` and release its requests; on a restart, only the ones not yet released.

        Each release batch is one ``MULTI`` (``XADD``s, the ``released:k`` counter and the
        ``released:k:ids`` set), so after a SIGKILL a request is either released and recorded or
        neither; a restarted controller re-reads ``plan:k`` and the set and releases the rest.
        """
        cc = self.cfg.controller
        reqs = build_requests(self.cfg, self.b.run, step, self.prompts)
        if await self.b.r.exists(self.k.plan(step)):
            done = {_str(x) for x in await self.b.r.smembers(self.released_ids(step))}
            if len(done) >= len(reqs):
                log.info("step %d already planned and released (restart)", step)
                return
            log.info(
                "step %d already planned (restart): %d of %d requests released", step, len(done), len(reqs)
            )
            await self._release_rest(step, reqs, done, stop)
            return
        plan = StepPlan(
            run=self.b.run,
            step=step,
            policy_version=step,
            mode=cc.mode,
            n_groups=cc.prompts_per_step,
            group_size=cc.group_size,
            minibatches=cc.minibatches,
            created_at=time.time(),
        )
        raw = self.b.encode(plan)
        pipe = self.b.r.pipeline(transaction=True)
        pipe.set(self.k.plan(step), raw)
        pipe.xadd(self.k.control, {DATA: raw}, maxlen=self.b.maxlen, approximate=True)
        await pipe.execute()
        await self._release_rest(step, reqs, set(), stop)

    async def _release_rest(
        self, step: int, reqs: list[RolloutRequest], done: set[str], stop: asyncio.Event
    ) -> None:
        cc = self.cfg.controller
        todo = [rq for rq in reqs if rq.request_id not in done]
        if cc.mode in ("sync", "cgp"):
            await self._release(step, todo)
        else:
            await self._release_fgd(step, reqs, stop, window=await self.use_window(step), done=done)
        log.info("step %d: %d requests released (%s)", step, len(todo), cc.mode)

    async def _release(self, step: int, reqs: list[RolloutRequest]) -> None:
        if not reqs:
            return
        await self.wait_for_trainer(self.stop)
        if self.stop.is_set():
            return
        now = time.time()
        pipe = self.b.r.pipeline(transaction=True)  # released and recorded together, or neither
        for rq in reqs:
            rq.released_at = now
            pipe.xadd(self.k.requests, {DATA: self.b.encode(rq)}, maxlen=self.b.maxlen, approximate=True)
        pipe.incrby(self.k.released(step), len(reqs))
        pipe.sadd(self.released_ids(step), *(rq.request_id for rq in reqs))
        await pipe.execute()
        metrics.REQUESTS_RELEASED.inc(len(reqs))
        metrics.STEP.labels("controller").set(step)

    async def use_window(self, step: int) -> bool:
        """Hold later groups back only when the trainer, not the rollout, sets the step's end.

        Holding groups back shortens decode steps for the frontier, so training starts sooner, but
        costs engine throughput.  That pays off when training is long next to the rollout:
        training time of the previous step >= ``fgd_window_min_train_ratio`` x the rollout makespan
        of the last step run *without* the window (the window itself stretches the makespan, so
        measuring under it would switch it off again).  With no such step yet the window is off.
        """
        cc = self.cfg.controller
        if cc.fgd_lookahead <= 0:
            return False
        prev = await self.previous_metrics(step - 1)
        if prev is None:
            return False
        if not self.window_on.get(step - 1, False) and prev.rollout_makespan_s > 0:
            self.free_makespan = prev.rollout_makespan_s
        if self.free_makespan is None:
            return False
        ratio = prev.train_busy_s / self.free_makespan
        on = ratio >= cc.fgd_window_min_train_ratio
        self.window_on[step] = on
        log.info(
            "step %d: training/rollout %.2f last step -> frontier window %s",
            step,
            ratio,
            "on" if on else "off",
        )
        return on

    async def previous_metrics(self, step: int) -> StepMetrics | None:
        if step < 0:
            return None
        entries: Any = await self.b.r.xrevrange(self.k.control, count=64)
        for _id, fields in entries or []:
            try:
                ev = self.b.codec.decode((fields or {}).get(DATA, b""))
            except CodecError:
                continue
            if isinstance(ev, StepMetrics) and ev.step == step:
                return ev
        return None

    async def _release_fgd(
        self,
        step: int,
        reqs: list[RolloutRequest],
        stop: asyncio.Event,
        window: bool = True,
        done: set[str] | None = None,
    ) -> None:
        """Admit as capacity frees, frontier groups first.

        The frontier is the groups the trainer needs next.  Groups already under way come first, then
        groups in mini-batch order, and only groups of the next ``fgd_lookahead`` mini-batches
        beyond those already complete are admitted: generating far ahead of the trainer only
        enlarges every engine's decode batch and slows the groups the trainer is waiting for.
        ``fgd_lookahead: 0`` fills all free capacity with later groups.  ``done``: request ids a
        previous controller already released (a restart); their groups count as under way.
        """
        cc = self.cfg.controller
        gpm = cc.prompts_per_step // cc.minibatches
        done = done or set()
        by_group: OrderedDict[str, list[RolloutRequest]] = OrderedDict()
        started: set[str] = set()
        for rq in reqs:
            if rq.request_id in done:
                started.add(rq.group_id)
            else:
                by_group.setdefault(rq.group_id, []).append(rq)
        released = len(reqs) - sum(len(v) for v in by_group.values())
        cap = 0
        cap_checked = 0.0
        while by_group and not stop.is_set():
            now = time.monotonic()
            if now - cap_checked > 0.5 or cap == 0:
                cap = await self.capacity()
                cap_checked = now
            finished = int(await self.b.r.get(self.k.finished(step)) or 0)
            free = (cap or 1) + self.cfg.controller.fgd_slack - (released - finished)
            if free <= 0:
                await wait_event(stop, 0.005)
                continue
            limit = len(reqs)  # groups that may be under way
            if window and cc.fgd_lookahead > 0:
                complete = int(await self.b.r.scard(self.k.emitted(step)))
                limit = (complete // gpm + cc.fgd_lookahead) * gpm
            batch: list[RolloutRequest] = []
            # frontier: groups already under way (finish them first), then groups in mini-batch order
            order = sorted(by_group, key=lambda g: (g not in started, by_group[g][0].minibatch_hint))
            for gid in order:
                if gid not in started and len(started) >= limit:
                    break
                while free > 0 and by_group[gid]:
                    batch.append(by_group[gid].pop(0))
                    started.add(gid)
                    free -= 1
                if not by_group[gid]:
                    del by_group[gid]
                if free <= 0:
                    break
            if not batch:  # the window is closed until more groups complete
                await wait_event(stop, 0.005)
                continue
            await self._release(step, batch)
            released += len(batch)


async def run_controller(cfg: Config, url: str, run: str, stop: asyncio.Event) -> int:
    metrics.serve(cfg.metrics.port, cfg.metrics.host, "controller")
    r = connect(url)
    try:
        return await Controller(cfg, Broker(r, run, "controller", maxlen=cfg.redis.maxlen)).run(stop)
    finally:
        await close_client(r)
