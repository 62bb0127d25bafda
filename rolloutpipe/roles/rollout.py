"""The rollout worker: reads requests (consumer group ``rollout``), generates, publishes samples.

* Admission is pull-based: the worker reads only as many requests as it has free engine slots,
  so the controller's order (FIFO or frontier-first) is the order engines admit.
* A sample is published and its request acknowledged in one MULTI/EXEC, so a request is
  either still pending (and will be redone) or done, never half-done.
* A heartbeat key with a TTL says the worker is alive; the worker also resets the idle time of
  the requests it still works on, so only a dead worker's requests go idle long enough to be
  taken over with XAUTOCLAIM by a live one.
* Weights are switched only to a verified version, and only between steps; requests still
  generating then are finished on the old weights or aborted (``rollout.on_new_version``).
* Long-tail migration (``rollout.migration``): when most of the pool is idle, a worker preempts
  some of its longest-running requests (``scheduling/migration.py`` decides which) and puts each
  back on ``requests`` as a continuation with its partial response (``Broker.migrate``); an idle
  worker resumes it on the same policy version.  While handing back, this worker reads nothing,
  so the continuations go to workers blocked on ``requests``, i.e. idle ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterable

from rolloutpipe import metrics
from rolloutpipe.agents.tools import ToolResult
from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.events import RolloutRequest, Sample
from rolloutpipe.broker.keys import Groups
from rolloutpipe.broker.streams import Broker, Entry
from rolloutpipe.config import Config
from rolloutpipe.engines import Engine, make_engine
from rolloutpipe.engines.base import Generation
from rolloutpipe.engines.episode import Episode, make_agent, run_episode
from rolloutpipe.errors import ConfigError, WeightsFetchError, WeightsVerificationError
from rolloutpipe.model.fetch import make_fetcher
from rolloutpipe.runtime import close_client, wait_event
from rolloutpipe.scheduling import migration
from rolloutpipe.tasks.reward import ScoreInput, Scorer

log = logging.getLogger("rolloutpipe.rollout")
GROUP = Groups.ROLLOUT
DONE_CHECK_S = 0.25  # how often the run loop asks whether the run is done (one EXISTS)


class RolloutWorker:
    def __init__(
        self, cfg: Config, broker: Broker, engine: Engine, worker_id: str, own_engine: bool = True
    ) -> None:
        self.cfg = cfg
        self.own_engine = own_engine  # False: a pool worker's engine, which outlives this run's lease
        self.leaving = False  # ``leave``: take nothing new; stop once nothing is in flight
        self.b = broker
        self.k = broker.keys
        self.engine = engine
        self.id = worker_id
        self.scorer = Scorer(cfg.task)
        self.agent = make_agent(cfg)  # None: single-turn requests
        self.version = -1
        self.inflight: dict[str, asyncio.Task[None]] = {}
        self.inflight_reqs: dict[str, tuple[Entry, RolloutRequest]] = {}
        self.samples = 0
        self._live = 1
        self._live_checked = 0.0
        self.queue_share_of = 0  # of the last request read (see admission_limit)
        self._closed: dict[int, tuple[float, set[str]]] = {}  # step -> (read at, closed group ids)
        self.slot_freed = asyncio.Event()  # set when a request leaves the engine (``run`` waits on it)
        self.fetcher = make_fetcher(cfg.rollout, broker.run)  # None: engines read pv.path (shared storage)
        self.admitted: dict[str, float] = {}  # entry id -> when this worker admitted it (monotonic)
        self.preempting: set[str] = set()  # entry ids preempted and not yet handed back or done
        self.last_move = 0.0  # unix time this worker last preempted a request to hand it back
        self.reading = False  # inside a blocking read of ``requests``
        self.migrations = 0

    async def admission_limit(self) -> int:
        """Requests this worker may hold: engine slots, plus an engine-side queue when the step allows.

        A request says whether the policy released its whole step at once (``queue_share_of``: the
        step's request count); then, like a router that dispatches every request on arrival, each
        engine may take its share of the step into its own queue (``rollout.engine_queue: share``).
        A pool's worker never does (late binding): the requests a run's engines cannot start yet
        stay on ``requests``, where a worker lent to the run mid-rollout finds them at once.

        The share divides by the run's workers: the live ones, and never fewer than
        ``rollout.workers`` (the run's configured count).  Counting only the live ones let the
        first worker up, alone in the registry, take a whole step before its peers' first
        heartbeat.  A configured worker that never comes up loses nothing: its share stays on
        ``requests`` for the others' free slots.
        """
        cap = self.engine.capacity
        rc = self.cfg.rollout
        if self.queue_share_of <= 0 or rc.engine_queue == "none" or rc.pool.name:
            return cap
        now = time.monotonic()
        if now - self._live_checked > 0.5:
            self._live_checked = now
            self._live = max(1, rc.workers, len(await self.b.live_workers()))
        return max(cap, -(-self.queue_share_of // self._live))

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """The heartbeat record (this worker's load) every ``load_report_s``; every ``heartbeat_s``
        also the idle time of its requests reset and the closed groups' requests cancelled."""
        rc = self.cfg.rollout
        ttl = max(1, int(rc.heartbeat_s * 3 + 0.999))
        every, touched = load_report_s(self.cfg), -float("inf")
        while not stop.is_set():
            info = {
                "id": self.id,
                "capacity": self.engine.capacity,
                # the engine's KV cache in tokens, where it reports one (0: unlimited or unknown)
                "kv_tokens": int(getattr(self.engine, "kv_tokens", 0)),
                "inflight": len(self.inflight),
                "version": self.version,
                "samples": self.samples,
                "migrations": self.migrations,
                "pool": self.cfg.rollout.pool.name,  # a shared pool's worker, leased to this run
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "t": time.time(),
            }
            await self.b.heartbeat(self.id, info, ttl)
            if time.monotonic() - touched >= rc.heartbeat_s:
                touched = time.monotonic()
                await self.b.touch(self.k.requests, GROUP, self.id, list(self.inflight))
                await self.abort_closed()
            await wait_event(stop, max(0.0, min(every, touched + rc.heartbeat_s - time.monotonic())))
        await self.b.drop_heartbeat(self.id)

    async def abort_closed(self) -> None:
        """Cancel requests of groups the controller closed or skipped: their samples would be discarded."""
        by_step: dict[int, set[str]] = {}
        for _, req in self.inflight_reqs.values():
            by_step.setdefault(req.step, set()).add(req.group_id)
        closed = {(st, g) for st, gids in by_step.items() for g in await self.closed_groups(st) & gids}
        for eid, (entry, req) in list(self.inflight_reqs.items()):
            task = self.inflight.get(eid)
            if (req.step, req.group_id) not in closed or task is None or task.done():
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if task.cancelled():  # not published in the meantime
                await self.drop(entry, req, f"aborted: group {req.group_id} was closed", "aborted_requests")

    async def closed_groups(self, step: int, max_age_s: float = 0.1) -> set[str]:
        """Groups of ``step`` closed or skipped, read at most every ``max_age_s``.

        A request admitted in that window is cancelled at the next heartbeat, or its sample is
        discarded by the aggregator: late news costs engine time, never correctness.
        """
        t, ids = self._closed.get(step, (0.0, set()))
        if time.monotonic() - t > max_age_s:
            ids = await self.b.closed_groups(step)
            self._closed = {s: v for s, v in self._closed.items() if s >= step - 1}
            self._closed[step] = (time.monotonic(), ids)
        return ids

    async def drop(
        self, entry: Entry, req: RolloutRequest, why: str, counter: str = "fence_rejections"
    ) -> None:
        """A request not to generate (stale, or its group closed): dead-lettered, acknowledged, counted,
        and counted as finished, so the controller sees its engine slot free again."""
        v = req.policy_version
        await self.b.dead_letter(
            entry,
            why,
            step=req.step,
            policy_version=v,
            counter=counter,
            ack_group=GROUP,
            finished=True,
            origin=req.origin,
        )

    async def ensure_version(self, want: int, stop: asyncio.Event) -> bool:
        """Load verified weights of version ``want`` (waiting for them to be published)."""
        while self.version < want and not stop.is_set():
            pv = await self.b.wait_version(want, stop)
            if pv is None:
                break
            if self.inflight:
                await self.retire_old_version(pv.policy_version)
            t0 = time.monotonic()
            try:
                # over HTTP (rollout.weights_url): this host's verified copy; else the trainer's path
                local = pv if self.fetcher is None else await self.fetcher.fetch(pv)
                await self.engine.load_weights(local)
            except WeightsVerificationError as e:
                log.error("refusing policy version %d: %s; staying on %d", pv.policy_version, e, self.version)
                await self.b.incr("weight_rejections")
                await asyncio.sleep(0.5)
                continue
            except WeightsFetchError as e:
                log.warning("cannot fetch policy version %d yet: %s; retrying", pv.policy_version, e)
                await self.b.incr("weight_fetch_errors")
                await asyncio.sleep(1.0)
                continue
            self.version = pv.policy_version
            metrics.WEIGHT_LOAD.observe(time.monotonic() - t0)
            metrics.POLICY_VERSION.labels("rollout").set(self.version)
            log.info("worker %s now on policy version %d", self.id, self.version)
        return self.version >= want

    async def retire_old_version(self, new_version: int) -> None:
        """Before a weight switch: finish or abort (``rollout.on_new_version``) the old version's work.

        Finished samples go out under the version that generated them; aborted requests are
        dead-lettered as stale.  Either way nothing is published under the new version.
        """
        if self.cfg.rollout.on_new_version == "abort":
            aborted = list(self.inflight_reqs.items())
            for task in self.inflight.values():
                task.cancel()  # the engine aborts the request (vLLM: on cancellation)
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            for _, (entry, req) in aborted:
                await self.drop(
                    entry,
                    req,
                    f"stale: aborted when policy version {new_version} was published",
                    "aborted_requests",
                )
            if aborted:
                log.info("aborted %d requests of version %d", len(aborted), self.version)
        else:
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)

    async def handle(self, entry: Entry, req: RolloutRequest) -> None:
        try:
            admitted = time.time()
            if self.leaving:  # read as this worker left its run, never started here: handed back
                await self.hand_back(entry, req, None, admitted)
                return
            ep = None
            if self.agent is not None:  # an episode: its calls recorded under the request's first entry
                record = BrokerCallLog(self.b, req.step, req.origin or entry.id)
                ep = await run_episode(self.engine, req, self.agent, record)
            gen = await self.engine.generate(req) if ep is None else ep.gen
            if self.version != req.policy_version:  # every turn of an episode too: dropped whole
                await self.drop(entry, req, f"weights changed to {self.version} during generation")
                return
            if ep is not None:
                await self.count_tools(ep, req.step)
            if gen.finish_reason == "preempted":
                await self.hand_back(entry, req, gen, admitted, ep)
                return
            score = await self.scorer.score(
                ScoreInput(gen.text, req.answer, req.prompt, req.data_source, req.extra_info)
            )
            if score.outcome != "ok":
                # scored 0 and counted; the response is trained on as a wrong one (never retried)
                log.warning("verifier %s on request %s: %s", score.outcome, req.request_id, score.detail)
                which = "verifier_timeouts" if score.outcome == "timeout" else "verifier_errors"
                await self.b.incr(which, step=req.step)  # the run's total and the step's
            reward = score.reward
            sample = Sample(
                run=req.run,
                step=req.step,
                policy_version=self.version,
                sample_id=req.request_id,
                request_id=req.request_id,
                group_id=req.group_id,
                prompt_index=req.prompt_index,
                sample_index=req.sample_index,
                worker=self.id,
                prompt_ids=gen.prompt_ids,
                response_ids=gen.response_ids,
                logprobs=gen.logprobs,
                reward=reward,
                finish_reason=gen.finish_reason,
                temperature=req.temperature,
                released_at=req.released_at,
                admitted_at=req.admitted_at or admitted,
                finished_at=time.time(),
                segments=req.segment + 1,
                kv_preempted_at=list(gen.kv_preempted_at),
                **(
                    {}
                    if ep is None
                    else {"loss_mask": ep.loss_mask, "turns": ep.turns, "tool_calls": ep.tool_calls}
                ),
            )
            await self.b.publish_sample(sample, entry.id, origin=req.origin)
            self.samples += 1
            metrics.SAMPLES.labels("rollout").inc()
            metrics.GENERATION.observe(sample.finished_at - admitted)
            metrics.STEP.labels("rollout").set(req.step)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Left pending (not acknowledged): after claim_idle_s a live worker reclaims and redoes it,
            # until it has been delivered rollout.max_attempts times: then it is a poison request.
            with contextlib.suppress(Exception):
                await self.b.incr("generation_errors")
            tries = 0
            with contextlib.suppress(Exception):  # unknown: left pending, as before
                tries = await self.b.deliveries(entry, GROUP)
            if tries >= self.cfg.rollout.max_attempts:
                why = f"generation failed on all {tries} attempts: {type(e).__name__}: {e}"
                log.error("request %s: %s; dead-lettered", req.request_id, why)
                await self.drop(entry, req, why, counter="failed_requests")
            else:
                log.exception("request %s failed (attempt %d of %d); left pending for another attempt",
                              req.request_id, tries, self.cfg.rollout.max_attempts)  # fmt: skip
        finally:
            self.inflight.pop(entry.id, None)
            self.inflight_reqs.pop(entry.id, None)
            self.admitted.pop(entry.id, None)
            self.preempting.discard(entry.id)  # handed back, or finished or dropped after all
            self.slot_freed.set()
            metrics.INFLIGHT.set(len(self.inflight))

    async def count_tools(self, ep: Episode, step: int) -> None:
        """An episode's tool failures, by kind, in the run's and the step's stats."""
        kinds = {"tool_errors": sum(r.outcome in ("error", "unknown") for r in ep.results),
                 "tool_timeouts": sum(r.outcome == "timeout" for r in ep.results),
                 "tool_bad_output": sum(r.truncated or r.bad_output for r in ep.results)}  # fmt: skip
        for name, n in kinds.items():
            if n:
                await self.b.incr(name, step=step, by=n)

    async def hand_back(
        self,
        entry: Entry,
        req: RolloutRequest,
        gen: Generation | None,
        admitted: float,
        ep: Episode | None = None,
    ) -> None:
        """A preempted request back on ``requests`` as its continuation (``Broker.migrate``); ``gen``
        None: one that never reached the engine, its continuation with nothing decoded here.  An
        episode's continuation carries its loss mask: the tool results in its prefix stay tools'."""
        cont = req.model_copy(
            update={
                "prefix_ids": req.prefix_ids if gen is None else gen.response_ids,
                "prefix_logprobs": req.prefix_logprobs if gen is None else gen.logprobs,
                "prefix_mask": req.prefix_mask if ep is None else ep.loss_mask,
                "segment": req.segment + 1,
                "origin": req.origin or entry.id,
                "admitted_at": req.admitted_at or admitted,
            }
        )
        for _ in range(int(self.cfg.redis.block_ms / 5) + 2):  # let a blocking read end first
            if not self.reading:
                break
            await asyncio.sleep(0.005)
        new_id = await self.b.migrate(entry.id, cont)
        if new_id:
            self.migrations += 1
            metrics.BROKER_EVENTS.labels("rollout", "migrated_tokens").inc(len(cont.prefix_ids))
            log.info(
                "request %s handed back after %d tokens (segment %d -> %s)",
                req.request_id,
                len(cont.prefix_ids),
                req.segment,
                new_id,
            )

    async def migrate_loop(self, stop: asyncio.Event) -> None:
        """Every ``check_s``: preempt what ``policies/migration.choose`` picks from the pool's load."""
        mc = self.cfg.rollout.migration
        while not stop.is_set():
            await wait_event(stop, mc.check_s)
            if stop.is_set() or not self.inflight or self.preempting:
                continue
            others, stale = [], False
            for w in await self.b.live_workers():
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    if w["id"] != self.id:
                        others.append(migration.Load(str(w["id"]), int(w["capacity"]), int(w["inflight"])))
                        stale |= float(w["t"]) <= self.last_move  # loads from before our last move
            if stale:  # decide again only on loads that show what the last hand-back did
                continue
            now = time.monotonic()
            running = [
                migration.Running(req.request_id, now - self.admitted.get(eid, now), req.segment)
                for eid, (_, req) in self.inflight_reqs.items()
                if eid in self.inflight and not self.inflight[eid].done()
            ]
            me = migration.Load(self.id, self.engine.capacity, len(self.inflight))
            by_request = {req.request_id: eid for eid, (_, req) in self.inflight_reqs.items()}
            if self.preempt_entries(by_request[rid] for rid in migration.choose(me, others, running, mc)):
                self.last_move = time.time()

    def preempt_entries(self, eids: Iterable[str]) -> int:
        """Ask the engine to stop these running requests; each stopped one is handed back by its
        ``handle`` (``hand_back``).  Returns how many the engine stopped."""
        preempt = getattr(self.engine, "preempt", None)
        n = 0
        for eid in eids:
            task, item = self.inflight.get(eid), self.inflight_reqs.get(eid)
            if preempt is None or task is None or item is None or task.done():
                continue  # not running here (finished, or never admitted)
            if preempt(item[1].request_id):
                self.preempting.add(eid)
                n += 1
        return n

    async def leave(self, handback: bool) -> None:
        """Stop serving this run (a pool moved the worker): take nothing new (a request read as it
        leaves goes back unstarted, ``handle``); hand the requests that still wait in the engine's
        queue back to the run first (continuations with nothing decoded: nothing of theirs is lost;
        an engine that says which, ``Queueing``), then either hand the running ones back as
        continuations too (``handback``, which needs an engine that preempts) or let them finish
        here.  ``run`` returns once none is left."""
        self.leaving = True
        self.slot_freed.set()
        is_queued = getattr(self.engine, "queued", None)
        queued = {e for e, (_, req) in self.inflight_reqs.items() if is_queued and is_queued(req.request_id)}
        self.preempt_entries(list(queued))
        if handback:
            self.preempt_entries([e for e in list(self.inflight_reqs) if e not in queued])

    async def admit(self, entry: Entry, stop: asyncio.Event) -> None:
        ev = await self.b.decode_or_dlq(entry, GROUP, (RolloutRequest,))
        if ev is None:
            return
        assert isinstance(ev, RolloutRequest)
        if ev.policy_version > self.version and not await self.ensure_version(ev.policy_version, stop):
            return  # stopping; the entry stays pending and will be reclaimed
        if ev.policy_version < self.version:
            await self.drop(
                entry, ev, f"stale request: policy_version {ev.policy_version} < worker's {self.version}"
            )
            return
        if entry.id in self.inflight:
            return
        if ev.group_id in await self.closed_groups(ev.step):
            await self.drop(
                entry, ev, f"aborted: group {ev.group_id} was closed before admission", "aborted_requests"
            )
            return
        self.queue_share_of = ev.queue_share_of
        self.admitted[entry.id] = time.monotonic()
        self.inflight_reqs[entry.id] = (entry, ev)
        self.inflight[entry.id] = asyncio.create_task(self.handle(entry, ev))
        metrics.INFLIGHT.set(len(self.inflight))

    async def wait_slot_freed(self) -> None:
        """Until a request leaves the engine, or ``DONE_CHECK_S``."""
        self.slot_freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.slot_freed.wait(), DONE_CHECK_S)

    async def run(self, stop: asyncio.Event) -> int:
        rc = self.cfg.rollout
        await self.b.check_shards()
        await self.b.ensure_group(self.k.requests, GROUP)
        if rc.migration.enabled and not callable(getattr(self.engine, "preempt", None)):
            raise ConfigError(
                f"rollout.migration.enabled needs an engine that can preempt a request (emulated, "
                f"transformers, vllm); {type(self.engine).__name__} has no preempt()"
            )
        await self.engine.start()
        hb = asyncio.create_task(self.heartbeat(stop))
        mig = asyncio.create_task(self.migrate_loop(stop)) if rc.migration.enabled else None
        # own pending entries first (a restarted worker with the same id), then new ones
        backlog = await self.b.read(self.k.requests, GROUP, self.id, count=10_000, block_ms=1, start="0")
        last_claim = last_done_check = 0.0
        try:
            while not stop.is_set():
                if self.leaving:
                    if not self.inflight:
                        break
                    await self.wait_slot_freed()
                    continue
                if time.monotonic() - last_done_check > DONE_CHECK_S:
                    last_done_check = time.monotonic()
                    if await self.b.is_done():
                        break
                free = await self.admission_limit() - len(self.inflight)
                if free <= 0:  # full: wake when a request leaves the engine, not by polling Redis
                    await self.wait_slot_freed()
                    continue
                entries: list[Entry] = []
                if backlog:
                    entries, backlog = backlog[:free], backlog[free:]
                elif time.monotonic() - last_claim > rc.claim_idle_s / 2:
                    last_claim = time.monotonic()
                    entries = await self.b.autoclaim(
                        self.k.requests, GROUP, self.id, min_idle_ms=int(rc.claim_idle_s * 1000), count=free
                    )
                    if entries:
                        log.warning("worker %s reclaimed %d abandoned requests", self.id, len(entries))
                        await self.b.incr("reclaimed_requests", by=len(entries))
                if not entries and self.preempting:  # let idle workers take the continuations
                    await asyncio.sleep(0.005)
                    continue
                if not entries:
                    self.reading = True
                    try:
                        entries = await self.b.read(
                            self.k.requests,
                            GROUP,
                            self.id,
                            count=min(free, self.cfg.rollout.read_batch),
                            block_ms=self.cfg.redis.block_ms,
                        )
                    finally:
                        self.reading = False
                for e in entries:
                    await self.admit(e, stop)
        finally:
            stop.set()
            for t in self.inflight.values():
                t.cancel()
            await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            await hb
            if mig is not None:
                await mig
            if self.own_engine:
                await self.engine.close()
            self.scorer.close()
            if self.fetcher is not None:
                await self.fetcher.close()
        return 0


class BrokerCallLog:
    """An episode's calls recorded in ``toolcalls:{k}``, under its request's first entry id."""

    def __init__(self, b: Broker, step: int, origin: str) -> None:
        self.b, self.step, self.origin = b, step, origin

    async def get(self, offset: int) -> list[ToolResult] | None:
        rows = await self.b.tool_results(self.step, f"{self.origin}:{offset}")
        return None if rows is None else [ToolResult(t, o, bool(c), bool(x)) for t, o, c, x in rows]

    async def put(self, offset: int, results: list[ToolResult]) -> None:
        rows = [[r.text, r.outcome, r.truncated, r.bad_output] for r in results]
        await self.b.record_tool_results(self.step, f"{self.origin}:{offset}", rows)


def load_report_s(cfg: Config) -> float:
    """How often a worker publishes its load (its heartbeat record).  With migration on, at least
    as often as a worker looks at its peers' (``migration.check_s``): a worker decides again only
    on loads newer than its last move, and at ``heartbeat_s`` (1 s of wall time, 50 emulated
    seconds at the suite's ``time_scale``) it waited a quarter of a rollout to see one."""
    rc = cfg.rollout
    return min(rc.heartbeat_s, rc.migration.check_s) if rc.migration.enabled else rc.heartbeat_s


def default_worker_id() -> str:
    return os.environ.get("RP_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"


async def run_rollout(cfg: Config, url: str, run: str, stop: asyncio.Event, worker_id: str = "") -> int:
    metrics.serve(cfg.metrics.port, cfg.metrics.host, "rollout")
    r = connect(url)
    try:
        broker = Broker(r, run, "rollout", maxlen=cfg.redis.maxlen, sample_shards=cfg.redis.sample_shards)
        worker = RolloutWorker(cfg, broker, make_engine(cfg), worker_id or default_worker_id())
        return await worker.run(stop)
    finally:
        await close_client(r)
