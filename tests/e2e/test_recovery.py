"""Recovery of the trainer and the controller after a crash at each point of their commits.

a) the torch backend resumed from a checkpoint continues exactly like an uninterrupted run
   (weights and AdamW state bit-identical), from safetensors + JSON only;
b) a corrupted checkpoint is skipped (sha256 manifest) and only ``keep_checkpoints`` are kept;
c) a trainer "killed" before, inside and after its step commit, then restarted: every group trained
   and logged exactly once, every version and metrics event published once, nothing left pending;
d) a controller killed in the middle of an incremental (FGD) release releases exactly the rest;
e) a real torch trainer process SIGKILLed mid-step ends where uninterrupted training would.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from rolloutpipe.broker.codec import iter_events
from rolloutpipe.broker.events import (
    AllocationRecord,
    FrontierStatus,
    Group,
    GroupPlan,
    PolicyVersion,
    RolloutRequest,
    Sample,
    StepMetrics,
    StepPlan,
)
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.broker.streams import Broker
from rolloutpipe.config import Config
from rolloutpipe.roles.controller import Controller
from rolloutpipe.roles.trainer import checkpoint
from rolloutpipe.roles.trainer.backends import EmulatedBackend
from rolloutpipe.roles.trainer.trainer import Trainer
from tests.support.cluster import Driver, start_cluster, stop_cluster
from tests.support.config import EMULATED_FAST, make_config
from tests.support.helpers import load_weights, max_abs_diff, version

B, G = 4, 2  # groups per step, samples per group


def make_group(run: str, step: int, g: int, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed * 1000 + step * 10 + g)
    now = time.time()
    samples = []
    for s in range(G):
        n = 3 + s
        samples.append(
            Sample(
                run=run,
                step=step,
                policy_version=step,
                sample_id=f"{step}:{g}:{s}",
                request_id=f"{step}:{g}:{s}",
                group_id=f"{step}:{g}",
                prompt_index=g,
                sample_index=s,
                worker="test",
                prompt_ids=rng.integers(1, 12, 4).astype(np.int32),
                response_ids=rng.integers(1, 12, n).astype(np.int32),
                logprobs=np.full(n, -2.0, np.float32),
                reward=float(s % 2),
                admitted_at=now,
                finished_at=now,
            )
        )
    return Group(
        run=run, step=step, policy_version=step, group_id=f"{step}:{g}", prompt_index=g, samples=samples,
        advantages=np.asarray([1.0 if s % 2 else -1.0 for s in range(G)], np.float32), completed_at=now,
        frontier=FrontierStatus(minibatch=g // 2, position=g, minibatch_size=2, needed=0, total_groups=B),
        allocation=AllocationRecord(initial=G, counts=[G]),
    )  # fmt: skip


# ------------------------------------------------------------------- a) torch resume is exact


def _train_step(be: Any, step: int, groups: list[Group]) -> None:
    be.begin_step(step)
    for i in range(0, len(groups), 2):
        for g in groups[i : i + 2]:
            be.accumulate(g)
        be.optimizer_step()


def test_torch_resume_equals_uninterrupted_run(tmp_path: Path, run_name: str, model_cache: str) -> None:
    """Catches: resuming from the initial weights, a fresh optimizer (AdamW moments/step lost), a
    checkpoint of the wrong moment; and any pickle in the checkpoint."""
    import torch

    from rolloutpipe.roles.trainer.backends import TorchBackend

    cfg = make_config(tmp_path, run_name, f"model.cache_dir={model_cache}", "trainer.lr=0.01")
    steps = [[make_group(run_name, s, g) for g in range(B)] for s in range(3)]
    root = tmp_path / "ckpt"

    a = TorchBackend(cfg)  # uninterrupted: steps 0, 1, 2 (checkpoint after step 0 on the way)
    _train_step(a, 0, steps[0])
    tensors, meta = a.checkpoint_state()
    checkpoint.save(root, 1, {"backend": meta}, tensors)
    for s in (1, 2):
        _train_step(a, s, steps[s])

    b = TorchBackend(cfg)  # "restarted": fresh process state, then the checkpoint
    ck = checkpoint.latest(root)
    assert ck is not None and ck.step == 1
    assert sorted(p.name for p in ck.path.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    b.load_checkpoint_state(ck.tensors(), ck.state["backend"])
    for s in (1, 2):
        _train_step(b, s, steps[s])

    fresh = TorchBackend(cfg)  # what the trainer did before: initial weights, fresh AdamW
    for s in (1, 2):
        _train_step(fresh, s, steps[s])

    wa, wb, wf = a.state_dict(), b.state_dict(), fresh.state_dict()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) == 0.0
    assert max(float((wa[k] - wf[k]).abs().max()) for k in wa) > 1e-4  # the checkpoint mattered
    oa, ob = a.opt.state_dict(), b.opt.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for i, st in oa["state"].items():
        for name, v in st.items():
            assert torch.equal(v, ob["state"][i][name]), (i, name)
    assert float(oa["state"][0]["step"]) == 6  # 3 steps x 2 mini-batches


# ------------------------------------------------------- b) verification and retention


def test_corrupted_checkpoint_is_skipped_and_old_ones_pruned(tmp_path: Path) -> None:
    import torch

    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        checkpoint.save(root, step, {"x": step}, {"model": {"w": torch.full((3,), float(step))}}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000002", "ckpt-000003"]
    ck = checkpoint.latest(root)
    assert ck is not None and ck.step == 3 and ck.state["x"] == 3
    f = root / "ckpt-000003" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match="sha256"):
        checkpoint.verify(root / "ckpt-000003")
    ck = checkpoint.latest(root)
    assert ck is not None and ck.step == 2
    assert float(ck.tensors()["model"]["w"][0]) == 2.0


# ------------------------------------------- c) trainer crash before / inside / after the commit


class Crash(Exception):
    """Stands for a SIGKILL at one point of the commit."""


def _trainer_cfg(tmp_path: Path, run: str) -> Config:
    return make_config(
        tmp_path, run, *EMULATED_FAST, f"controller.prompts_per_step={B}", f"controller.group_size={G}",
        "controller.minibatches=2", "controller.steps=2", "controller.mode=cgp", "trainer.record_groups=true",
    )  # fmt: skip


async def _setup_step(broker: Broker, cfg: Config, step: int) -> None:
    plan = StepPlan(run=broker.run, step=step, policy_version=step, policy="fifo",
                    groups=[GroupPlan(group_id=f"{step}:{g}", prompt_index=g, n=G) for g in range(B)],
                    minibatches=2, groups_per_minibatch=B // 2, created_at=time.time())  # fmt: skip
    await broker.r.set(broker.keys.plan(step), broker.encode(plan))
    for g in range(B):
        await broker.r.xadd(broker.keys.groups, {DATA: broker.encode(make_group(broker.run, step, g))})


async def _version(broker: Broker) -> int:
    pv = await broker.get_event(broker.keys.version, PolicyVersion)
    return -1 if pv is None else pv.policy_version


async def _wait_version(broker: Broker, v: int, task: asyncio.Task[int] | None = None) -> None:
    deadline = time.monotonic() + 10
    while await _version(broker) < v:
        if task is not None and task.done():
            task.result()
            raise AssertionError("trainer ended early")
        assert time.monotonic() < deadline, f"version {v} never published"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("point", ["before-checkpoint", "after-checkpoint", "after-publish"])
async def test_trainer_crash_at_each_commit_point(
    tmp_path: Path, run_name: str, broker: Broker, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: a group of an uncommitted step lost (or trained twice) in the redo, a committed
    step's groups trained again, a version or metrics event published twice or never, log lines of
    an uncommitted step left in groups.msgpack / metrics.jsonl, entries left pending."""
    cfg = _trainer_cfg(tmp_path, run_name)
    out = Path(cfg.out)
    keys = broker.keys
    await _setup_step(broker, cfg, 0)

    orig_save, orig_finish = Trainer.save_checkpoint, Trainer.finish_commit

    def save(self: Trainer, step: int, record: dict[str, Any], initial: bool = False) -> None:
        if point == "before-checkpoint" and step == 1:
            raise Crash(point)
        orig_save(self, step, record, initial)

    async def finish(
        self: Trainer, step: int, m: StepMetrics | None, consumed: list[str], ids: list[str]
    ) -> None:
        if point == "after-publish":
            await self.publish(step + 1, m)
        raise Crash(point)

    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    if point != "before-checkpoint":
        monkeypatch.setattr(Trainer, "finish_commit", finish)
    with pytest.raises(Crash):
        await asyncio.wait_for(Trainer(cfg, broker, EmulatedBackend(cfg), out).run(asyncio.Event()), 20)
    monkeypatch.setattr(Trainer, "save_checkpoint", orig_save)
    monkeypatch.setattr(Trainer, "finish_commit", orig_finish)

    # the state the "kill" left: step 0 trained and logged, its groups still pending, not consumed
    assert await _version(broker) == (1 if point == "after-publish" else 0)
    assert int((await broker.r.xpending(keys.groups, "trainer"))["pending"]) == B
    assert await broker.r.scard(keys.consumed(0)) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # appended before the commit point

    stop = asyncio.Event()
    task = asyncio.create_task(Trainer(cfg, broker, EmulatedBackend(cfg), out).run(stop))
    try:
        await _wait_version(broker, 1, task)
        await _setup_step(broker, cfg, 1)
        await _wait_version(broker, 2, task)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0

    logged = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
    assert [(g.step, g.group_id) for g in logged if g.step == 0] != []
    assert Counter(g.group_id for g in logged) == {f"{s}:{g}": 1 for s in range(2) for g in range(B)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    control: Any = await broker.r.xrange(keys.control)
    events = [broker.codec.decode(f[DATA]) for _e, f in control]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [0, 1]
    assert [e.policy_version for e in events if isinstance(e, PolicyVersion)] == [0, 1, 2]
    for s in range(2):
        members: Any = await broker.r.smembers(keys.consumed(s))
        assert {m.decode() for m in members} == {f"{s}:{g}" for g in range(B)}
    assert int((await broker.r.xpending(keys.groups, "trainer"))["pending"]) == 0
    assert await broker.r.xlen(keys.dlq) == 0
    assert int(await broker.r.hget(keys.stats, "duplicate_groups") or 0) == 0


# ----------------------------------------------- d) controller killed mid-FGD release


async def test_controller_killed_mid_fgd_release_releases_exactly_the_rest(
    tmp_path: Path, run_name: str, broker: Broker
) -> None:
    """Catches: a restarted controller re-releasing the whole step (duplicate requests), or
    skipping it because ``plan:k`` exists (the unreleased requests never generated)."""
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST, "controller.mode=cgp-fgd", "controller.fgd_slack=3")
    n = cfg.controller.prompts_per_step * cfg.controller.group_size
    keys = broker.keys

    async def released() -> list[str]:
        entries: Any = await broker.r.xrange(keys.requests)
        return [broker.codec.decode_as(f[DATA], RolloutRequest).request_id for _e, f in entries]

    # no worker capacity and nothing finished: FGD releases 1 + slack requests, then waits
    stop_first = asyncio.Event()
    first = asyncio.create_task(Controller(cfg, broker).release_step(0, stop_first))
    deadline = time.monotonic() + 10
    while len(await released()) < 4:
        assert time.monotonic() < deadline and not first.done()
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    # The "kill", between two release batches (each batch is one MULTI, so a SIGKILL leaves the same
    # state).  Stopped through its stop event, not Task.cancel(): on Python 3.11 a cancel that
    # races with a timeout inside the Redis client can be swallowed, and the task would go on.
    # Real SIGKILLs of the controller at random moments are in tests/e2e/test_chaos.py.
    stop_first.set()
    await asyncio.wait_for(first, 10)
    before = await released()
    assert len(before) == 4 and await broker.r.exists(keys.plan(0))

    await broker.r.set(keys.finished(0), n)  # capacity frees: the rest may go
    await asyncio.wait_for(Controller(cfg, broker).release_step(0, asyncio.Event()), 10)
    after = await released()
    assert Counter(after) == Counter(f"0:{g}:{s}" for g in range(cfg.controller.prompts_per_step)
                                     for s in range(cfg.controller.group_size))  # fmt: skip
    assert after[:4] == before
    assert int(await broker.r.get(keys.released(0)) or 0) == n
    # a third controller finds everything released and releases nothing
    await asyncio.wait_for(Controller(cfg, broker).release_step(0, asyncio.Event()), 10)
    assert len(await released()) == n


