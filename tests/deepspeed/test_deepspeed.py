"""The DeepSpeed ZeRO trainer, 2 processes under torchrun on CPU (gloo), against ``TorchBackend``.

* ``test_same_maths_as_torch_backend``: the same mini-batches through ``DeepSpeedBackend`` (rank 0
  leads, rank 1 follows) and ``TorchBackend``; every optimizer step's loss, clip fraction and
  pre-clip gradient norm must agree to float precision.  The gradient norm is what pins the
  normaliser: with the clip active and AdamW, a wrong constant factor (per-rank instead of global
  token count, a missing 1/world) would barely move the weights, but it scales the norm.
* ``test_trainer_under_torchrun``: ``torchrun … -m rolloutpipe trainer`` (or the ``deepspeed``
  launcher) with the deepspeed backend consumes the groups from the real Redis stream (rank 0
  runs the unchanged Trainer: fence, dedupe, acks), publishes weights equal to TorchBackend's,
  and every rank exits 0.
* ``test_follower_does_not_outlive_rank_0``: rank 0 killed, rank 1 exits instead of waiting.

fp32 weights are compared with an absolute tolerance of 1e-4 (``FP32``): AdamW divides each gradient
element by its own magnitude, so an element whose gradient is at rounding level (e.g. 2e-9, next
to a median of 6e-3) still moves by ``lr * g / (|g| + eps)``, and the rounding difference of the
two summation orders (one batch vs. two ranks' sums) shows there as up to ~1% of ``lr``.
Measured (lr 3e-3, 4 optimizer steps): ZeRO-1/2 ~7e-7, ZeRO-3 ~3.6e-5.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import redis

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import GroupPlan, StepPlan
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.config import Config
from tests.deepspeed.ds_groups import GPM, GROUPS, G, make_groups, minibatches
from tests.support.config import ROOT, make_config
from tests.support.helpers import load_weights, max_abs_diff, step_metrics, version

pytestmark = [pytest.mark.deepspeed, pytest.mark.timeout(600)]

STEPS = 2
LR = 0.003


class Tol(NamedTuple):
    grad_norm_rtol: float
    loss_atol: float
    clipfrac_atol: float
    weights_atol: float


# fp32.  Weights: see the module docstring.  The gradient norm is checked on every optimizer step:
# the first at equal weights (measured 5e-8 relative), later ones at weights that already differ
# by that AdamW noise (measured up to 2e-6).
FP32 = Tol(grad_norm_rtol=1e-5, loss_atol=1e-6, clipfrac_atol=1e-9, weights_atol=1e-4)
# bf16 DeepSpeed against fp32 torch, only a sanity bound (measured: grad norm 1%, loss 2e-3,
# published bf16 weights 2e-2 after 4 steps at lr 3e-3).
BF16 = Tol(grad_norm_rtol=3e-2, loss_atol=1e-2, clipfrac_atol=0.1, weights_atol=5e-2)

# "--" ends torchrun's options: without it, its argparse takes the trainer's "--run" for an
# ambiguous abbreviation of its own "--run-path" and exits.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "--"]


def _config(tmp_path: Path, run: str, model_cache: str, *overrides: str) -> Config:
    cfg = make_config(
        tmp_path,
        run,
        "controller.mode=cgp",
        f"controller.steps={STEPS}",
        f"controller.prompts_per_step={GROUPS}",
        f"controller.group_size={G}",
        f"controller.minibatches={GROUPS // GPM}",
        "trainer.backend=deepspeed",
        "trainer.deepspeed.dtype=fp32",
        f"trainer.lr={LR}",
        "trainer.keep_versions=0",
        f"model.cache_dir={model_cache}",
        *overrides,
    )
    Path(cfg.out).mkdir(parents=True)
    cfg.dump_yaml(Path(cfg.out) / "config.yaml")
    return cfg


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RP_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


SAME_MATHS = [
    pytest.param(1, "fp32", "engine", "token-mean", FP32, id="zero1"),
    pytest.param(2, "fp32", "engine", "token-mean", FP32, id="zero2"),
    pytest.param(3, "fp32", "engine", "token-mean", FP32, id="zero3"),
    pytest.param(3, "fp32", "frozen", "token-mean", FP32, id="zero3-frozen"),
    pytest.param(2, "fp32", "frozen", "seq-mean-token-mean", FP32, id="zero2-frozen-seqmean"),
    # each rank holds half of every group: its numerator divides by the whole group's tokens
    pytest.param(2, "fp32", "engine", "group-mean-token-mean", FP32, id="zero2-groupmean"),
    pytest.param(3, "bf16", "engine", "token-mean", BF16, id="zero3-bf16"),
    # the other loss options of docs/grpo.md, through the same grpo.group_loss
    pytest.param(
        2, "fp32", "recompute", "seq-mean-token-sum-norm", FP32, id="zero2-recompute-sumnorm-options"
    ),
]
# zero2-recompute-sumnorm-options also sets these (asymmetric clip, no dual clip, entropy) and TIS
OPTIONS = (
    "trainer.clip_low=0.1",
    "trainer.clip_high=0.28",
    "trainer.clip_ratio_c=null",
    "trainer.entropy_coef=0.05",
)


@pytest.mark.parametrize(("stage", "dtype", "old_logprobs", "loss_agg", "tol"), SAME_MATHS)
def test_same_maths_as_torch_backend(
    stage: int, dtype: str, old_logprobs: str, loss_agg: str, tol: Tol, tmp_path: Path, model_cache: str
) -> None:
    cfg = _config(
        tmp_path,
        "replay",
        model_cache,
        f"trainer.deepspeed.zero_stage={stage}",
        f"trainer.deepspeed.dtype={dtype}",
        f"trainer.old_logprobs={old_logprobs}",
        f"trainer.loss_agg={loss_agg}",
        *(OPTIONS if loss_agg.startswith("seq-mean-token-sum") else ()),
        *(("trainer.tis_cap=1.5",) if loss_agg == "seq-mean-token-sum-norm" else ()),
    )
    rng = np.random.default_rng(stage)
    groups = [g for s in range(STEPS) for g in make_groups(cfg, s, rng)]
    (tmp_path / "groups.msgpack").write_bytes(b"".join(DEFAULT_CODEC.encode(g) for g in groups))
    report = tmp_path / "report.json"
    args = [str(Path(cfg.out) / "config.yaml"), str(tmp_path / "groups.msgpack"), str(report)]
    p = subprocess.run(
        [*TORCHRUN, "tests.deepspeed.ds_replay", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    rep = json.loads(report.read_text())
    rows, diffs = rep["steps"], rep["weight_diffs"]
    assert len(rows) == STEPS * GROUPS // GPM
    gn = max(abs(row["ds"]["grad_norm"] / row["torch"]["grad_norm"] - 1) for row in rows)
    loss = max(abs(row["ds"]["loss"] - row["torch"]["loss"]) for row in rows)
    clipfrac = max(abs(row["ds"]["clipfrac"] - row["torch"]["clipfrac"]) for row in rows)
    print(
        f"ZeRO-{stage} {dtype} {old_logprobs} {loss_agg}: weight diffs per version {diffs}, "
        f"grad-norm rel. diff <= {gn:.2g}, loss diff <= {loss:.2g}, clipfrac diff <= {clipfrac:.2g}"
    )
    assert gn <= tol.grad_norm_rtol, rows
    assert loss <= tol.loss_atol, rows
    assert clipfrac <= tol.clipfrac_atol, rows
    assert any(row["torch"]["grad_norm"] > cfg.trainer.grad_clip for row in rows)  # the clip bites
    assert diffs[0] == 0.0 or dtype == "bf16"  # same start (bf16 publishes its rounded copy)
    assert max(diffs) <= tol.weights_atol, diffs


def _wait(r: redis.Redis, cfg: Config, v: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while version(r, cfg.run) < v:
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}):\n{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"version {v} not published:\n{log.read_text()[-6000:]}")
        time.sleep(0.05)


def _deepspeed_launcher() -> list[str]:
    """The ``deepspeed`` launcher; ``--no_local_rank``: the CLI takes no ``--local_rank``."""
    ds = Path(sys.executable).parent / "deepspeed"
    return [str(ds), "--num_gpus=2", "--no_local_rank", f"--master_port={_free_port()}", "--module"]


@pytest.mark.parametrize(
    ("stage", "launcher"),
    [(1, "deepspeed"), (2, "torchrun"), (3, "torchrun")],
    ids=["zero1-deepspeed-launcher", "zero2-torchrun", "zero3-torchrun"],
)
def test_trainer_under_torchrun(
    stage: int, launcher: str, tmp_path: Path, redis_url: str, model_cache: str, run_name: str
) -> None:
    from rolloutpipe.roles.trainer.backends import TorchBackend

    cfg = _config(tmp_path, run_name, model_cache, f"trainer.deepspeed.zero_stage={stage}")
    out = Path(cfg.out)
    rng = np.random.default_rng(10 + stage)
    steps = [make_groups(cfg, s, rng) for s in range(STEPS)]
    cmd = [*(TORCHRUN if launcher == "torchrun" else _deepspeed_launcher()), "rolloutpipe", "trainer"]
    cmd += [str(out / "config.yaml"), "--redis-url", redis_url]
    cmd += ["--run", cfg.run, "--out", str(out)]
    keys = Keys(cfg.run)
    r = redis.Redis.from_url(redis_url)
    log = out / "torchrun.log"
    with log.open("wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        try:
            for step, groups in enumerate(steps):
                _wait(r, cfg, step, proc, log)
                plan = StepPlan(
                    run=cfg.run,
                    step=step,
                    policy_version=step,
                    policy="fifo",
                    groups=[GroupPlan(group_id=g.group_id, prompt_index=g.prompt_index, n=len(g.samples))
                            for g in groups],
                    minibatches=GROUPS // GPM,
                    groups_per_minibatch=GPM,
                    created_at=time.time(),
                )  # fmt: skip
                assert plan.n_groups == GROUPS
                r.set(keys.plan(step), DEFAULT_CODEC.encode(plan))
                for g in groups:
                    r.xadd(keys.groups, {DATA: DEFAULT_CODEC.encode(g)})
            _wait(r, cfg, STEPS, proc, log)
            r.set(keys.done, b"1")  # what the controller does after its last step
            rc = proc.wait(120)  # the run is done: rank 0 returns, rank 1 is told to stop
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert rc == 0, text[-6000:]
    assert "rank 1: rank 0 said stop" in text, text[-6000:]
    metrics = step_metrics(r, cfg.run)
    r.close()
    want_mbs = [[[g.group_id for g in mb] for mb in minibatches(gs)] for gs in steps]
    assert [m.minibatches for m in metrics] == want_mbs
    assert all(m.fence_rejections == 0 for m in metrics)

    ref = TorchBackend(cfg)
    want = [ref.state_dict()]
    for step, groups in enumerate(steps):
        ref.begin_step(step)
        for mb in minibatches(groups):
            for g in mb:
                ref.accumulate(g)
            ref.optimizer_step()
        want.append(ref.state_dict())
    assert max_abs_diff(load_weights(out, 0), want[0]) == 0.0
    diffs = [max_abs_diff(load_weights(out, v), want[v]) for v in range(1, STEPS + 1)]
    print(f"ZeRO-{stage} under {launcher}: weight diffs per version {diffs}")
    assert max(diffs) <= FP32.weights_atol, diffs
    assert max_abs_diff(want[0], want[STEPS]) > 10 * FP32.weights_atol  # training did move them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_follower_does_not_outlive_rank_0(
    tmp_path: Path, redis_url: str, model_cache: str, run_name: str
) -> None:
    """Started by hand (no torchrun to tear the group down): rank 0 is killed, rank 1 must exit."""
    cfg = _config(tmp_path, run_name, model_cache, "trainer.deepspeed.zero_stage=2")
    out = Path(cfg.out)
    dist = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, "-m", "rolloutpipe", "trainer", str(out / "config.yaml")]
    cmd += ["--redis-url", redis_url, "--run", cfg.run, "--out", str(out)]
    procs = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), **dist)
        with (out / f"rank{rank}.log").open("wb") as lf:
            procs.append(subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    r = redis.Redis.from_url(redis_url)
    try:
        _wait(r, cfg, 0, procs[0], out / "rank0.log")  # both ranks are up: version 0 is published
        time.sleep(1.0)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        t0 = time.monotonic()
        rc = procs[1].wait(200)
        waited = time.monotonic() - t0
    finally:
        r.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = (out / "rank1.log").read_text()
    print(f"rank 1 exited {rc} {waited:.1f}s after rank 0 was killed")
    assert rc != 0, text[-3000:]
    assert "failed while following rank 0" in text, text[-3000:]
