"""``trainer.flat_minibatch``: a mini-batch whose loss has no gradient takes no optimizer step under
``skip``, and AdamW's step on it moves the weights under ``step`` (so the option is not a no-op).

Every advantage 0 and no KL or entropy term make the gradient exactly zero; AdamW's update is then
its momentum from the last real step, so under ``step`` a flat mini-batch repeats the last
direction.  That is what VIGOR's streaming runs into: its flat groups are final first and fill
whole mini-batches (docs/allocation.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from rolloutpipe.broker.events import Group
from rolloutpipe.config import TrainerConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.rl.grpo import has_gradient
from rolloutpipe.roles.trainer.backends import TorchBackend
from rolloutpipe.roles.trainer.step import Barrier, Pipelined, StepClock, step_rule
from tests.support.config import make_config
from tests.support.events import make_group

ZERO, SIGNAL = np.zeros(4, np.float32), np.array([-1.0, 1.0, -1.0, 1.0], np.float32)


def _group(gid: str, adv: np.ndarray) -> Group:
    g = make_group()
    rng = np.random.default_rng(int(gid.split(":")[1]))
    samples = [  # ids the tiny model's vocabulary holds
        s.model_copy(update={"prompt_ids": np.array([1, 2, 3], np.int32),
                             "response_ids": rng.integers(4, 18, size=len(s.response_ids)).astype(np.int32)})
        for s in g.samples
    ]  # fmt: skip
    return g.model_copy(update={"group_id": gid, "samples": samples, "advantages": adv})


def test_a_loss_has_a_gradient_with_one_nonzero_advantage_or_a_kl_or_entropy_term() -> None:
    tc = TrainerConfig()
    assert not has_gradient(tc, [ZERO, ZERO])
    assert not has_gradient(tc, [])
    assert has_gradient(tc, [ZERO, np.array([0, 0, 0, 1e-3], np.float32)])
    assert has_gradient(TrainerConfig(kl_coef=0.01), [ZERO])
    assert has_gradient(TrainerConfig(entropy_coef=-0.01), [ZERO])
    assert step_rule(tc)([_group("0:0", ZERO)])  # step (the default): every mini-batch steps
    skip = step_rule(TrainerConfig(flat_minibatch="skip"))
    assert not skip([_group("0:0", ZERO), _group("0:1", ZERO)])
    assert skip([_group("0:0", ZERO), _group("0:1", SIGNAL)])


def test_the_deepspeed_backend_refuses_skip() -> None:
    with pytest.raises((ConfigError, ValueError), match="flat_minibatch=skip"):
        TrainerConfig(backend="deepspeed", flat_minibatch="skip")


@pytest.mark.parametrize("schedule", [Pipelined, Barrier])
@pytest.mark.parametrize("mode", ["step", "skip"])
def test_a_flat_minibatch_after_a_real_one(
    tmp_path: Path, model_cache: str, mode: str, schedule: type
) -> None:
    cfg = make_config(tmp_path, "flat", f"model.cache_dir={model_cache}", f"trainer.flat_minibatch={mode}",
                      "trainer.lr=0.01")  # fmt: skip
    be = TorchBackend(cfg)
    params = list(be.model.parameters())
    sched = schedule(be, StepClock(), 2, step_rule(cfg.trainer))
    groups = [_group("0:0", SIGNAL), _group("0:1", SIGNAL), _group("0:2", ZERO), _group("0:3", ZERO)]

    async def run() -> list[torch.Tensor]:
        await sched.add(groups[0], left=3)
        await sched.add(groups[1], left=2)  # mini-batch 0 closes (Pipelined): a real step
        after_real = [p.detach().clone() for p in params]
        await sched.add(groups[2], left=1)
        await sched.add(groups[3], left=0)
        await sched.finish()
        return after_real

    after_real = asyncio.run(run())
    assert sched.minibatches == [["0:0", "0:1"], ["0:2", "0:3"]]
    opt_steps = {int(s["step"]) for s in be.opt.state.values()}  # AdamW's step count, per parameter
    moved = any(not torch.equal(a, p) for a, p in zip(after_real, params, strict=True))
    if mode == "skip":
        assert sched.flat == [1] and opt_steps == {1}
        assert all(p.grad is None for p in params)  # no gradient carried into the next mini-batch
        if schedule is Pipelined:  # (the barrier trains nothing before the last group)
            assert not moved  # the weights stay exactly where the real step put them
    else:
        assert sched.flat == [] and opt_steps == {2}
        if schedule is Pipelined:
            assert moved  # AdamW's step on a zero gradient moves the weights: what skip avoids
