"""The trainer role: groups in (FIFO), optimizer steps out, new policy version published.

This module wires the role: ``run_trainer`` (backend, metrics port, weights server), the reader
task (groups read promptly, their read time stamped, even while the backend computes), the loop
over steps, the resume from the newest checkpoint and the idempotent end of a commit.  One step,
top to bottom (intake, the schedule, measurement, commit), is ``step.py``; the schedule,
``trainer.schedule``, is chosen here once.

Group entries are acknowledged only after the step's weights are published (the effect is
durable).  A step commits through a checkpoint (``checkpoint.py`` gives the order and why a SIGKILL
at any point neither loses nor repeats a group); a restarted trainer resumes from its newest
checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutpipe import metrics
from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.events import Group, PolicyVersion, StepMetrics, StepPlan, StepSeal
from rolloutpipe.broker.keys import Groups
from rolloutpipe.broker.streams import Broker
from rolloutpipe.config import Config
from rolloutpipe.errors import ConfigError
from rolloutpipe.roles.trainer import checkpoint
from rolloutpipe.roles.trainer.backends import Backend, make_backend
from rolloutpipe.roles.trainer.evaluate import Evaluator
from rolloutpipe.roles.trainer.loggers import StepLogger
from rolloutpipe.roles.trainer.step import SCHEDULES, Read, train_step
from rolloutpipe.runtime import close_client, end_tasks

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rolloutpipe.trainer")
GROUP = Groups.TRAINER
PENDING_SWEEP_S = 2.0  # how often the reader re-reads its own pending entries


class Trainer:
    def __init__(self, cfg: Config, broker: Broker, backend: Backend, out: Path) -> None:
        self.cfg = cfg
        self.b = broker
        self.k = broker.keys
        self.backend = backend
        self.schedule = SCHEDULES[cfg.trainer.schedule]  # pipelined (CGP) or barrier
        self.out = out
        self.weights_root = out / "weights"
        self.queue: asyncio.Queue[Read] = asyncio.Queue(maxsize=cfg.trainer.read_ahead_groups)
        self.queued_ids: set[str] = set()  # group entries handed to train_step (this process)
        self.commits = 0  # commits whose entries left ``queued_ids``: a sweep spanning one is void
        self.ckpt_root = out / "checkpoints" / broker.run
        self.logs = [out / "metrics.jsonl"]  # appended at each commit; truncated back on resume
        if cfg.trainer.record_groups:
            self.logs.append(out / "groups.msgpack")
        if cfg.trainer.record_timeline:
            self.logs.append(out / "timeline.jsonl")
        self.logger = StepLogger(cfg, out) if cfg.trainer.log_to else None
        self.evaluator: Evaluator | None = None
        if cfg.eval.every:
            if getattr(backend, "model", None) is None:
                raise ConfigError(f"eval.every needs the torch trainer backend, not {cfg.trainer.backend!r}")
            self.evaluator = Evaluator(cfg)

    async def _reader(self, stop: asyncio.Event) -> None:
        """Read groups promptly (stamping read time) even while the backend computes."""
        consumer = "trainer-0"
        backlog = await self.b.read(self.k.groups, GROUP, consumer, count=10_000, block_ms=1, start="0")
        last_sweep = time.monotonic()
        while not stop.is_set():
            if not backlog and time.monotonic() - last_sweep > PENDING_SWEEP_S:
                # Entries delivered to us whose reply was lost (a connection dropped mid-read, a
                # Redis restart) sit pending without our having seen them: pick them up again.
                last_sweep = time.monotonic()
                commits = self.commits
                ids = await self.b.pending_ids(self.k.groups, GROUP, consumer)  # ids only: cheap
                unseen = [i for i in ids if i not in self.queued_ids]
                mine = (
                    await self.b.read(self.k.groups, GROUP, consumer, count=10_000, block_ms=1, start="0")
                    if unseen
                    else []
                )
                # A commit that acknowledged entries while this read's reply was on its way took them
                # out of ``queued_ids`` although the reply still lists them as pending: trained groups
                # would come back as "never seen" and hit the fence.  Drop such a sweep; the next
                # one reads the pending list as it is after the commit.
                backlog = [e for e in mine if e.id not in self.queued_ids] if commits == self.commits else []
                if backlog:
                    log.warning("picked up %d pending groups never seen (a lost read reply)", len(backlog))
            entries = backlog or await self.b.read(
                self.k.groups, GROUP, consumer, count=16, block_ms=self.cfg.redis.block_ms
            )
            backlog = []
            for e in entries:
                if e.id in self.queued_ids:
                    continue
                self.queued_ids.add(e.id)
                now = time.time()
                ev = await self.b.decode_or_dlq(e, GROUP, (Group, StepSeal))
                if ev is None:
                    continue
                assert isinstance(ev, Group | StepSeal)
                await self.queue.put(Read(e, ev, now))

    async def publish(self, version: int, m: StepMetrics | None = None) -> PolicyVersion:
        """Weights of ``version``, then one MULTI: the previous step's metrics, the version key and event.

        Metrics go out before the new version, so the controller can read the step's timings
        before it plans the next one (the FGD window uses them).
        """
        pv = await asyncio.to_thread(self.backend.publish, self.weights_root, self.b.run, version)
        await self.b.publish_version(pv, m)
        log.info("published policy version %d", version)
        return pv

    async def train_step(self, step: int, plan: StepPlan, stop: asyncio.Event) -> StepMetrics | None:
        """One step (``step.py``); None when stopped before the step has all its groups."""
        return await train_step(self, step, plan, stop)

    # ------------------------------------------------------------------------------ commit / resume

    def save_checkpoint(self, step: int, record: dict[str, Any], initial: bool = False) -> None:
        tensors: dict[str, dict[str, torch.Tensor]] | None = None
        meta: dict[str, Any] = {}
        if not initial and isinstance(self.backend, checkpoint.Checkpointable):
            tensors, meta = self.backend.checkpoint_state()
        checkpoint.save(
            self.ckpt_root,
            step,
            {**record, "backend": meta, "initial": initial},
            tensors,
            keep=self.cfg.trainer.keep_checkpoints,
        )

    async def finish_commit(
        self, step: int, m: StepMetrics | None, consumed: list[str], entry_ids: list[str]
    ) -> None:
        """Steps 3-4 of a commit; idempotent, so a resumed trainer can redo them."""
        if await self.b.version_number() <= step:
            await self.publish(step + 1, m)
        await self.b.commit_consumed(step, consumed, entry_ids)
        self.queued_ids.difference_update(entry_ids)  # acknowledged: never pending again
        self.commits += 1

    async def resume(self) -> int:
        """Reconcile the newest checkpoint with the published version; returns the step to train."""
        pv = await self.b.version()
        ck = await asyncio.to_thread(checkpoint.latest, self.ckpt_root)
        if pv is None:  # a fresh run (stale checkpoints of an earlier run in this OUT are dropped)
            if ck is not None and ck.step > 0:
                log.warning("no published version in Redis: starting afresh, dropping %s", ck.path)
                ck = None
            if ck is None:
                await asyncio.to_thread(checkpoint.clear, self.ckpt_root)
                await asyncio.to_thread(
                    self.save_checkpoint, 0, {"logs": checkpoint.log_sizes(self.logs)}, True
                )
            await self.publish(0)
            return 0
        v = pv.policy_version
        if ck is None:
            if v > 0:
                raise checkpoint.CheckpointError(
                    f"policy version {v} is published but {self.ckpt_root} holds no checkpoint to resume from"
                )
            await asyncio.to_thread(self.save_checkpoint, 0, {"logs": checkpoint.log_sizes(self.logs)}, True)
            return 0
        if ck.step not in (v, v + 1):
            raise checkpoint.CheckpointError(
                f"checkpoint {ck.path} (step {ck.step}) does not match version {v}"
            )
        await asyncio.to_thread(checkpoint.truncate_logs, self.out, ck.state.get("logs", {}))
        if not ck.initial:
            if isinstance(self.backend, checkpoint.Checkpointable):
                tensors = await asyncio.to_thread(ck.tensors)
                await asyncio.to_thread(
                    self.backend.load_checkpoint_state, tensors, ck.state.get("backend", {})
                )
            else:
                log.warning("backend %s has no checkpoint support: resuming step %d from its initial state",
                            type(self.backend).__name__, ck.step)  # fmt: skip
        c = ck.state.get("commit")
        if c is not None:  # redo steps 3-4 of the last commit (publishes only if c == v + 1)
            raw = ck.state.get("metrics")
            m = StepMetrics.model_validate(raw) if raw is not None else None
            await self.finish_commit(int(c["step"]), m, list(c["groups"]), list(c["entries"]))
        log.info("resumed from checkpoint %s: step %d (published version was %d)", ck.path.name, ck.step, v)
        return ck.step

    async def run(self, stop: asyncio.Event) -> int:
        await self.b.ensure_group(self.k.groups, GROUP)
        self.out.mkdir(parents=True, exist_ok=True)
        version = await self.resume()
        reader = asyncio.create_task(self._reader(stop))
        try:
            step = version
            while (plan := await self.b.wait_plan(step, stop)) is not None:
                m = await self.train_step(step, plan, stop)
                if m is None:
                    break
                log.info(
                    "step %d: reward %.3f, %.2fs rollout-to-train-end, wait ratio %.2f",
                    step,
                    m.reward_mean,
                    m.rollout_to_train_end_s,
                    m.trainer_wait_ratio,
                )
                step += 1
        finally:
            await end_tasks(stop, reader)
            if self.logger is not None:
                self.logger.close()
        return 0


async def run_trainer(cfg: Config, url: str, run: str, out: Path, stop: asyncio.Event) -> int:
    if cfg.trainer.backend != "emulated":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if cfg.trainer.backend == "deepspeed":
        from rolloutpipe.roles.trainer import ds_backend

        if ds_backend.rank() > 0:  # only rank 0 talks to Redis; the others follow its calls
            return await ds_backend.run_follower(cfg, stop)
    metrics.serve(cfg.metrics.port, cfg.metrics.host, "trainer")  # rank 0 only: one port
    r = connect(url)
    try:
        broker = Broker(r, run, "trainer", maxlen=cfg.redis.maxlen)
        backend = await asyncio.to_thread(make_backend, cfg)
        server = None
        try:
            trainer = Trainer(cfg, broker, backend, out)
            if cfg.trainer.weights_serve:  # workers without this filesystem fetch from here
                from rolloutpipe.roles.trainer.weights_http import serve_weights

                server = await serve_weights(trainer.weights_root, cfg.trainer.weights_serve)
            return await trainer.run(stop)
        finally:
            if server is not None:
                await server.close()
            if (close := getattr(backend, "close", None)) is not None:  # deepspeed: release followers
                await asyncio.to_thread(close)
    finally:
        await close_client(r)
