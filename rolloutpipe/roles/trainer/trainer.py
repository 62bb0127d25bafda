"""The trainer role: groups in (FIFO), optimizer steps out, new policy version published.

``trainer.schedule: pipelined`` (CGP): forward+backward per group as groups arrive; an optimizer
step at each mini-batch boundary; mini-batch j is the j-th run of ``groups_per_minibatch`` groups in
arrival order, and a last, shorter mini-batch takes what is left.  ``barrier`` (slime's loop): the
same computation, started only once the step's last group has arrived.  The step has the plan's
groups, or, when the policy may skip or add groups, the number its ``StepSeal`` gives.

The fence is enforced here, where groups are consumed.  Group entries are acknowledged only after
the step's weights are published (the effect is durable).  A step commits through a checkpoint
(``checkpoint.py`` gives the order and why a SIGKILL at any point neither loses nor repeats a
group); a restarted trainer resumes from its newest checkpoint.  Every time below is observed: sample
admission and completion stamped by workers, group reads and compute stamped here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rolloutpipe import metrics
from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.events import Group, PolicyVersion, StepMetrics, StepPlan, StepSeal
from rolloutpipe.broker.keys import Groups
from rolloutpipe.broker.streams import Broker, Entry
from rolloutpipe.config import Config, mode_label
from rolloutpipe.errors import ConfigError, StaleVersionError
from rolloutpipe.roles.trainer import checkpoint
from rolloutpipe.roles.trainer.backends import Backend, make_backend
from rolloutpipe.roles.trainer.evaluate import Evaluator
from rolloutpipe.roles.trainer.fence import VersionFence
from rolloutpipe.roles.trainer.loggers import StepLogger
from rolloutpipe.runtime import close_client, end_tasks, queue_get

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rolloutpipe.trainer")
GROUP = Groups.TRAINER
PENDING_SWEEP_S = 2.0  # how often the reader re-reads its own pending entries


@dataclass
class _Read:
    entry: Entry
    event: Group | StepSeal
    read_at: float


@dataclass
class StepClock:
    """Observed timings of one step."""

    busy: float = 0.0
    mb_busy: float = 0.0
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
    train_stats: list[dict[str, float]] = field(default_factory=list)  # one per optimizer step

    def observe(self, g: Group, read_at: float) -> None:
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
                    [s.worker, s.admitted_at, s.finished_at, len(s.prompt_ids), len(s.response_ids)]
                    for s in g.samples
                ],
            }
        )
        self.rewards.extend(s.reward for s in g.samples)
        self.samples += len(g.samples)
        self.tokens += sum(len(s.response_ids) for s in g.samples)


class Trainer:
    def __init__(self, cfg: Config, broker: Broker, backend: Backend, out: Path) -> None:
        self.cfg = cfg
        self.b = broker
        self.k = broker.keys
        self.backend = backend
        self.out = out
        self.weights_root = out / "weights"
        self.queue: asyncio.Queue[_Read] = asyncio.Queue(maxsize=cfg.trainer.read_ahead_groups)
        self.queued_ids: set[str] = set()  # group entries handed to train_step (this process)
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
                mine = await self.b.read(self.k.groups, GROUP, consumer, count=10_000, block_ms=1, start="0")
                backlog = [e for e in mine if e.id not in self.queued_ids]
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
                await self.queue.put(_Read(e, ev, now))

    async def publish(self, version: int, m: StepMetrics | None = None) -> PolicyVersion:
        """Weights of ``version``, then one MULTI: the previous step's metrics, the version key and event.

        Metrics go out before the new version, so the controller can read the step's timings
        before it plans the next one (the FGD window uses them).
        """
        pv = await asyncio.to_thread(self.backend.publish, self.weights_root, self.b.run, version)
        await self.b.publish_version(pv, m)
        log.info("published policy version %d", version)
        return pv

    async def train_minibatch(self, groups: list[Group], clock: StepClock) -> dict[str, float]:
        t0 = time.time()
        tg = t0
        for g in groups:
            tg = time.time()
            await asyncio.to_thread(self.backend.accumulate, g)
        stats = await asyncio.to_thread(self.backend.optimizer_step)
        clock.train_stats.append(stats)
        clock.last_group = time.time() - tg
        dt = time.time() - t0
        clock.busy_intervals.append((t0, t0 + dt))
        clock.busy += dt
        clock.last_mb = dt
        return stats

    async def close_minibatch(
        self, groups: list[Group], clock: StepClock, last_group_t0: float, minibatches: list[list[str]]
    ) -> None:
        """The optimizer step at a mini-batch boundary of the pipelined schedule."""
        t0 = time.time()
        clock.train_stats.append(await asyncio.to_thread(self.backend.optimizer_step))
        clock.mb_busy += time.time() - t0
        clock.busy_intervals.append((t0, time.time()))
        clock.last_group = time.time() - last_group_t0
        clock.busy += clock.mb_busy
        clock.last_mb, clock.mb_busy = clock.mb_busy, 0.0
        minibatches.append([x.group_id for x in groups])

    async def train_step(self, step: int, plan: StepPlan, stop: asyncio.Event) -> StepMetrics | None:
        fence = VersionFence(step)
        await asyncio.to_thread(self.backend.begin_step, step)
        gpm = plan.groups_per_minibatch
        pipelined = self.cfg.trainer.schedule == "pipelined"
        total: int | None = plan.n_groups if plan.sealed else None  # else the seal says
        clock = StepClock()
        consumed: list[str] = []
        trained: list[bytes] = []  # encoded groups for OUT/groups.msgpack, written at the commit
        entry_ids: list[str] = []
        pending: list[Group] = []
        minibatches: list[list[str]] = []
        seen = await self.b.consumed(step)
        while total is None or len(consumed) < total:
            if stop.is_set():
                return None
            item = await queue_get(self.queue, 0.1)
            if item is None:
                continue
            if isinstance(item.event, StepSeal):
                seal = item.event
                why = ""
                if seal.step < step:  # a controller restarted after sealing seals its step again
                    log.info("seal of step %d again (a restarted controller): acknowledged", seal.step)
                    await self.b.incr("duplicate_seals", step=seal.step)
                    await self.b.ack(self.k.groups, GROUP, item.entry.id)
                    continue
                if seal.step > step:
                    why = f"seal of step {seal.step} during step {step}"
                elif plan.sealed:
                    why = f"seal of step {step}, whose plan was sealed with {plan.n_groups} groups"
                elif seal.n_groups < len(consumed):
                    why = f"seal of step {step} for {seal.n_groups} groups; {len(consumed)} already trained"
                if why:
                    await self.b.dead_letter(item.entry, why, step=step, policy_version=seal.policy_version,
                                             counter="rejected_seals", ack_group=GROUP)  # fmt: skip
                    continue
                entry_ids.append(item.entry.id)  # acknowledged with the step's groups
                total = seal.n_groups
                continue
            g = item.event
            try:
                fence.check(g)
            except StaleVersionError as e:
                await self.b.dead_letter(
                    item.entry,
                    f"fence: {e}",
                    step=step,
                    policy_version=g.policy_version,
                    counter="fence_rejections",
                    ack_group=GROUP,
                )
                continue
            if g.group_id in seen:
                log.warning("group %s already consumed; acknowledging the duplicate", g.group_id)
                await self.b.incr("duplicate_groups", step=step)
                await self.b.ack(self.k.groups, GROUP, item.entry.id)
                continue
            seen.add(g.group_id)
            consumed.append(g.group_id)
            metrics.GROUPS.labels("trainer").inc()
            metrics.GROUP_DISPATCH.observe(max(0.0, item.read_at - max(s.finished_at for s in g.samples)))
            entry_ids.append(item.entry.id)
            clock.observe(g, item.read_at)
            if self.cfg.trainer.record_groups:
                trained.append(self.b.encode(g))
            pending.append(g)
            if pipelined:  # CGP: train each group as it arrives, step at the boundary
                tg = time.time()
                await asyncio.to_thread(self.backend.accumulate, g)
                clock.mb_busy += time.time() - tg
                clock.busy_intervals.append((tg, time.time()))
                if len(pending) == gpm or len(consumed) == total:  # a boundary, or the step's last group
                    await self.close_minibatch(pending, clock, tg, minibatches)
                    pending = []
        if pipelined and pending:  # the seal came after the last group: its mini-batch is shorter
            await self.close_minibatch(pending, clock, time.time(), minibatches)
            pending = []
        if not pipelined:
            for i in range(0, len(pending), gpm):
                mb = pending[i : i + gpm]
                await self.train_minibatch(mb, clock)
                minibatches.append([x.group_id for x in mb])
            pending = []
        train_end = time.time()
        eval_reward: float | None = None
        if self.evaluator is not None and self.evaluator.due(step):  # version k+1, before it is published
            eval_reward = await asyncio.to_thread(self.evaluator, getattr(self.backend, "model"))  # noqa: B009
        eval_s = time.time() - train_end
        timeline: dict[str, Any] = {
            "step": step,
            "mode": mode_label(self.cfg.trainer.schedule, plan.policy),
            "step_start": clock.step_start,
            "train_end": train_end,
            "busy": clock.busy_intervals,
            "groups": clock.groups,
        }
        if not consumed:  # every group skipped: the step is its plan's age, with nothing trained
            clock.step_start = clock.first_read = clock.rollout_end = min(plan.created_at, train_end)
        window = max(train_end - clock.step_start, 1e-9)
        lat = np.asarray(clock.latencies or [0.0])
        m = StepMetrics(
            run=self.b.run,
            step=step,
            policy_version=step,
            mode=mode_label(self.cfg.trainer.schedule, plan.policy),
            rollout_to_train_end_s=window,
            trainer_wait_ratio=max(0.0, window - clock.busy) / window,
            first_group_s=clock.first_read - clock.step_start,
            reward_mean=float(np.mean(clock.rewards)) if clock.rewards else 0.0,
            groups=len(consumed),
            samples=clock.samples,
            tokens=clock.tokens,
            fence_rejections=await self.b.stat("fence_rejections", step),
            dead_letters=await self.b.stat("dead_letters", step),
            groups_skipped=await self.b.stat("groups_skipped", step),
            verifier_errors=await self.b.stat("verifier_errors", step),
            verifier_timeouts=await self.b.stat("verifier_timeouts", step),
            samples_wasted=max(0, await self.b.released_count(step) - clock.samples),
            train_busy_s=clock.busy,
            rollout_makespan_s=clock.rollout_end - clock.step_start,
            last_minibatch_train_s=clock.last_mb,
            last_group_train_s=clock.last_group,
            dispatch_latency_p50_s=float(np.percentile(lat, 50)),
            dispatch_latency_p99_s=float(np.percentile(lat, 99)),
            admission_latency_p50_s=float(np.percentile(clock.admission or [0.0], 50)),
            minibatches=minibatches,
            step_start=clock.step_start,
            train_end=train_end,
            eval_reward=eval_reward,
            eval_s=eval_s if eval_reward is not None else 0.0,
            train={
                k: float(np.mean([st[k] for st in clock.train_stats if k in st]))
                for k in sorted({k for st in clock.train_stats for k in st})
            },
        )
        await self.commit(step, m, consumed, entry_ids, trained, timeline)
        if self.logger is not None:
            self.logger.log(m)
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
        return m

    # ------------------------------------------------------------------------------ commit / resume

    async def commit(
        self,
        step: int,
        m: StepMetrics,
        consumed: list[str],
        entry_ids: list[str],
        trained: list[bytes],
        timeline: dict[str, Any],
    ) -> None:
        """Logs, checkpoint k+1 (the commit point), version k+1 + metrics, then ``consumed:k`` + acks."""
        row = json.dumps(m.model_dump(mode="json", exclude={"kind", "schema_version"})) + "\n"
        appends: dict[Path, bytes] = {self.out / "metrics.jsonl": row.encode()}
        if self.cfg.trainer.record_groups:
            appends[self.out / "groups.msgpack"] = b"".join(trained)
        if self.cfg.trainer.record_timeline:
            appends[self.out / "timeline.jsonl"] = (json.dumps(timeline) + "\n").encode()
        offsets = await asyncio.to_thread(_append_all, appends, self.logs)
        record = {
            "commit": {"step": step, "groups": consumed, "entries": entry_ids},
            "metrics": m.model_dump(mode="json"),
            "logs": offsets,
        }
        await asyncio.to_thread(self.save_checkpoint, step + 1, record)
        await self.finish_commit(step, m, consumed, entry_ids)

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
                await asyncio.to_thread(self.save_checkpoint, 0, {"logs": _sizes(self.logs)}, True)
            await self.publish(0)
            return 0
        v = pv.policy_version
        if ck is None:
            if v > 0:
                raise checkpoint.CheckpointError(
                    f"policy version {v} is published but {self.ckpt_root} holds no checkpoint to resume from"
                )
            await asyncio.to_thread(self.save_checkpoint, 0, {"logs": _sizes(self.logs)}, True)
            return 0
        if ck.step not in (v, v + 1):
            raise checkpoint.CheckpointError(
                f"checkpoint {ck.path} (step {ck.step}) does not match version {v}"
            )
        await asyncio.to_thread(_truncate_logs, self.out, ck.state.get("logs", {}))
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


def _append_all(appends: dict[Path, bytes], logs: list[Path]) -> dict[str, int]:
    """Append each file's bytes and fsync; the sizes of every log afterwards (the commit's offsets)."""
    for path, data in appends.items():
        with path.open("ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return _sizes(logs)


def _sizes(logs: list[Path]) -> dict[str, int]:
    return {p.name: p.stat().st_size if p.exists() else 0 for p in logs}


def _truncate_logs(out: Path, offsets: dict[str, int]) -> None:
    """Drop whatever an uncommitted step appended after the checkpoint's offsets."""
    for name, size in offsets.items():
        p = out / name
        if p.exists() and p.stat().st_size > size:
            log.info("truncating %s to %d bytes (uncommitted step)", p.name, size)
            os.truncate(p, size)


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