# ------------------------------- e) a real torch trainer SIGKILLed mid-step, replayed exactly


@pytest.mark.slow
def test_torch_trainer_sigkill_mid_step_resumes_exactly(
    tmp_path: Path, run_name: str, redis_url: str, sr: redis.Redis, model_cache: str
) -> None:
    """A real run (transformers engine, torch trainer) whose trainer is SIGKILLed in the middle of
    step 1, with some of the step's groups already trained, and restarted.  Replaying the committed
    mini-batches (metrics.jsonl, groups.msgpack) through one uninterrupted backend from v0 gives the
    final published weights.  Catches: a resume from the initial weights or a fresh AdamW, a group
    trained twice or lost in the redo, and a log that does not match what was trained."""
    from rolloutpipe.roles.trainer.backends import TorchBackend

    steps = 3
    cfg = make_config(
        tmp_path,
        run_name,
        f"model.cache_dir={model_cache}",
        "controller.mode=cgp",
        f"controller.steps={steps}",
        "controller.prompts_per_step=8",
        "controller.group_size=4",
        "controller.minibatches=2",
        "rollout.workers=1",
        "trainer.record_groups=true",
        "trainer.keep_versions=0",
        "trainer.lr=0.003",
    )
    out, keys = Path(cfg.out), Keys(run_name)
    cluster = start_cluster(cfg, redis_url)
    try:
        d = Driver(cluster, sr)
        trainer = next(rp for rp in cluster.procs if rp.name == "trainer")
        d.until(
            lambda: version(sr, run_name) == 1 and int(sr.xpending(keys.groups, "trainer")["pending"]) >= 2,
            120,
            "step 1 partly trained",
        )
        d.kill(trainer)
        cluster.spawn("trainer", "trainer-2", ["--out", str(out)])
        d.until(lambda: version(sr, run_name) >= steps, 120, f"version {steps}")
        assert "resumed from checkpoint ckpt-000001" in (out / "logs" / "trainer-2.log").read_text()
    finally:
        stop_cluster(cluster, sr)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    logged = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
    assert Counter(g.group_id for g in logged) == {f"{s}:{g}": 1 for s in range(steps) for g in range(8)}
    by_id = {g.group_id: g for g in logged}
    be = TorchBackend(cfg)
    be.model.load_state_dict(load_weights(out, 0))
    for row in rows:
        be.begin_step(row["step"])
        for mb in row["minibatches"]:
            for gid in mb:
                be.accumulate(by_id[gid])
            be.optimizer_step()
    final = load_weights(out, steps)
    assert max_abs_diff(be.state_dict(), final) <= 1e-6
    assert max_abs_diff(load_weights(out, 0), final) > 1e-4
